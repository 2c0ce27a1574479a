"""The machine keeps time: hand-worked cycle counts from the presets, and programs the hardware would not run.

Every expected count here is worked out from the preset's parameters in the
test, never by calling the timing code.
"""

from math import ceil

import numpy as np
import pytest

import lpx_tvm
from lpx_tvm.runtime_sim import DType, Opcode, ScheduleError, Simulator, Space, TensorRef, load_config
from conftest import add_model, ort_run
from programs import Layout, TINY, host_bound_add_cycles, ins, program

TSP = load_config("tsp")
F32 = DType.F32


def stream_ref(number, shape, dtype=F32):
    return TensorRef(number, tuple(shape), dtype, None, Space.STREAM)


def transposed(ref):
    """The same bytes seen with the last two axes swapped."""
    rows, cols = ref.shape
    return TensorRef(ref.addr, (cols, rows), ref.dtype, (1, cols))


def conv_layer(chip, k, positions, channels, x_ref_layout=None, layout=None, start=0, store=True):
    """A 1x1 convolution out[C, P] = W[C, K] @ x[K, P], weight-stationary, hand-scheduled on ``chip``.

    Returns (instructions, layout, refs, the cycle every result is in SRAM), each issue cycle worked out
    from the preset's figures.
    """
    layout = layout or Layout()
    item = 4
    w = layout.const(np.ones((k, channels), np.float32))  # Wᵀ, the stationary tile
    bias = layout.const(np.zeros((1, channels), np.float32))
    x = x_ref_layout or layout.take((k, positions), F32)
    out = layout.take((channels, positions), F32)
    code = []
    ready = start
    if x_ref_layout is None:  # the input crosses the host link
        load_busy = ceil(k * positions * item / (chip.host_bytes_per_s / chip.clock_hz))
        code.append(ins("LOAD", [], [x], cycle=start, index=0))
        ready = start + load_busy + chip.latency_cycles["MEM"]
    install_busy = ceil(k * channels * item / (chip.mxm_install_streams * chip.lanes))
    installed = install_busy + chip.stream_hops
    code.append(ins("INSTALL", [w], [], cycle=max(0, ready - installed), buffer=0))  # the weights are resident
    matmul_at = max(ready, code[-1].cycle + installed)
    chain = stream_ref(0, (positions, channels))
    code.append(ins("MATMUL", [transposed(x)], [chain], cycle=matmul_at, buffer=0))
    matmul_busy = positions * chip.mxm_passes["fp32"]  # one activation row a pass; fp32 takes 12
    epilogue_at = matmul_at + chip.latency_cycles["MXM"]  # results arrive after the plane's latency
    code.append(ins("EPILOGUE", [chain, bias], [transposed(out)], cycle=epilogue_at, act=Opcode.RELU))
    # the chained epilogue runs at the plane's pace, then its results cross to SRAM
    done = epilogue_at + matmul_busy + chip.latency_cycles["VXM"]
    if store:
        code.append(ins("STORE", [out], [], cycle=done, index=0))
        done += ceil(channels * positions * item / (chip.host_bytes_per_s / chip.clock_hz)) + chip.latency_cycles["MEM"]
    return code, layout, (x, w, out), done


@pytest.mark.parametrize("chip", [TINY, TSP], ids=["tiny", "tsp"])
def test_one_conv_layer_takes_the_hand_worked_cycles(chip):
    k, positions, channels = 32, 16, 8
    code, layout, (x, w, out), done = conv_layer(chip, k, positions, channels)
    prog = program(code, layout, inputs=[((k, positions), F32)], outputs=[((channels, positions), F32)],
                   predicted=done, chip=chip)
    sim = Simulator(prog)
    assert sim.stats.cycles == done
    xs = np.random.default_rng(0).standard_normal((k, positions)).astype(np.float32)
    np.testing.assert_allclose(sim.run([xs])[0], np.maximum(np.ones((channels, k)) @ xs, 0), rtol=1e-5)


@pytest.mark.parametrize("chip", [TINY, TSP], ids=["tiny", "tsp"])
def test_a_two_layer_chain_with_chained_epilogues(chip):
    """Layer 2 streams layer 1's result through its plane as soon as layer 1's epilogue has stored it."""
    code1, layout, (x, _, y), y_ready = conv_layer(chip, 32, 16, 24, store=False)
    code2, layout, (_, _, z), done = conv_layer(chip, 24, 16, 8, x_ref_layout=y, layout=layout, start=y_ready)
    code2[0] = ins("INSTALL", code2[0].srcs, [], cycle=code2[0].cycle, unit_index=1, buffer=0)  # plane 1
    code2[1] = ins("MATMUL", code2[1].srcs, [stream_ref(1, (16, 8))], cycle=code2[1].cycle, unit_index=1, buffer=0)
    code2[2] = ins("EPILOGUE", [stream_ref(1, (16, 8))] + list(code2[2].srcs[1:]), code2[2].dsts,
                   cycle=code2[2].cycle, unit_index=1, act=Opcode.RELU)
    prog = program(code1 + code2, layout, inputs=[((32, 16), F32)], outputs=[((8, 16), F32)], predicted=done,
                   chip=chip)
    sim = Simulator(prog)
    assert sim.stats.cycles == done
    # layer 2's MATMUL issued the cycle layer 1's epilogue finished: the schedule is as tight as the rules allow
    assert code2[1].cycle == y_ready


@pytest.mark.parametrize("config, rows, cycles", [("tiny", 100, 4052), ("tiny", 256, 10358), ("tsp", 12, 2239)])
def test_a_host_link_bound_model_compiles_to_the_hand_worked_cycles(config, rows, cycles):
    """x + y for big x, y: both inputs cross the one host link in turn, then the add, then the result (256
    rows on tiny are 32 KiB a tensor: two host bands each way)."""
    chip = load_config(config)
    cols = chip.lanes
    model = add_model(rows, cols)
    compiled = lpx_tvm.compile(model, config=config)
    (sim,) = compiled.simulators.values()
    assert host_bound_add_cycles(chip, rows, cols) == cycles
    assert sim.stats.cycles == cycles
    assert sim.stats.layers and min(r["bound"] for r in sim.stats.layers if r["name"].startswith("load input")) == "host link"
    x, y = (np.random.default_rng(i).standard_normal((rows, cols)).astype(np.float32) for i in range(2))
    np.testing.assert_array_equal(compiled(x, y)[0], ort_run(model, {"x": x, "y": y})[0])


# ---------------------------------------------------------------------------
# programs the hardware would not run
# ---------------------------------------------------------------------------
def _rejected(prog, rule):
    with pytest.raises(ScheduleError, match=rule) as err:
        Simulator(prog)
    return err.value


def test_two_host_transfers_overlapping_on_the_one_link():
    layout = Layout()
    a, b = layout.take((32, 32), F32), layout.take((32, 32), F32)
    code = [ins("LOAD", [], [a], cycle=0, unit_index=0, index=0),
            ins("LOAD", [], [b], cycle=0, unit_index=1, index=1)]  # two DMA engines, one PCIe link
    err = _rejected(program(code, layout, inputs=[((32, 32), F32)] * 2, chip=TSP), "host link")
    assert err.index == 1 and err.cycle == 0


def test_a_matmul_before_its_weight_installation_ends():
    layout = Layout()
    w, a = layout.const(np.ones((32, 32), np.float32)), layout.const(np.ones((4, 32), np.float32))
    out = layout.take((4, 32), F32)
    installed = ceil(32 * 32 * 4 / (TINY.mxm_install_streams * TINY.lanes)) + TINY.stream_hops
    code = [ins("INSTALL", [w], []), ins("MATMUL", [a], [out], cycle=installed - 1)]
    _rejected(program(code, layout), "install not finished")


def test_a_consumer_reading_a_chained_stream_before_it_arrives():
    layout = Layout()
    w, a = layout.const(np.ones((32, 32), np.float32)), layout.const(np.ones((4, 32), np.float32))
    out = layout.take((4, 32), F32)
    matmul_at = 100
    code = [ins("INSTALL", [w], []), ins("MATMUL", [a], [stream_ref(3, (4, 32))], cycle=matmul_at),
            ins("EPILOGUE", [stream_ref(3, (4, 32))], [out], cycle=matmul_at + TINY.latency_cycles["MXM"] - 1)]
    _rejected(program(code, layout), "before instruction 1's result arrives")
    late = code[:2] + [ins("EPILOGUE", [stream_ref(3, (4, 32))], [out], cycle=matmul_at + TINY.latency_cycles["MXM"] + 1)]
    _rejected(program(late, layout), "has flowed past")


def test_oversubscribed_sram_bandwidth():
    """Two reductions on two vector queues, each reading as fast as the slices can serve one."""
    layout = Layout()
    x, y = layout.const(np.ones((64, 32), np.float16)), layout.const(np.ones((64, 32), np.float16))
    s1, s2 = layout.take((1, 1), DType.F16), layout.take((1, 1), DType.F16)
    code = [ins("REDUCE_SUM", [x], [s1], unit_index=0, axes=(0, 1)),
            ins("REDUCE_SUM", [y], [s2], unit_index=1, axes=(0, 1))]
    # fp16 vectors take 2 streams each: one direction's 8 streams carry 3 a cycle, 3 x 32 lanes x 2 bytes read;
    # two of them want more than the 8 slices serve (one 32-byte vector each a cycle)
    assert 2 * 3 * TINY.lanes * 2 > TINY.sram_slices * TINY.lanes
    _rejected(program(code, layout), "SRAM read bandwidth")


def test_read_before_write():
    layout = Layout()
    x, y = layout.take((4, 32), F32), layout.take((4, 32), F32)  # nothing ever wrote x
    _rejected(program([ins("RELU", [x], [y])], layout), "read before write")


def test_a_live_weight_overwritten():
    layout = Layout()
    x, w = layout.const(np.ones((4, 32), np.float32)), layout.const(np.ones((4, 32), np.float32))
    _rejected(program([ins("RELU", [x], [w])], layout), "live constant overwritten")


def test_a_wrong_predicted_cycles_header():
    code, layout, _, done = conv_layer(TINY, 32, 16, 8)
    prog = program(code, layout, inputs=[((32, 16), F32)], outputs=[((8, 16), F32)], predicted=done + 1)
    err = _rejected(prog, "predicted cycles")
    assert f"takes {done}" in str(err)


def test_unit_overlap_and_sram_hazards_are_rejected():
    layout = Layout()
    x = layout.const(np.ones((4, 32), np.float32))
    y, z = layout.take((4, 32), F32), layout.take((4, 32), F32)
    _rejected(program([ins("RELU", [x], [y]), ins("NEG", [x], [z], cycle=1)], layout), "unit overlap")
    _rejected(program([ins("RELU", [x], [y]), ins("NEG", [y], [z], cycle=1, unit_index=1)], layout), "RAW hazard")
    _rejected(program([ins("RELU", [x], [y]), ins("NEG", [x], [y], cycle=1, unit_index=1)], layout), "WAW hazard")


def test_weights_replaced_while_a_matmul_streams_through_them():
    layout = Layout()
    w, a = layout.const(np.ones((32, 32), np.float32)), layout.const(np.ones((8, 32), np.float32))
    out = layout.take((8, 32), F32)
    installed = ceil(32 * 32 * 4 / (TINY.mxm_install_streams * TINY.lanes)) + TINY.stream_hops
    code = [ins("INSTALL", [w], []), ins("MATMUL", [a], [out], cycle=installed),
            ins("INSTALL", [w], [], cycle=installed + 1)]
    _rejected(program(code, layout), "weights in use")


def _timed_alone(opcode, srcs, dsts, layout, expected, **attrs):
    """Cycles of one instruction at cycle 0, its header stating ``expected`` (the simulator refuses a header
    that disagrees with the machine's rules)."""
    prog = program([ins(opcode, srcs, dsts, **attrs)], layout, predicted=expected)
    return Simulator(prog, timing_only=True).stats.cycles


@pytest.mark.parametrize("opcode, alu_ops, attrs", [
    ("SOFTMAX", 8, {"axis": 1}),
    ("GELU", 12, {}),
])
def test_an_alu_bound_vector_op_takes_its_alu_operations_over_the_lane_alus(opcode, alu_ops, attrs):
    """[8, 32] fp32 on tiny: 8 vectors of 32 lanes, each reading and writing 4 bytes an element (8 of a
    direction's 8 streams: one vector a cycle at most). Each element needs ``alu_ops`` ALU operations and a
    lane has 4 ALUs: ceil(alu_ops / 4) cycles a vector, then the vector queue's latency (4)."""
    layout = Layout()
    x, out = layout.const(np.ones((8, 32), np.float32)), layout.take((8, 32), F32)
    vectors = 8 * 32 // TINY.lanes
    expected = vectors * ceil(alu_ops / TINY.vxm_alus_per_lane) + TINY.latency_cycles["VXM"]
    assert _timed_alone(opcode, [x], [out], layout, expected, **attrs) == expected == {8: 20, 12: 28}[alu_ops]


def test_a_layer_norm_with_its_scale_and_shift_is_bound_by_streams_and_alus_alike():
    """[8, 32] fp32 with a 32-wide scale and shift: 1,024 + 128 + 128 bytes in and 1,024 out are 9 bytes a
    lane a vector, past one direction's 8 streams (2 cycles a vector), and 8 ALU operations on 4 ALUs are
    2 cycles too: 8 vectors · 2 + latency 4."""
    layout = Layout()
    x, out = layout.const(np.ones((8, 32), np.float32)), layout.take((8, 32), F32)
    gamma, beta = layout.const(np.ones(32, np.float32)), layout.const(np.zeros(32, np.float32))
    per_vector = (8 * 32 * 4 * 2 + 2 * 32 * 4) / (8 * TINY.lanes)  # 9 byte streams
    step = max(ceil(per_vector / TINY.streams_per_direction), ceil(8 / TINY.vxm_alus_per_lane))
    expected = 8 * step + TINY.latency_cycles["VXM"]
    assert _timed_alone("LAYERNORM", [x, gamma, beta], [out], layout, expected, eps=1e-5, n_axes=1) == expected == 20


def test_a_transpose_on_the_switch_moves_its_vectors_at_the_switch_rate():
    """[8, 32] → [32, 8] fp32: 1,024 bytes are 32 vectors of 32 bytes; the switch moves 4 a cycle (tiny's
    rate, and half of a direction's 8 streams): 8 cycles, then its latency (4)."""
    layout = Layout()
    x, out = layout.const(np.ones((8, 32), np.float32)), layout.take((32, 8), F32)
    vectors = 8 * 32 * 4 // TINY.lanes
    rate = min(TINY.sxm_vectors_per_cycle, TINY.streams_per_direction // 2)
    expected = ceil(vectors / rate) + TINY.latency_cycles["SXM"]
    assert _timed_alone("TRANSPOSE", [x], [out], layout, expected, perm=(1, 0)) == expected == 12


def test_a_lone_int8_epilogue_takes_its_four_alu_operations_an_element():
    """acc int32 [8, 32], bias int32 [32], requant fp32 [32] ─► int8 [8, 32] on tiny: 256 elements = 8 vectors of
    32 lanes. ALU operations an element: the epilogue's 3 (bias, activation, store) + 1 for an int8 destination
    (the requantising multiply, zero point and saturation) = 4, on tiny's 4 ALUs a lane: a vector a cycle.
    Streams: (1,024 + 128 + 128 + 256) bytes / (8 vectors · 32 bytes) = 6 a vector, within a direction's 8.
    8 cycles busy + VXM latency 4 = 12; FLOPs 256 · 4 = 1,024. (No test caught the int8 op's cost moved by
    one, the mutation check found; the FLOPs catch it where the cycles, on 4 ALUs, cannot.)"""
    layout = Layout()
    acc = layout.const(np.ones((8, 32), np.int32))
    bias = layout.const(np.zeros(32, np.int32))
    requant = layout.const(np.full(32, 0.5, np.float32))
    out = layout.take((8, 32), DType.I8)
    assert (TINY.lanes, TINY.vxm_alus_per_lane, TINY.latency_cycles["VXM"]) == (32, 4, 4)
    stats = Simulator(program([ins("EPILOGUE", [acc, bias, requant], [out], zp_out=0)], layout, predicted=12),
                      timing_only=True).stats
    assert stats.cycles == 12
    assert stats.flops == 1024
