"""Vector ops chained ALU to ALU, worked by hand on the tiny preset (32 lanes, 4 ALUs a lane, 4 vector queues,
8 streams a direction, latencies MEM 4 / VXM 4, host link 10 bytes a cycle).

A chain's ops pass each vector straight on, so they run at one pace: no faster than its slowest op, and no
faster than the lane's ALUs can do all of their work side by side."""

from math import ceil

import numpy as np
import pytest
from onnx import helper

import lpx_tvm
from conftest import make_model, ort_run, run_on_lpx, tensor_info
from lpx_tvm.app.tools.zoo import output_step
from lpx_tvm.runtime_sim import DType, Opcode, ScheduleError, Simulator, Space, TensorRef, decode
from programs import TINY, Layout, ins, program

ERF_OPS, MUL_OPS = 8, 1  # ALU operations an element (the op table's cost classes)


def _stream(number, shape):
    return TensorRef(number, tuple(shape), DType.F32, None, Space.STREAM)


def test_a_chain_runs_at_the_pace_its_lane_alus_allow_not_its_slowest_op():
    """erf(x) · y over 8 vectors. Alone, the erf takes 2 cycles a vector on the lane's 4 ALUs (16 cycles),
    the multiply 1 (8). Chained, both run side by side on the same ALUs: 8 · (8 + 1) = 72 operations a lane,
    4 a cycle, 18 cycles for each; the multiply starts one vector-queue latency after the erf."""
    layout = Layout()
    x = layout.const(np.ones((8, 32), np.float32))
    y = layout.const(np.ones((8, 32), np.float32))
    out = layout.take((8, 32), DType.F32)
    vectors = 8 * 32 // TINY.lanes
    pace = ceil(vectors * (ERF_OPS + MUL_OPS) / TINY.vxm_alus_per_lane)
    latency = TINY.latency_cycles["VXM"]
    code = [ins("ERF", [x], [_stream(1, (8, 32))], cycle=0, unit_index=0),
            ins("MUL", [_stream(1, (8, 32)), y], [out], cycle=latency, unit_index=1)]
    expected = latency + pace + latency
    assert Simulator(program(code, layout, predicted=expected), timing_only=True).stats.cycles == expected == 26
    slowest_alone = latency + vectors * ceil(ERF_OPS / TINY.vxm_alus_per_lane) + latency  # 24
    with pytest.raises(ScheduleError, match="predicts 24 cycles, the schedule takes 26"):
        Simulator(program(code, layout, predicted=slowest_alone), timing_only=True)


def test_the_compiler_chains_erf_into_the_multiply_that_reads_it(rng):
    """erf(x) · x on [2, 32]: the erf's result streams into the multiply (no SRAM tensor between them). The
    2 vectors take (2 · 8 + 2 · 1) / 4 → 5 cycles each after x crosses the link (256 bytes, 26 cycles, MEM
    latency 4); the result then crosses back. Unchained, the multiply would wait for the erf's result in
    SRAM: 30 + 4 + 4, then 2 + 4, and the store: 74 cycles, not 73."""
    model = make_model([helper.make_node("Erf", ["x"], ["e"]), helper.make_node("Mul", ["e", "x"], ["y"])],
                       [tensor_info("x", [2, 32])], [tensor_info("y", [2, 32])], [])
    compiled = lpx_tvm.compile(model, config="tiny")
    (prog,) = (decode(blob) for blob in compiled.programs.values())
    (erf,) = [i for i in prog.instructions if i.opcode == Opcode.ERF]
    (mul,) = [i for i in prog.instructions if i.opcode == Opcode.MUL]
    assert erf.dsts[0].space == Space.STREAM and Space.STREAM in {r.space for r in mul.srcs}
    link = ceil(2 * 32 * 4 / TINY.host_bytes_per_cycle)  # 26
    mem, vxm = TINY.latency_cycles["MEM"], TINY.latency_cycles["VXM"]
    pace = ceil(2 * (ERF_OPS + MUL_OPS) / TINY.vxm_alus_per_lane)
    assert erf.cycle == link + mem and mul.cycle == erf.cycle + vxm
    expected = link + mem + vxm + pace + vxm + link + mem
    assert Simulator(prog, timing_only=True).stats.cycles == expected == 73
    x = rng.standard_normal((2, 32)).astype(np.float32)
    (out,) = run_on_lpx(compiled, [x])
    np.testing.assert_allclose(out, ort_run(model, {"x": x})[0], rtol=1e-6, atol=1e-6)


def test_int8_a_constant_multiply_after_a_dequantise_is_the_dequantise_s_scale(rng):
    """erf(x) · ½ from ONNX Runtime's quantiser: DQ ─► Mul(½) ─► Q is one DEQUANTIZE whose scale is the
    erf's output scale halved, so no MUL pass runs; halving is exact, so the integers are ORT's."""
    half = helper.make_tensor("half", 1, [], [0.5])
    model = make_model([helper.make_node("Erf", ["x"], ["e"]), helper.make_node("Mul", ["e", "half"], ["y"])],
                       [tensor_info("x", [4, 64])], [tensor_info("y", [4, 64])], [half])
    feeds = [{"x": rng.standard_normal((4, 64)).astype(np.float32)} for _ in range(4)]
    qdq = lpx_tvm.quantize(model, feeds)
    compiled = lpx_tvm.compile(qdq, config="tiny", dtype="int8")
    (prog,) = (decode(blob) for blob in compiled.programs.values())
    opcodes = [i.opcode for i in prog.instructions]
    assert Opcode.MUL not in opcodes and Opcode.ERF in opcodes
    erf_q = [n for n in qdq.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "e"]
    (scale_name,) = [n.input[1] for n in erf_q]
    (erf_scale,) = [np.frombuffer(t.raw_data, np.float32) if t.raw_data else np.array(t.float_data, np.float32)
                    for t in qdq.graph.initializer if t.name == scale_name]
    scales = {i.attrs["scale"] for i in prog.instructions if i.opcode == Opcode.DEQUANTIZE}
    assert np.float32(erf_scale[0] * 0.5) in {np.float32(s) for s in scales}
    x = feeds[0]["x"]
    (out,) = run_on_lpx(compiled, [x])
    steps = np.rint(np.abs(out - ort_run(qdq, {"x": x})[0]) / output_step(qdq))
    assert steps.max() <= 1 and np.mean(steps == 0) >= 0.99


def test_the_chain_s_figures_are_its_units_busy_cycles_over_the_makespan():
    """The erf ─► multiply chain above: both vector queues are busy its pace (18 cycles each) of a 26-cycle
    program, 36 of the 4 queues' 104 cycles (a share of 9/26); nothing else runs. 8 vectors of 32 elements
    take 8 ALU operations each for the erf and 1 for the multiply: 2,304 FLOPs."""
    layout = Layout()
    x = layout.const(np.ones((8, 32), np.float32))
    y = layout.const(np.ones((8, 32), np.float32))
    out = layout.take((8, 32), DType.F32)
    latency = TINY.latency_cycles["VXM"]
    code = [ins("ERF", [x], [_stream(1, (8, 32))], cycle=0, unit_index=0),
            ins("MUL", [_stream(1, (8, 32)), y], [out], cycle=latency, unit_index=1)]
    stats = Simulator(program(code, layout, predicted=26), timing_only=True).stats
    pace = 18
    assert stats.unit_busy["VXM"] == 2 * pace
    assert stats.utilisation["VXM"] == pytest.approx(2 * pace / (TINY.unit_counts["VXM"] * 26))
    assert sum(v for u, v in stats.unit_busy.items() if u != "VXM") == 0
    assert stats.flops == 8 * 32 * (ERF_OPS + MUL_OPS)
    assert stats.macs == 0
    assert stats.mac_utilisation == 0.0
