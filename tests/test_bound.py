"""What bound a layer, from its critical path: hand-built two-layer programs on the tiny chip, each limited by one
thing, with every cycle of the span worked out by hand from the preset.

tiny: 100 MHz, 32 lanes, 8 streams a direction, 4 ALUs a lane, 1 GB/s host link (10 bytes a cycle), latencies
MEM 4, MXM 8, VXM 4; fp32 MATMUL 12 passes a row; 2 install streams; 4 stream hops.
"""

from math import ceil

import numpy as np
import pytest

from lpx_tvm.runtime_sim import DType, Simulator
from programs import TINY, Layout, ins, program

F32 = DType.F32
HOST = TINY.host_bytes_per_s // TINY.clock_hz  # 10 bytes a cycle
LAT = TINY.latency_cycles


def test_the_presets_figures_these_are_worked_from():
    assert (HOST, LAT["MEM"], LAT["MXM"], LAT["VXM"], TINY.lanes, TINY.vxm_alus_per_lane,
            TINY.streams_per_direction, TINY.mxm_passes["fp32"], TINY.mxm_install_streams, TINY.stream_hops) == \
        (10, 4, 8, 4, 32, 4, 8, 12, 2, 4)


def rows_of(code, layout, inputs, predicted) -> dict:
    prog = program(code, layout, inputs=inputs, predicted=predicted, layers=("a", "b"))
    return {row["name"]: row for row in Simulator(prog, timing_only=True).stats.layers}


def layered(instruction, layer: int):
    return type(instruction)(instruction.opcode, instruction.unit_index, instruction.cycle, instruction.srcs,
                             instruction.dsts, dict(instruction.attrs), layer)


def test_three_products_on_one_plane_are_matrix_bound():
    """a: LOAD x [4, 32] fp32 (512 B: 52 cycles, in SRAM at 56). b: INSTALL a [32, 32] fp32 tile at 0 (4,096 B
    over 2 streams of 32 bytes: 64 cycles, in the plane 4 hops later, at 68), then three MATMULs of x back to
    back on plane 0, each 4 rows × 12 passes = 48 cycles: at 68, 116 and 164; the last result arrives 8 cycles
    after 212. b's span, 0 to 220: 64 cycles installing, 4 on the hops, 3 × 48 multiplying, 8 in the plane's
    pipeline."""
    layout = Layout()
    w = layout.const(np.ones((32, 32), np.float32))
    x = layout.take((4, 32), F32)
    outs = [layout.take((4, 32), F32) for _ in range(3)]
    code = [ins("LOAD", [], [x], cycle=0, index=0), layered(ins("INSTALL", [w], [], cycle=0, buffer=0), 1)]
    code += [layered(ins("MATMUL", [x], [out], cycle=68 + 48 * k, buffer=0), 1) for k, out in enumerate(outs)]
    rows = rows_of(code, layout, [((4, 32), F32)], 220)
    assert ceil(4 * 32 * 4 / HOST) == 52 and ceil(32 * 32 * 4 / (2 * 32)) == 64 and 4 * 12 == 48
    assert (rows["b"]["start"], rows["b"]["end"]) == (0, 220)
    assert rows["b"]["critical"] == {"matrix": 3 * 48, "weight install": 64, "latency": 4 + 8}
    assert rows["b"]["bound"] == "matrix"
    assert rows["b"]["busy_by_instance"] == {"MXM.load0": 64, "MXM0": 3 * 48}  # plane 0's install port, its array


def test_three_gelus_sharing_the_alus_are_vector_bound():
    """a: LOAD x [8, 32] fp32 (1,024 B: 103 cycles, in SRAM at 107). b: three GELUs of x on three vector
    queues. A GELU is 12 ALU operations an element, 3 cycles a vector on a lane's 4 ALUs, and takes all 4
    ALUs: 8 vectors × 3 = 24 cycles each, one after another (the queues differ; the ALUs are shared), at 107,
    131 and 155; the last result arrives 4 cycles after 179. b's span, 107 to 183: 72 cycles of vector work
    and 4 in the pipeline."""
    layout = Layout()
    x = layout.take((8, 32), F32)
    outs = [layout.take((8, 32), F32) for _ in range(3)]
    code = [ins("LOAD", [], [x], cycle=0, index=0)]
    code += [layered(ins("GELU", [x], [out], cycle=107 + 24 * k, unit_index=k), 1) for k, out in enumerate(outs)]
    rows = rows_of(code, layout, [((8, 32), F32)], 183)
    assert ceil(8 * 32 * 4 / HOST) == 103 and 8 * ceil(12 / 4) == 24
    assert (rows["b"]["start"], rows["b"]["end"]) == (107, 183)
    assert rows["b"]["critical"] == {"vector": 3 * 24, "latency": 4}
    assert rows["b"]["bound"] == "vector"
    assert rows["b"]["busy_by_instance"] == {"VXM0": 24, "VXM1": 24, "VXM2": 24} and rows["b"]["busy"] == {"VXM": 72}


def test_two_loads_in_turn_on_the_one_host_link_are_host_link_bound():
    """a: LOAD x then LOAD y, [8, 32] fp32 each (1,024 B: 103 cycles), back to back on the host link: at 0 and
    103, y in SRAM at 210. b: x + y at 210, 12 bytes a lane a vector on 8 streams: 2 cycles a vector, 16,
    bound by the streams. a's span, 0 to 210: 206 cycles on the link and 4 of its latency, all the link's."""
    layout = Layout()
    x, y, out = (layout.take((8, 32), F32) for _ in range(3))
    code = [ins("LOAD", [], [x], cycle=0, index=0), ins("LOAD", [], [y], cycle=103, index=1),
            layered(ins("ADD", [x, y], [out], cycle=210), 1)]
    rows = rows_of(code, layout, [((8, 32), F32)] * 2, 210 + 16 + 4)
    assert rows["a"]["critical"] == {"host link": 2 * 103 + 4}
    assert rows["a"]["bound"] == "host link"
    assert rows["b"]["critical"] == {"SRAM bandwidth": 8 * ceil(3 * 4 / 8), "latency": 4}
    assert rows["b"]["bound"] == "SRAM bandwidth"


@pytest.mark.parametrize("queue", [0, 1])
def test_a_layer_waiting_on_its_producers_second_band_is_dependency_bound(queue):
    """a: two LOAD bands, x1 then x2 ([8, 32] fp32, 103 cycles each), in SRAM at 107 and 210. b: a RELU of each
    band as it arrives (8 streams a vector: a vector a cycle, 8 cycles), at 107 and 210, on one vector queue
    or two. b's span, 107 to 222: 103 cycles waiting on a's second band, 8 of work, 4 in the pipeline."""
    layout = Layout()
    x1, x2, o1, o2 = (layout.take((8, 32), F32) for _ in range(4))
    code = [ins("LOAD", [], [x1], cycle=0, index=0), ins("LOAD", [], [x2], cycle=103, index=1),
            layered(ins("RELU", [x1], [o1], cycle=107), 1),
            layered(ins("RELU", [x2], [o2], cycle=210, unit_index=queue), 1)]
    rows = rows_of(code, layout, [((8, 32), F32)] * 2, 222)
    assert (rows["b"]["start"], rows["b"]["end"]) == (107, 222)
    assert rows["b"]["critical"] == {"dependency": 210 - 107, "SRAM bandwidth": 8, "latency": 4}
    assert rows["b"]["bound"] == "dependency"
