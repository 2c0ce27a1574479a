"""Hand-worked cycle counts for the ops test_timing.py does not time: the switch's CONCAT, SLICE and IM2COL,
the ICU's NOP, a pooling window and a depthwise convolution, each one instruction alone on the tiny chip.

Every expected count is worked out here from tiny's preset (runtime_sim/configs/tiny.json: 32 lanes, 8 streams
a direction, vxm_alus 128 = 4 ALUs a lane, the switch moving 4 vectors a cycle, latencies MEM 4, MXM 8, VXM 4,
SXM 4, ICU 1), never by calling the timing code. The program's header states the count and the simulator
refuses a header that disagrees with the machine's rules, so each count is checked twice.
"""

from math import ceil

import numpy as np
import pytest

from lpx_tvm.runtime_sim import DType, Simulator
from programs import Layout, TINY, ins, program

F32 = DType.F32


def _timed_alone(opcode, srcs, dsts, layout, expected, **attrs):
    """Cycles of one instruction at cycle 0, its header stating ``expected``."""
    prog = program([ins(opcode, srcs, dsts, **attrs)], layout, predicted=expected)
    return Simulator(prog, timing_only=True).stats.cycles


def test_tiny_preset_has_the_figures_these_counts_are_worked_from():
    """The literals below assume these figures of tiny.json; a changed preset fails here first."""
    assert (TINY.lanes, TINY.streams_per_direction, TINY.vxm_alus_per_lane, TINY.sxm_vectors_per_cycle) == (32, 8, 4, 4)
    assert {u: TINY.latency_cycles[u] for u in ("MEM", "MXM", "VXM", "SXM", "ICU")} == \
        {"MEM": 4, "MXM": 8, "VXM": 4, "SXM": 4, "ICU": 1}


# the switch: vectors of 32 bytes (one a lane), the larger of what goes in and what comes out setting their
# number, min(4 a cycle, half of a direction's 8 streams) = 4 a cycle, then the switch's latency (4)
SWITCH_RATE = min(4, 8 // 2)


def test_a_concat_moves_both_inputs_through_the_switch():
    """[4, 32] and [2, 32] fp32 joined on axis 0 into [6, 32]: 512 + 256 = 768 bytes in, 768 out; 768 / 32 =
    24 vectors, 4 a cycle: 6 cycles, + latency 4 = 10. (Counting only the first input and not the output,
    512 / 32 = 16 vectors, would give 4 + 4 = 8. Counting the first input beside the output would still give
    10: a CONCAT's result is exactly as large as its inputs together, so the output side alone sets its count
    and no CONCAT can show whether the inputs are summed.)"""
    layout = Layout()
    a, b = layout.const(np.ones((4, 32), np.float32)), layout.const(np.ones((2, 32), np.float32))
    out = layout.take((6, 32), F32)
    vectors = (4 * 32 * 4 + 2 * 32 * 4) // 32  # 24
    assert out.nbytes == a.nbytes + b.nbytes == vectors * 32  # the output side is as large as the inputs'
    expected = ceil(vectors / SWITCH_RATE) + 4
    assert _timed_alone("CONCAT", [a, b], [out], layout, expected, axis=0) == expected == 10


def test_a_strided_slice_moves_its_whole_source_through_the_switch():
    """Every other row and column, from row 1, of [8, 64] fp32 into [4, 32]: the source's 2,048 bytes are the
    larger side (the result is 512): 2,048 / 32 = 64 vectors, 4 a cycle: 16 cycles, + latency 4 = 20.
    (The result's 512 bytes alone would be 16 vectors: 4 + 4 = 8.)"""
    layout = Layout()
    x, out = layout.const(np.ones((8, 64), np.float32)), layout.take((4, 32), F32)
    vectors = max(8 * 64 * 4, 4 * 32 * 4) // 32  # 64
    expected = ceil(vectors / SWITCH_RATE) + 4
    assert _timed_alone("SLICE", [x], [out], layout, expected, begin=(1, 0), step=(2, 2)) == expected == 20


def test_an_im2col_is_timed_by_the_columns_it_writes():
    """[1, 2, 4, 4] fp32, 2x2 window, stride 1, no padding: 3x3 windows, columns [1, 1, 2·2·2 = 8, 9], 72
    floats = 288 bytes out, larger than the 32 · 4 = 128 in: ceil(288 / 32) = 9 vectors, 4 a cycle:
    ceil(9 / 4) = 3 cycles, + latency 4 = 7."""
    layout = Layout()
    x, out = layout.const(np.ones((1, 2, 4, 4), np.float32)), layout.take((1, 1, 8, 9), F32)
    vectors = ceil(max(1 * 2 * 4 * 4 * 4, 1 * 1 * 8 * 9 * 4) / 32)  # 9
    expected = ceil(vectors / SWITCH_RATE) + 4
    assert _timed_alone("IM2COL", [x], [out], layout, expected, kernel=(2, 2)) == expected == 7


@pytest.mark.parametrize("cycles", [0, 5])
def test_a_nop_holds_the_icu_for_its_cycles(cycles):
    """A NOP of ``cycles`` holds the ICU that long, then its latency (1): 0 + 1 = 1 and 5 + 1 = 6."""
    expected = cycles + 1
    assert _timed_alone("NOP", [], [], Layout(), expected, cycles=cycles) == expected == {0: 1, 5: 6}[cycles]


def test_a_2x2_max_pool_of_stride_2_is_bound_by_its_streams():
    """[1, 4, 8, 16] fp32, 2x2 window, stride 2 ─► [1, 4, 4, 8]: 128 results = 4 vectors of 32 lanes. A window
    costs its 2·2 = 4 taps of ALU work an element: 4 ALU operations on a lane's 4 ALUs, 1 cycle a vector. Its
    streams: (2,048 bytes in + 512 out) / (4 vectors · 32 lanes) = 20 a vector, past a direction's 8:
    ceil(20 / 8) = 3 cycles a vector. 4 vectors · 3 = 12, + VXM latency 4 = 16."""
    layout = Layout()
    x, out = layout.const(np.ones((1, 4, 8, 16), np.float32)), layout.take((1, 4, 4, 8), F32)
    vectors = 4 * 4 * 8 // 32  # 4
    streams = (4 * 8 * 16 * 4 + 4 * 4 * 8 * 4) / (vectors * 32)  # 20.0
    step = max(ceil(2 * 2 / 4), ceil(streams / 8))  # 3
    expected = vectors * step + 4
    assert _timed_alone("MAXPOOL", [x], [out], layout, expected, kernel=(2, 2), stride=(2, 2)) == expected == 16


def test_a_3x3_int8_max_pool_is_bound_by_its_alus():
    """[1, 1, 10, 10] int8, 3x3 window, stride 1 ─► [1, 1, 8, 8]: 64 results = 2 vectors. 9 taps on a lane's 4
    ALUs: ceil(9 / 4) = 3 cycles a vector; streams (100 + 64 bytes) / (2 · 32) = 2.56 a vector, within 8.
    2 · 3 = 6, + latency 4 = 10. (A window costing kh + kw = 6 taps would take 2 cycles a vector: 8.)"""
    layout = Layout()
    x, out = layout.const(np.ones((1, 1, 10, 10), np.int8)), layout.take((1, 1, 8, 8), DType.I8)
    vectors = 8 * 8 // 32  # 2
    streams = (10 * 10 + 8 * 8) / (vectors * 32)  # 2.5625
    step = max(ceil(3 * 3 / 4), ceil(streams / 8))  # 3
    expected = vectors * step + 4
    assert _timed_alone("MAXPOOL", [x], [out], layout, expected, kernel=(3, 3)) == expected == 10


def test_a_depthwise_conv_costs_a_multiply_and_an_add_a_tap_and_its_epilogue():
    """x [1, 4, 6, 10] fp32, w [4, 3, 3], bias [4, 1, 1], 3x3 window, stride 1 ─► [1, 4, 4, 8]: 128 results =
    4 vectors. ALU operations an element: a multiply and an add for each of 9 taps (18) + the epilogue's 3
    (bias, activation, store) = 21; on a lane's 4 ALUs ceil(21 / 4) = 6 cycles a vector. Streams: (960 bytes
    of x + 144 of w + 16 of bias + 512 out) / (4 · 32) = 12.75 a vector: ceil(12.75 / 8) = 2 cycles, fewer.
    4 · 6 = 24, + VXM latency 4 = 28. (Without the epilogue's 3, ceil(18 / 4) = 5: 24; one operation a tap,
    ceil(12 / 4) = 3: 16.)"""
    layout = Layout()
    x = layout.const(np.ones((1, 4, 6, 10), np.float32))
    w = layout.const(np.ones((4, 3, 3), np.float32))
    bias = layout.const(np.zeros((4, 1, 1), np.float32))
    out = layout.take((1, 4, 4, 8), F32)
    vectors = 4 * 4 * 8 // 32  # 4
    alu_ops = 3 * 3 * 2 + 3  # 21
    streams = (4 * 6 * 10 * 4 + 4 * 9 * 4 + 4 * 4 + 4 * 4 * 8 * 4) / (vectors * 32)  # 12.75
    step = max(ceil(alu_ops / 4), ceil(streams / 8))  # 6
    expected = vectors * step + 4
    assert _timed_alone("DWCONV", [x, w, bias], [out], layout, expected, kernel=(3, 3)) == expected == 28


def test_an_int8_depthwise_conv_pays_the_requantising_step_an_int8_epilogue_does():
    """x [1, 4, 6, 10] int8, w [4, 3, 3] int8, bias int32 and requant fp32 [4, 1, 1] ─► int8 [1, 4, 4, 8]: 128
    results = 4 vectors. ALU operations an element: 9 taps × (a multiply and an add) = 18, the epilogue's 3,
    and for the int8 result the requantising step an int8 EPILOGUE pays (the multiply, zero point and
    saturation: 1) = 22; FLOPs 128 × 22 = 2,816 (the mutation of leaving it out, 21, gives 2,688). On a lane's
    4 ALUs ceil(22 / 4) = 6 cycles a vector; streams (240 + 36 + 16 + 16 + 128) / (4 · 32) = 3.4, within a
    direction's 8: 4 · 6 + VXM latency 4 = 28."""
    layout = Layout()
    x = layout.const(np.ones((1, 4, 6, 10), np.int8))
    w = layout.const(np.ones((4, 3, 3), np.int8))
    bias = layout.const(np.zeros((4, 1, 1), np.int32))
    requant = layout.const(np.full((4, 1, 1), 0.01, np.float32))
    out = layout.take((1, 4, 4, 8), DType.I8)
    alu_ops = 3 * 3 * 2 + 3 + 1
    expected = 4 * ceil(alu_ops / 4) + 4
    prog = program([ins("DWCONV", [x, w, bias, requant], [out], kernel=(3, 3), zp_in=0, zp_out=0)], layout,
                   predicted=expected)
    stats = Simulator(prog, timing_only=True).stats
    assert stats.cycles == expected == 28
    assert stats.flops == 128 * alu_ops == 2816
