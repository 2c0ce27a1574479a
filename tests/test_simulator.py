"""The simulator's schedule rules, on hand-built programs, and its reports and traces."""

import json

import numpy as np
import pytest

from lpx_tvm.runtime_sim import (Constant, DType, Instruction, Opcode, Program, ProgramFormatError, ScheduleError,
                                 Simulator, TensorRef, encode, load_config)
from lpx_tvm.runtime_sim.cost import instruction_cost
from lpx_tvm.runtime_sim.isa import HostTensor
from lpx_tvm.runtime_sim.trace import write_trace

CHIP = load_config("tiny")
F32 = DType.F32
X = TensorRef(0, (4, 8), F32)
W = TensorRef(256, (8, 8), F32)
Y = TensorRef(512, (4, 8), F32)
Z = TensorRef(768, (4, 8), F32)


def _cycles(ins):
    return instruction_cost(ins, CHIP).cycles


def _program(instructions):
    weight = Constant(W, np.eye(8, dtype=np.float32).reshape(-1).view(np.uint8))
    return Program("tiny", CHIP.digest, tuple(instructions), (weight,), (HostTensor((4, 8), F32),),
                   (HostTensor((4, 8), F32),), ("test",), 0)


def _legal():
    load = Instruction(Opcode.LOAD, 0, 0, (), (X,), {"index": 0})
    t1 = _cycles(load)
    mm = Instruction(Opcode.MATMUL, 0, t1, (X, W), (Y,), {})
    t2 = t1 + _cycles(mm)
    relu = Instruction(Opcode.RELU, 0, t2, (Y,), (Z,))
    t3 = t2 + _cycles(relu)
    store = Instruction(Opcode.STORE, 0, t3, (Z,), (), {"index": 0})
    return [load, mm, relu, store]


def test_legal_program_runs_and_counts_cycles():
    sim = Simulator(encode(_program(_legal())))
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    np.testing.assert_array_equal(sim.run([x])[0], np.maximum(x, 0))
    assert sim.stats.cycles == sum(_cycles(i) for i in _legal())


def _with(index, **changes):
    instructions = _legal()
    old = instructions[index]
    instructions[index] = Instruction(changes.get("opcode", old.opcode), changes.get("unit_index", old.unit_index),
                                      changes.get("cycle", old.cycle), changes.get("srcs", old.srcs),
                                      changes.get("dsts", old.dsts), old.attrs, old.layer)
    return instructions


def test_raw_hazard_is_rejected():
    with pytest.raises(ScheduleError, match="RAW hazard") as err:
        Simulator(_program(_with(2, cycle=_legal()[1].cycle + 1)))
    assert err.value.index == 2


def test_unit_overlap_is_rejected():
    # a second matmul on the same plane while the first still runs, with no data dependence
    instructions = _legal()
    mm = instructions[1]
    instructions.insert(2, Instruction(Opcode.MATMUL, 0, mm.cycle + 1, (W, W), (TensorRef(1024, (8, 8), F32),),
                                       mm.attrs))
    with pytest.raises(ScheduleError, match="unit overlap"):
        Simulator(_program(instructions))


def test_war_hazard_is_rejected():
    # overwrite X (read by the matmul) while the matmul still reads it
    instructions = _legal()
    mm = instructions[1]
    instructions.insert(2, Instruction(Opcode.RELU, 0, mm.cycle + 1, (Z,), (X,)))
    with pytest.raises(ScheduleError, match="WAR hazard"):
        Simulator(_program(instructions))


def test_sram_overflow_is_rejected():
    outside = TensorRef(CHIP.sram_bytes - 64, (4, 8), F32)
    with pytest.raises(ProgramFormatError, match="SRAM overflow"):
        Simulator(_program(_with(2, dsts=(outside,))))


def test_trace_is_trace_event_json(tmp_path):
    sim = Simulator(_program(_legal()))
    path = tmp_path / "trace.json"
    write_trace(path, [("test", sim)])
    events = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == 4
    for e in spans:
        assert {"ph", "ts", "dur", "pid", "tid"} <= set(e) and e["dur"] > 0


def test_nan_and_inf_propagate():
    sim = Simulator(_program(_legal()))
    x = np.zeros((4, 8), np.float32)
    x[0, 0], x[1, 1], x[2, 2] = np.nan, np.inf, -np.inf
    out = sim.run([x])[0]
    assert np.isnan(out[0, 0]) and out[1, 1] == np.inf and out[2, 2] == 0


def test_wrong_input_shape_names_expected_and_given():
    sim = Simulator(_program(_legal()))
    with pytest.raises(ValueError, match=r"expected float32\[4, 8\], got float32\[4, 9\]"):
        sim.run([np.zeros((4, 9), np.float32)])
