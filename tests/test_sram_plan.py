"""All programs of one model share a chip's SRAM: their weights resident side by side, activations above."""

import dataclasses

import numpy as np
import pytest

import lpx_tvm
from lpx_tvm.runtime_sim import ProgramFormatError, ScheduleError, Simulator, TensorRef, decode
from lpx_tvm.runtime_sim.chip import Chip
from conftest import assert_close, ort_run, sin_between_model


@pytest.fixture(scope="module")
def programs():
    compiled = lpx_tvm.compile(sin_between_model(), config="tiny")
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
    assert_close(compiled(x)[0], ort_run(sin_between_model(), {"x": x})[0], 1e-5)


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
