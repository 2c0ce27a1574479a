"""Static scheduling: the compiler's prediction is what the simulator measures, and order changes time only."""

import numpy as np
import pytest

import lpx_tvm
from lpx_tvm.runtime_sim import Opcode, decode
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


def test_more_matrix_planes_never_slow_an_encoder_down():
    """An instance (a vector queue) is chosen for the cycle a group lands on, not the first cycle tried:
    choosing early once sent every epilogue of a layer's last tiles to the one queue free at that first
    cycle, one after another, and BERT ran slower on 6 planes than on 4 (12,595 cycles against 11,883)."""
    from lpx_tvm.app.zoo import ZOO
    from lpx_tvm.runtime_sim import Simulator, derive_config

    entry = ZOO["bert_encoder"]
    cycles = []
    for planes in (2, 4, 6, 8):
        chip = derive_config("tsp", {"mxm_planes": planes})
        programs, _ = lpx_tvm.compile_programs(entry.load(), config=chip, input_shapes=entry.input_shapes,
                                               dtype="fp16")
        cycles.append(sum(Simulator(p, chip, timing_only=True).stats.cycles for p in programs.values()))
    assert cycles == sorted(cycles, reverse=True), cycles
