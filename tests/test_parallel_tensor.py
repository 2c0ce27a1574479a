"""Tensor parallel (codegen/parallel/tensor.py): plain MLPs on a ring of chips, every rank on one schedule."""

import numpy as np
import pytest

from conftest import mlp_stack, ort_reference, run_on_lpx
import lpx_tvm
from lpx_tvm.runtime_sim import Opcode


def _one_schedule(sim):
    """Every chip issues its k-th instruction (STOREs aside: only chip 0 stores a whole output) at one cycle."""
    issues = [[(ins.cycle, ins.opcode) for ins in s.program.instructions if ins.opcode != Opcode.STORE]
              for s in sim.sims]
    return all(row == issues[0] for row in issues[1:])


@pytest.mark.parametrize("chips", [2, 4, 8])
def test_a_four_layer_mlp_runs_tensor_parallel_and_matches_onnx_runtime(chips):
    """The review's case: 512 wide, bias and ReLU between layers, batch 8. At 4 and 8 chips each rank used to
    be scheduled on its own and the compile failed ("the chips' schedules part")."""
    rng = np.random.default_rng(0)
    model = mlp_stack(rng, [512] * 5, batch=8)
    x = rng.standard_normal((8, 512)).astype(np.float32)
    compiled = lpx_tvm.compile(model, system="tsp-node", parallel="tensor", chips=chips)
    (out,) = run_on_lpx(compiled, [x])
    (sim,) = compiled.simulators.values()
    assert len(sim.sims) == chips and sim.program.parallel == "tensor"
    # layers 3-4 pair (Megatron: columns, then rows and one all-reduce); layers 1 and 2 split by columns and
    # gather, since layer 2's fused ReLU must follow the sum of its partial results, which rows would split
    assert "2 all-gathers, 1 all-reduces" in sim.program.notes
    assert _one_schedule(sim)
    np.testing.assert_allclose(out, ort_reference(model, {"x": x})[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("widths, batch", [([96, 200, 72], 3), ([130, 130, 130, 130, 130, 130, 130], 1),
                                           ([40, 640, 40], 5)])
@pytest.mark.parametrize("chips", [3, 4, 6])
def test_mlps_of_other_widths_and_depths_match_onnx_runtime(widths, batch, chips):
    """Widths that are no multiple of 320 nor of the chips (uneven products pad their last slices)."""
    rng = np.random.default_rng(sum(widths) + chips)
    model = mlp_stack(rng, widths, batch)
    x = rng.standard_normal((batch, widths[0])).astype(np.float32)
    compiled = lpx_tvm.compile(model, system="tsp-node", parallel="tensor", chips=chips)
    (out,) = run_on_lpx(compiled, [x])
    (sim,) = compiled.simulators.values()
    assert len(sim.sims) == chips and _one_schedule(sim)
    np.testing.assert_allclose(out, ort_reference(model, {"x": x})[0], rtol=1e-5, atol=1e-5)
