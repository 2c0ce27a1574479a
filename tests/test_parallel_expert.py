"""Expert parallel (codegen/parallel/expert.py): a Mixtral-style block's experts spread over the chips."""

import numpy as np
import pytest

from conftest import ort_reference, run_on_lpx
import lpx_tvm
from lpx_tvm.app.models.moe import MoeConfig, build_moe_block
from lpx_tvm.codegen import SystemCompileError
from lpx_tvm.codegen.graph import Graph
from lpx_tvm.codegen.parallel.expert import find_experts

# top-k's selection runs on the host (TopK and the comparison that keeps the k largest); the rest on lpx
MOE_HOST_OPS = {"relax.topk": 1, "relax.min": 1, "relax.greater_equal": 1, "relax.astype": 1}


def _moe_graph(experts: int, alike: bool = True) -> Graph:
    """``y = x + Σ_e relu(x @ W_e) @ V_e`` on a [2, 8] input; with ``alike=False`` the last expert has a
    narrower hidden layer."""
    g = Graph()
    x = g.add_tensor((2, 8), "float32")
    g.inputs = [x]
    acc = None
    for e in range(experts):
        width = 4 if alike or e < experts - 1 else 3
        h = g.add_node("matmul", [x, g.constant(np.ones((8, width), np.float32))], (2, width), "float32", f"e{e}.up")
        r = g.add_node("RELU", [h], (2, width), "float32", f"e{e}.relu")
        y = g.add_node("matmul", [r, g.constant(np.ones((width, 8), np.float32))], (2, 8), "float32", f"e{e}.down")
        acc = y if acc is None else g.add_node("ADD", [acc, y], (2, 8), "float32", f"sum{e}")
    g.outputs = [g.add_node("ADD", [x, acc], (2, 8), "float32", "residual")]
    return g


def test_find_experts_names_each_experts_cone_and_the_residual():
    g = _moe_graph(3)
    found = find_experts(g)
    # nodes: expert e's up, relu, down at 3e, 3e+1, 3e+2 (+1 from e=2 on: the sums sit between)
    assert found.cones == [[0, 1, 2], [3, 4, 5], [7, 8, 9]]
    assert found.adds == [6, 10, 11] and found.others == [0]  # two sums and the residual add; x stays outside


def test_experts_that_differ_in_structure_are_not_a_mixture():
    assert find_experts(_moe_graph(3, alike=False)) is None


def test_a_graph_with_one_branch_is_not_a_mixture():
    assert find_experts(_moe_graph(1)) is None


@pytest.mark.parametrize("chips, per_chip", [(2, 4), (4, 2), (8, 1)])
def test_a_mixtral_block_runs_its_experts_on_different_chips_and_matches_onnx_runtime(chips, per_chip):
    model = build_moe_block(MoeConfig(hidden=64, ffn=128, experts=8, top_k=2, tokens=1))
    x = np.random.default_rng(3).standard_normal((1, 64)).astype(np.float32)
    compiled = lpx_tvm.compile(model, system="tsp-node", parallel="expert", chips=chips)
    # two programs: the router (its product and softmax, on one chip), then the gating, experts and combine
    (out,) = run_on_lpx(compiled, [x], programs=2, host_ops=MOE_HOST_OPS)
    router, block = compiled.simulators.values()
    assert len(router.sims) == 1 and router.program.notes == "no mixture of experts: whole on chip 0"
    assert len(block.sims) == chips
    assert f"8 experts over {chips} chips" in block.program.notes and f"{per_chip} a chip, 1 all-reduce" in \
        block.program.notes
    # each chip holds its experts' three weights (2 × 64·128 + 128·64 fp32) and the one-hot gate selectors
    expert_bytes = 3 * 64 * 128 * 4 + 8 * 4
    for sim in block.sims:
        held = sum(c.ref.nbytes for c in sim.program.constants)
        assert per_chip * expert_bytes <= held < (per_chip + 1) * expert_bytes
    np.testing.assert_allclose(out, ort_reference(model, {"x": x})[0], rtol=1e-5, atol=1e-5)


def test_experts_that_do_not_divide_the_chips_get_zero_weight_slots():
    model = build_moe_block(MoeConfig(hidden=64, ffn=32, experts=6, top_k=2, tokens=2))
    x = np.random.default_rng(4).standard_normal((2, 64)).astype(np.float32)
    compiled = lpx_tvm.compile(model, system="tsp-node", parallel="expert", chips=4)
    (out,) = run_on_lpx(compiled, [x], programs=2, host_ops=MOE_HOST_OPS)
    block = list(compiled.simulators.values())[1]
    assert "6 experts over 4 chips" in block.program.notes and "2 a chip (2 slots of zero weights)" in \
        block.program.notes
    np.testing.assert_allclose(out, ort_reference(model, {"x": x})[0], rtol=1e-5, atol=1e-5)


def test_an_output_that_does_not_split_for_the_all_reduce_is_named_at_compile_time():
    model = build_moe_block(MoeConfig(hidden=64, ffn=32, experts=8))
    with pytest.raises(SystemCompileError, match=r"64 wide\) does not split into 3 blocks"):
        lpx_tvm.compile(model, system="tsp-node", parallel="expert", chips=3)


def test_auto_maps_a_mixture_of_experts_by_its_experts():
    model = build_moe_block(MoeConfig(hidden=64, ffn=32, experts=4))
    x = np.random.default_rng(5).standard_normal((1, 64)).astype(np.float32)
    compiled = lpx_tvm.compile(model, system="tsp-node", parallel="auto", chips=4)
    (out,) = run_on_lpx(compiled, [x], programs=2, host_ops=MOE_HOST_OPS)
    block = list(compiled.simulators.values())[1]
    assert block.program.parallel == "expert" and block.program.notes.startswith("auto chose expert")
    np.testing.assert_allclose(out, ort_reference(model, {"x": x})[0], rtol=1e-5, atol=1e-5)
