"""Static scheduling: the compiler's prediction is what the simulator measures, and order changes time only."""

import numpy as np
import pytest

import lpx_tvm
from lpx_tvm.runtime_sim import Opcode, decode, reference_arithmetic
from conftest import cnn_model, mlp_model, host_op_between_model


@pytest.mark.parametrize("make", [mlp_model, cnn_model, host_op_between_model])
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_the_schedule_keeps_the_rules_as_the_plain_walk_states_them(make, dtype):
    """The scheduler plans with its own calendars; the simulator proves the rules for the whole program at once
    (:mod:`runtime_sim.check_batch`). The rules' plain statement, walked instruction by instruction
    (:func:`check_timing`), must accept the compiled program too, at the cycles its header predicts."""
    from lpx_tvm.runtime_sim.check import check_timing

    compiled = lpx_tvm.compile(make(), config="tiny", dtype=dtype)
    assert compiled.simulators
    for name, sim in compiled.simulators.items():
        walked = check_timing(sim.program, sim.config, sim.resident, sim.sram_size, sim.protected)
        assert walked.makespan == sim.program.predicted_cycles, name


def test_list_schedule_gives_the_same_values_as_in_order_and_overlaps_units(rng):
    model = cnn_model()
    x = rng.standard_normal((1, 3, 32, 32)).astype(np.float32)
    listed = lpx_tvm.compile(model, config="tiny")
    in_order = lpx_tvm.compile(model, config="tiny", in_order=True)
    with reference_arithmetic():  # the same tiles in another order: tile by tile, the same bits
        np.testing.assert_array_equal(listed(x)[0], in_order(x)[0])
    (a,), (b,) = listed.simulators.values(), in_order.simulators.values()
    assert a.stats.cycles < b.stats.cycles
    # the list schedule runs different units at once: some instruction starts while another one runs
    spans = sorted((i.cycle, i.cycle + max(o.busy, 1), i.unit) for i, o in zip(a.program.instructions, a.costs))
    assert any(s2 < e1 and u1 != u2 for (s1, e1, u1), (s2, e2, u2) in zip(spans, spans[1:]))


def test_matrix_work_spreads_over_every_plane(rng):
    compiled = lpx_tvm.compile(cnn_model(), config="tiny")
    (blob,) = compiled.programs.values()
    planes = {i.unit_index for i in decode(blob).instructions if i.opcode == Opcode.MATMUL}
    assert planes == {0, 1}  # the tiny chip's two planes both work


def test_a_strided_access_inside_a_later_dense_write_keeps_its_dependence():
    """Accesses of different row strides are compared by their bounding ranges: a strided write inside a later
    dense write can still order a read the dense write does not meet, so the scheduler must keep its edge
    (it once retired it and the checker rejected the schedule with a RAW hazard)."""
    import importlib
    import types

    from lpx_tvm.runtime_sim import DType, Instruction, TensorRef, check_timing, load_config

    schedule = importlib.import_module("lpx_tvm.codegen.schedule")
    u8, tiny = DType.U8, load_config("tiny")
    strided = TensorRef(100, (2, 10), u8, (50, 1))        # bytes [100, 110) and [150, 160)
    reader = TensorRef(0, (2, 10), u8, (300, 1))          # [0, 10) and [300, 310): bounding range [0, 310)
    ins = [Instruction(Opcode.COPY, 0, 0, (TensorRef(40000, (2, 10), u8),), (reader,)),
           Instruction(Opcode.COPY, 0, 0, (TensorRef(40000, (2, 10), u8),), (strided,)),
           Instruction(Opcode.COPY, 0, 0, (TensorRef(40000, (100,), u8),), (TensorRef(100, (100,), u8),)),
           Instruction(Opcode.COPY, 0, 0, (reader,), (TensorRef(30000, (2, 10), u8),))]
    scheduled, makespan, _ = schedule.schedule(ins, tiny)
    check_timing(types.SimpleNamespace(instructions=scheduled, predicted_cycles=makespan), tiny,
                 constants=(TensorRef(40000, (200,), u8),), sram_size=65536)


@pytest.mark.slow
def test_more_matrix_planes_never_slow_an_encoder_down():
    """An instance (a vector queue) is chosen for the cycle a group lands on, not the first cycle tried:
    choosing early once sent every epilogue of a layer's last tiles to the one queue free at that first
    cycle, one after another, and BERT ran slower on 6 planes than on 4 (12,595 cycles against 11,883)."""
    from lpx_tvm.app.tools.zoo import ZOO
    from lpx_tvm.runtime_sim import Simulator, derive_config

    entry = ZOO["bert_encoder"]
    cycles = []
    for planes in (2, 4, 6, 8):
        chip = derive_config("tsp", {"mxm_planes": planes})
        programs, _ = lpx_tvm.compile_programs(entry.load(), config=chip, input_shapes=entry.input_shapes,
                                               dtype="fp16")
        cycles.append(sum(Simulator(p, chip, timing_only=True).stats.cycles for p in programs.values()))
    assert cycles == sorted(cycles, reverse=True), cycles


def test_a_compiled_mlp_takes_the_cycles_worked_out_by_hand():
    """conftest's MLP (x [4, 64] → Gemm 32 → ReLU → Gemm 10, fp32) compiled for tiny: 100 MHz, a 10-byte-a-cycle
    host link (latency 4), 32 × 32 planes taking an fp32 row in 12 passes (latency 8), 2 install streams of 32
    bytes (4 hops to the plane), vector latency 4.
    - LOAD x: 1,024 bytes, ceil(1,024 / 10) = 103 cycles: in SRAM at 103 + 4 = 107.
    - Gemm 1 has K = 64: one job (4 rows, 32 columns) in two 32 × 32 K tiles, which go to both planes side by
      side (a plane left idle takes a run of K tiles); each tile is 4,096 bytes / 64 = 64 cycles to install,
      in the plane 4 later. Tile 0 is installed on plane 0, 39..103, to be in at 107, when x is; its product,
      4 rows × 12 = 48 cycles, runs 107..155, its partial sums out 8 later, at 163. Tile 1 is installed on
      plane 1, 95..159, in at 163; its product takes plane 0's sums as its accumulator, 163..211, its bias and
      ReLU chained behind it from 163 + 8 = 171 at its pace, 48 cycles: done at 171 + 48 + 4 = 223.
    - Gemm 2 (K = 32, N = 10) in two bands of 2 rows, a band a plane: its tile, 1,280 bytes, takes 20 cycles
      and 4 hops, installed on each plane 199..219, in at 223; the bands run 223..247 (2 rows × 12), their
      epilogues 231..255 on two vector units, in SRAM at 259.
    - STORE y: 160 bytes, 16 cycles, 259..275, and the host link's 4: 279."""
    compiled = lpx_tvm.compile(mlp_model(), config="tiny")
    (sim,) = compiled.simulators.values()
    timeline = [(i.cycle, i.opcode.name, i.unit_index) for i in sorted(sim.program.instructions, key=lambda i: i.cycle)]
    assert timeline == [(0, "LOAD", 0), (39, "INSTALL", 0), (95, "INSTALL", 1), (107, "MATMUL", 0),
                        (163, "MATMUL", 1), (171, "EPILOGUE", 0), (199, "INSTALL", 0), (199, "INSTALL", 1),
                        (223, "MATMUL", 0), (223, "MATMUL", 1), (231, "EPILOGUE", 0), (231, "EPILOGUE", 1),
                        (259, "STORE", 0)]
    assert sim.stats.cycles == 279
