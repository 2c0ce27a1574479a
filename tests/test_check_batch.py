"""The whole-program schedule check (check_batch) accepts exactly what the instruction-by-instruction walk
(check.check_timing, the rules' definition) accepts: the same timeline on compiled programs, and the same
verdict on thousands of programs broken at random."""

import dataclasses

import numpy as np
import pytest

import lpx_tvm
from lpx_tvm.runtime_sim import Opcode, ProgramFormatError, ScheduleError, Simulator, Space, check_timing, decode
from lpx_tvm.runtime_sim.check_batch import proven_timeline
from lpx_tvm.runtime_sim.program import validated_columns
from lpx_tvm.runtime_sim.timing import occupancy
from conftest import cnn_model, mlp_model


@pytest.fixture(scope="module")
def compiled_programs():
    out = []
    for make, dtype in ((cnn_model, "fp32"), (cnn_model, "fp16"), (mlp_model, "fp32")):
        compiled = lpx_tvm.compile(make(), config="tiny", dtype=dtype)
        out += [decode(blob) for blob in compiled.programs.values()]
    return out


def _both_verdicts(program):
    """``(walk, whole)``: each check's timeline, or None where it rejects the program."""
    try:
        columns = validated_columns(program)
    except ProgramFormatError:
        return "invalid", "invalid"
    loaded = Simulator(program, check_schedule=False, timing_only=True)  # what the simulator checks against
    where = (loaded.resident, loaded.sram_size, loaded.protected)
    try:
        walk = check_timing(program, columns.chip, *where)
    except ScheduleError as err:
        walk = err.rule
    return walk, proven_timeline(columns, *where)


def test_compiled_programs_are_proven_with_the_walks_timeline(compiled_programs):
    kinds = set()
    for program in compiled_programs:
        walk, whole = _both_verdicts(program)
        assert whole is not None and whole == walk
        kinds |= {i.opcode for i in program.instructions}
        kinds |= {"chained" for i in program.instructions if any(r.space == Space.STREAM for r in i.srcs)}
    assert {Opcode.INSTALL, Opcode.MATMUL, Opcode.LOAD, Opcode.STORE, "chained"} <= kinds


def _broken(program, rng):
    """The program with one instruction moved in time, to another unit instance, or one operand moved in SRAM;
    its header's cycles as the instructions alone would take."""
    instructions = list(program.instructions)
    k = int(rng.integers(len(instructions)))
    ins = instructions[k]
    kind = rng.integers(3)
    if kind == 0:
        ins = dataclasses.replace(ins, cycle=max(0, ins.cycle + int(rng.integers(-40, 41))))
    elif kind == 1:
        ins = dataclasses.replace(ins, unit_index=int(rng.integers(4)))
    else:
        srcs, dsts = list(ins.srcs), list(ins.dsts)
        side = srcs if (rng.integers(2) or not dsts) and srcs else dsts
        j = int(rng.integers(len(side)))
        ref = side[j]
        if ref.space == Space.SRAM:
            step = ref.dtype.itemsize * int(rng.choice([-64, -8, -1, 1, 8, 64]))
            side[j] = dataclasses.replace(ref, addr=max(0, ref.addr + step))
        ins = dataclasses.replace(ins, srcs=tuple(srcs), dsts=tuple(dsts))
    instructions[k] = ins
    chip = lpx_tvm.runtime_sim.load_config(program.config_name)
    try:
        makespan = max(i.cycle + occupancy(i, chip).finish for i in instructions)
    except (KeyError, IndexError):  # a unit instance the chip lacks: validation rejects it
        makespan = program.predicted_cycles
    return dataclasses.replace(program, instructions=tuple(instructions), predicted_cycles=makespan)


@pytest.mark.slow
def test_programs_broken_at_random_get_the_walks_verdict(compiled_programs):
    rng = np.random.default_rng(11)
    verdicts = {"accepted": 0}
    for _ in range(600):
        program = compiled_programs[int(rng.integers(len(compiled_programs)))]
        walk, whole = _both_verdicts(_broken(program, rng))
        if walk == "invalid":
            continue
        if isinstance(walk, str):
            assert whole is None, f"the whole-program check accepts what the walk rejects ({walk})"
            verdicts[walk] = verdicts.get(walk, 0) + 1
        else:
            assert whole == walk
            verdicts["accepted"] += 1
    # both verdicts, and the rules that compiled programs can break by one move, were exercised
    assert verdicts["accepted"] >= 50
    assert {"RAW hazard", "WAW hazard", "unit overlap", "chained stream", "read before write",
            "install not finished"} <= set(verdicts), verdicts


def test_an_instruction_on_another_unit_instance_differs_only_in_that_instance(compiled_programs):
    """The columns work out each kind's occupancy once and move it to other instances (timing.on_instance)."""
    from lpx_tvm.runtime_sim.timing import on_instance

    chip = lpx_tvm.runtime_sim.load_config("tiny")
    groups = set()
    for ins in compiled_programs[0].instructions:
        for k in range(chip.unit_count(ins.unit.name)):
            moved = dataclasses.replace(ins, unit_index=k)
            assert occupancy(moved, chip) == on_instance(occupancy(ins, chip), k)
        groups.add(ins.spec.group)
    assert len(groups) >= 6


def test_in_flight_windows_come_in_bounded_parts_and_miss_no_pair():
    from lpx_tvm.runtime_sim.check_batch import _windows

    rng = np.random.default_rng(3)
    owner = np.arange(200)
    lo = rng.integers(0, 50, 200)
    hi = lo + rng.integers(-5, 300, 200)  # some empty
    every = [(o, j) for o, a, b in zip(owner.tolist(), lo.tolist(), hi.tolist()) for j in range(a, b)]
    for most in (1, 7, 1000, 1 << 21):
        parts = list(_windows(owner, lo, hi, most))
        assert [(a, b) for e, l in parts for a, b in zip(e.tolist(), l.tolist())] == every
        assert max(len(e) for e, _ in parts) <= most + 300  # a part ends at the first owner past the bound


def test_operands_that_break_their_opcodes_rules_are_named_before_any_timing_rule_reads_them():
    """The columns time each kind only once the program is valid: a MATMUL with no source is a format
    error naming it, not an IndexError from inside the matrix unit's timing rule."""
    from programs import Layout, ins, program
    from lpx_tvm.runtime_sim import DType

    layout = Layout()
    bad = program([ins("MATMUL", [], [layout.take((4, 32), DType.F32)], buffer=0)], layout)
    with pytest.raises(ProgramFormatError, match=r"instruction 0 \(MATMUL\): MATMUL takes"):
        Simulator(bad, timing_only=True)


def test_a_broadcast_view_touches_its_bytes_once_for_both_checks():
    """An axis of stride 0 repeats the same bytes: the footprint is one element, which the walk's byte map
    used to take as no bytes at all (a read through it never failed). A destination may not broadcast."""
    from programs import TINY, Layout, ins, program
    from lpx_tvm.runtime_sim import DType, TensorRef

    layout = Layout()
    source = layout.const(np.ones(1, np.float32))
    broadcast = TensorRef(256, (4,), DType.F32, strides=(0,))
    assert broadcast.footprint() == (256, 1, 4, 4)
    write = ins("COPY", [source], [TensorRef(256, (1,), DType.F32)])
    read = ins("COPY", [broadcast], [TensorRef(512, (4,), DType.F32)], cycle=100)
    written_then_read = program([write, read], layout, predicted=100 + occupancy(read, TINY).finish)
    walk, whole = _both_verdicts(written_then_read)
    assert whole is not None and whole == walk
    never_written = ins("COPY", [TensorRef(1024, (4,), DType.F32, strides=(0,))], [TensorRef(2048, (4,), DType.F32)])
    assert _both_verdicts(program([never_written], Layout(), predicted=occupancy(never_written, TINY).finish)) == \
        ("read before write", None)
    onto_one = ins("COPY", [TensorRef(512, (4,), DType.F32)], [broadcast])
    with pytest.raises(ProgramFormatError, match="has an axis of stride 0: it would write one element"):
        Simulator(program([onto_one], Layout(), predicted=occupancy(onto_one, TINY).finish), timing_only=True)


def _read_after_write_verdicts(layout, write, reads):
    """Both checks' verdicts on ``write`` and then each of ``reads`` (sources, destinations), two instructions
    a program, the read issued as the write ends: a good read's then a bad one's."""
    from programs import TINY, ins, program

    verdicts = []
    for src, dst in reads:
        read = ins("COPY", [src], [dst], cycle=occupancy(write, TINY).finish)
        verdicts.append(_both_verdicts(program([write, read], layout,
                                               predicted=read.cycle + occupancy(read, TINY).finish)))
    (walk, whole), (bad_walk, bad_whole) = verdicts
    assert whole is not None and whole == walk
    assert (bad_walk, bad_whole) == ("read before write", None)


def test_the_read_before_write_map_starts_at_the_lowest_byte_accessed():
    """The map spans only the bytes its accesses touch, from the lowest (here a strided fp16 write far above
    address 0, its rows 10 bytes apart): a read inside the written elements passes, one that reaches a gap
    between the rows is named, by both checks alike."""
    from programs import Layout, ins
    from lpx_tvm.runtime_sim import DType, TensorRef

    layout = Layout()
    source = layout.const(np.ones((4, 3), np.float16))
    rows = 1002  # 2-byte aligned, not 64: every footprint edge is a multiple of 2 bytes only

    def strided(first, width):  # elements first .. first + width - 1 of 4 rows of 5
        return TensorRef(rows + 2 * first, (4, width), DType.F16, strides=(5, 1))
    write = ins("COPY", [source], [strided(0, 3)])
    # elements 1-2 were written; 2-3 reach element 3, which nothing wrote
    _read_after_write_verdicts(layout, write, [(strided(first, 2), TensorRef(4096, (4, 2), DType.F16))
                                               for first in (1, 2)])


def test_blocks_of_the_read_before_write_map_are_flagged_only_once_wholly_written(monkeypatch):
    """Blocks of 4 grains (16 bytes here). A write of bytes 256-299 fills the first two blocks and most of the
    third: a read of the first two passes without a look at its bytes, and one of bytes 292-303, all in the
    third, reaches bytes nothing wrote. A write of bytes 256-291: a read of bytes 256-295 ends inside the third
    block, which is not wholly written, on bytes nothing wrote. Each bad read is named, by both checks alike."""
    from programs import Layout, ins
    from lpx_tvm.runtime_sim import DType, TensorRef, check_batch
    from lpx_tvm.runtime_sim.hazards import block_of

    monkeypatch.setattr(check_batch, "_BLOCK", 4)
    looked_at = []  # the footprints whose bytes the map was asked for
    monkeypatch.setattr(check_batch, "block_of", lambda *args: looked_at.append(args[1:]) or block_of(*args))
    for written, reads in ((11, ((256, 8), (292, 3))), (9, ((256, 8), (256, 10)))):
        layout = Layout()
        source = layout.const(np.ones(written, np.float32))
        write = ins("COPY", [source], [TensorRef(256, (written,), DType.F32)])
        _read_after_write_verdicts(layout, write, [(TensorRef(addr, (n,), DType.F32),
                                                    TensorRef(4096, (n,), DType.F32)) for addr, n in reads])
    # (addr, rows, run, stride) in grains of 4 bytes from byte 256, program by program: the write, then the good
    # read's destination at byte 4096 (new bytes), or the bad read (the check ends there); never the good read
    assert looked_at == [(0, 1, 11, 0), (960, 1, 8, 0), (0, 1, 11, 0), (9, 1, 3, 0),
                         (0, 1, 9, 0), (960, 1, 8, 0), (0, 1, 9, 0), (0, 1, 10, 0)]


@pytest.mark.parametrize("case, message", [
    ("huge NOP", "NOP cycles must be >= 0 and below 2"),
    ("float cycle", r"issue cycle 0\.5 is not an integer"),
    ("negative cycle", "issue cycle -10 is not an integer"),
    ("negative header", "predicted cycles -6 is not a non-negative integer"),
    ("float address", "needs a non-negative integer address"),
    ("float stride with an integer twin", r"instruction 1 \(COPY\).*strides=\(2\.0,\).* one stride in \[0, 2\^32\)"),
    ("float unit with an integer twin", r"instruction 1 \(COPY\): VXM instance 0\.0 does not exist"),
    ("list shape", "shapes and strides, must be integers and tuples of integers"),
    ("broadcast of 2^62 bytes", "holds 4611686014132420609 bytes, past 2"),
    ("zero-size dimension", r"dimensions in \[1, 2\^31\)"),
    ("kernel of 2^60 taps", "runs .* cycles .* past 2"),
])
def test_hand_made_programs_with_values_no_encoding_holds_are_named(case, message):
    """Such values would wrap or truncate in the whole-program check's int64 columns: validation names
    them first (a NOP of 2^63 cycles once made the check's makespan wrap around and pass)."""
    from dataclasses import replace

    from programs import Layout, ins, program
    from lpx_tvm.runtime_sim import DType, TensorRef

    copy = ins("COPY", [TensorRef(4.5 if case == "float address" else 0, [4] if case == "list shape" else (4,),
                                  DType.I8)], [TensorRef(64, (4,), DType.I8)])
    big = 2 ** 31 - 1  # a broadcast view's size is not bounded by the bytes it spans
    broadcast = ins("GELU", [TensorRef(0, (big, big), DType.F8, (0, 0))], [TensorRef(0, (big, big), DType.F8, (0, 0))])
    empty = ins("COPY", [TensorRef(0, (0, 4), DType.I8)], [TensorRef(64, (0, 4), DType.I8)])
    # a 1x1 output of a window of 2^30 x 2^30 taps (padding and stride keep the output one position)
    pool = ins("MAXPOOL", [TensorRef(0, (1, 16, 1, 1), DType.F32)], [TensorRef(64, (1, 16, 1, 1), DType.F32)],
               kernel=(1 << 30, 1 << 30), pad=(1 << 30,) * 4, stride=(1 << 32, 1 << 32))
    # equal to its twin's (2,), so of one kind with it: the kind's rules must not pass it as its twin
    strided = [ins("COPY", [TensorRef(0, (4,), DType.I8, strides=(stride,))], [TensorRef(64, (4,), DType.I8)],
                   cycle=cycle) for cycle, stride in ((0, 2), (100, 2.0))]
    instructions = {"huge NOP": [ins("NOP", cycles=5), ins("NOP", cycle=1024, cycles=2 ** 63 - 1024)],
                    "float cycle": [ins("NOP", cycle=0.5, cycles=5)],
                    "negative cycle": [ins("NOP", cycle=-10, cycles=3)],
                    "negative header": [ins("NOP", cycles=3)], "broadcast of 2^62 bytes": [broadcast],
                    "zero-size dimension": [empty], "kernel of 2^60 taps": [pool],
                    "float stride with an integer twin": strided,
                    "float unit with an integer twin": [copy, replace(copy, cycle=100, unit_index=0.0)]}.get(case, [copy])
    broken = program(instructions, Layout(), predicted=-6 if case == "negative header" else 6)
    for timing_only in (True, False):  # a full simulator validates alike (a twin once raised TypeError there)
        with pytest.raises(ProgramFormatError, match=message):
            Simulator(broken, timing_only=timing_only)
