"""All programs of one model share a chip's SRAM: their weights resident side by side, activations above."""

import dataclasses

import numpy as np
import pytest

import lpx_tvm
from lpx_tvm.runtime_sim import ProgramFormatError, ScheduleError, Simulator, TensorRef, decode
from lpx_tvm.runtime_sim.chip import Chip
from conftest import assert_close, ort_run, host_op_between_model, run_on_lpx


@pytest.fixture(scope="module")
def programs():
    compiled = lpx_tvm.compile(host_op_between_model(), config="tiny")
    return compiled, [decode(blob) for blob in compiled.programs.values()]


def test_programs_of_one_model_share_a_plan_with_disjoint_weights(programs):
    compiled, (first, second) = programs
    assert first.plan == second.plan and first.plan.model
    ranges = sorted((min(c.ref.addr for c in p.constants), max(c.ref.end for c in p.constants))
                    for p in (first, second))
    assert ranges[0][1] <= ranges[1][0] <= ranges[1][1] <= first.plan.activation_base
    for p in (first, second):  # every activation lives above every weight
        assert all(r.addr >= p.plan.activation_base for i in p.instructions for r in i.srcs + i.dsts
                   if r.in_sram and not any(c.ref.addr <= r.addr < c.ref.end for c in p.constants))
    x = np.random.default_rng(0).standard_normal((1, 3, 16, 16)).astype(np.float32)
    # both programs ran on lpx (two lpx calls), the Floor between them, and only it, on the host
    (y,) = run_on_lpx(compiled, [x], programs=2, host_ops={"relax.floor": 1})
    assert_close(y, ort_run(host_op_between_model(), {"x": x})[0], 1e-5)


def test_a_program_writing_over_its_siblings_weights_is_rejected(programs):
    _, (first, second) = programs
    other = min(c.ref.addr for c in second.constants)
    victim = next(i for i, ins in enumerate(first.instructions) if ins.dsts and ins.dsts[0].in_sram)
    ins = first.instructions[victim]
    moved = dataclasses.replace(ins, dsts=(TensorRef(other, ins.dsts[0].shape, ins.dsts[0].dtype),))
    damaged = dataclasses.replace(first, instructions=first.instructions[:victim] + (moved,)
                                  + first.instructions[victim + 1:])
    with pytest.raises(ScheduleError, match="live constant overwritten"):
        Simulator(damaged)


def test_a_chip_refuses_overlapping_weights_of_two_programs(programs):
    _, (first, second) = programs
    chip = Chip(first.plan.sram_bytes)
    chip.load(first)
    shifted = dataclasses.replace(second, constants=tuple(
        dataclasses.replace(c, ref=dataclasses.replace(c.ref, addr=c.ref.addr - 64 * (c.ref.addr // 64 > 0)))
        for c in second.constants[:1]) + second.constants[1:], digest=b"other")
    with pytest.raises(ProgramFormatError, match="overlap another program's"):
        chip.load(shifted, check_schedule=False)
    assert chip.sram.size == first.plan.sram_bytes < 4 << 20  # the plan's need, not the chip's 4 MiB


@pytest.mark.parametrize("columns, streams", [(31760, False), (31760 + 32, True)])
@pytest.mark.slow
def test_weights_stay_resident_up_to_what_the_activations_leave_free(columns, streams):
    """y = x @ W on the tiny chip (4,194,304 bytes of SRAM; K = 32 is one row tile, so no partial sums):
    the activations' peak is x and y live together, 32·4 + 4·N bytes. At N = 31,760 the weight's 128·N =
    4,065,280 bytes and the peak's 127,168 make 4,192,448: it stays resident (half of SRAM, the old cap,
    would have streamed it). One column tile more (N = 31,792: 4,069,376 + 127,296 = 4,196,672) does not fit
    and the weight streams."""
    from onnx import helper

    from conftest import make_model, run_on_lpx, tensor_info, weights
    from lpx_tvm.runtime_sim import Opcode

    rng = np.random.default_rng(7)
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["y"])], [tensor_info("x", [1, 32])],
                       [tensor_info("y", [1, columns])], [weights(rng, "w", (32, columns), 0.1)])
    compiled = lpx_tvm.compile(model, config="tiny")
    (program,) = (decode(blob) for blob in compiled.programs.values())
    assert bool(program.streamed) == streams
    assert any(i.opcode == Opcode.STREAM for i in program.instructions) == streams
    assert sum(c.ref.nbytes for c in program.constants) == (0 if streams else 32 * columns * 4)
    x = rng.standard_normal((1, 32)).astype(np.float32)
    (out,) = run_on_lpx(compiled, [x])
    np.testing.assert_allclose(out, x @ numpy_weight(model), rtol=1e-5, atol=1e-5)


def numpy_weight(model):
    from onnx import numpy_helper

    return numpy_helper.to_array(model.graph.initializer[0])


def test_weights_that_cannot_fit_or_stream_name_their_layers_and_the_way_out(rng):
    """Two 3x3 convolutions of 256 channels hold 2 x 2,359,296 fp32 bytes, more than the tiny chip's
    4,194,304, and convolution weights do not stream: the error names both layers (by their Relax name and
    the ONNX tensor each computes, 'a' and 'y') and what to do."""
    from onnx import helper

    from conftest import make_model, tensor_info, weights
    from lpx_tvm.codegen import CapacityError

    model = make_model([helper.make_node("Conv", ["x", "w1"], ["a"], pads=[1, 1, 1, 1]),
                        helper.make_node("Conv", ["a", "w2"], ["y"], pads=[1, 1, 1, 1])],
                       [tensor_info("x", [1, 256, 4, 4])], [tensor_info("y", [1, 256, 4, 4])],
                       [weights(rng, "w1", (256, 256, 3, 3)), weights(rng, "w2", (256, 256, 3, 3))])
    with pytest.raises(CapacityError, match=r"weights need 4718592 bytes of SRAM; chip 'tiny' has 4194304\. The "
                                            r"largest: 2359296 bytes in 'a' \(conv2d_1\), 2359296 bytes in 'y' \(conv2d_2\)\. "
                                            r"Store them smaller \(dtype fp16, fp8 or int8\) or spread the model"):
        lpx_tvm.compile(model, config="tiny")
