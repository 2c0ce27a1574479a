"""Back-to-back inferences in one static schedule (``codegen/stream.py``, ``lpx-tvm profile --stream``)."""

from math import ceil

import numpy as np
import pytest
from onnx import helper

from conftest import cnn_model, make_model, ort_run, tensor_info
from lpx_tvm.app.cli import main
from lpx_tvm.compiler import compile_stream
from lpx_tvm.runtime_sim import Opcode, Simulator, load_config


def relu_model():
    return make_model([helper.make_node("Relu", ["x"], ["y"])], [tensor_info("x", [64, 256])],
                      [tensor_info("y", [64, 256])], [])


def test_a_link_bound_stream_keeps_the_host_link_busy_from_first_load_to_last_store():
    """Three inferences of a ReLU over 64·256 fp32 (65,536 bytes each way, in four 16 KiB host bands): the
    host link carries 6 transfers of 4·ceil(16384 / host bytes per cycle) cycles back to back, the ReLUs
    hide under them, and the last store's MEM latency ends the run."""
    chip = load_config("tiny")
    program = compile_stream(relu_model(), 3, "tiny")
    transfer = 4 * ceil(16384 / chip.host_bytes_per_cycle)
    assert Simulator(program, timing_only=True).stats.cycles == 6 * transfer + chip.latency_cycles["MEM"]
    assert [i.opcode for i in program.instructions].count(Opcode.RELU) == 3


def test_every_inference_of_a_stream_gives_its_own_answer(rng):
    model = cnn_model()
    program = compile_stream(model, 2, "tiny")
    xs = [rng.standard_normal((1, 3, 32, 32)).astype(np.float32) for _ in range(2)]
    outputs = Simulator(program).run(xs)
    assert len(program.inputs) == len(program.outputs) == 2
    assert len(program.constants) == len(compile_stream(model, 1, "tiny").constants)  # one copy of the weights
    for x, out in zip(xs, outputs):
        np.testing.assert_allclose(out, ort_run(model, {"x": x})[0], rtol=1e-4, atol=1e-5)


def test_a_stream_of_a_model_split_over_programs_is_refused():
    model = make_model([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Floor", ["r"], ["y"])],
                       [tensor_info("x", [4, 8])], [tensor_info("y", [4, 8])], [])
    with pytest.raises(ValueError, match="one lpx program with nothing on the host; this one has 1 lpx programs "
                                         "and host ops {'relax.floor': 1}"):
        compile_stream(model, 2, "tiny")


def test_profile_stream_prints_inferences_per_second(tmp_path, capsys):
    import onnx

    path = tmp_path / "relu.onnx"
    onnx.save(relu_model(), path)
    assert main(["profile", str(path), "--config", "tiny", "--stream", "3"]) == 0
    chip = load_config("tiny")
    cycles = 6 * 4 * ceil(16384 / chip.host_bytes_per_cycle) + chip.latency_cycles["MEM"]
    assert f"stream of 3 back-to-back inferences: {cycles} cycles, {cycles / 3:.0f} per inference = " \
           f"{3 * chip.clock_hz / cycles:.0f} inferences/s" in capsys.readouterr().out
