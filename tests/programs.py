"""Hand-built LPX programs for tests: constants placed in SRAM, instructions, a Program around them; and cycle
counts worked out by hand from a preset's parameters."""

from math import ceil

import numpy as np

from lpx_tvm.runtime_sim import Constant, DType, Instruction, Opcode, Program, Simulator, TensorRef, load_config
from lpx_tvm.runtime_sim.isa import HostTensor

TINY = load_config("tiny")


class Layout:
    """Hands out SRAM addresses (64-byte aligned) and collects constants."""

    def __init__(self, start: int = 0):
        self.cursor = start
        self.constants = []

    def take(self, shape, dtype: DType) -> TensorRef:
        ref = TensorRef(self.cursor, tuple(shape), dtype)
        self.cursor += -(-max(ref.nbytes, 1) // 64) * 64
        return ref

    def const(self, array: np.ndarray) -> TensorRef:
        array = np.ascontiguousarray(array)
        ref = self.take(array.shape, DType.from_numpy(array.dtype))
        self.constants.append(Constant(ref, array.reshape(-1).view(np.uint8)))
        return ref


def program(instructions, layout: Layout, inputs=(), outputs=(), streamed=(), predicted=0, chip=TINY,
            layers=("test",)) -> Program:
    return Program(chip.name, chip.digest, tuple(instructions), tuple(layout.constants),
                   tuple(HostTensor(tuple(s), d) for s, d in inputs), tuple(HostTensor(tuple(s), d) for s, d in outputs),
                   tuple(layers), predicted, streamed=tuple(streamed))


def run_unchecked(prog: Program, inputs=()) -> Simulator:
    """Run a program for its values only (the schedule is not what the test is about)."""
    sim = Simulator(prog, check_schedule=False)
    sim.run(list(inputs))
    return sim


def ins(opcode, srcs=(), dsts=(), cycle=0, unit_index=0, **attrs) -> Instruction:
    return Instruction(Opcode[opcode] if isinstance(opcode, str) else opcode, unit_index, cycle, tuple(srcs),
                       tuple(dsts), attrs)


def system_program(system, chip_programs: dict, inputs=(), outputs=(), predicted=None):
    """A SystemProgram of hand-built chip programs: ``{system chip: Program}``; host tensors as (chip, index)."""
    from lpx_tvm.runtime_sim.system import load_system
    from lpx_tvm.runtime_sim.system_sim import SystemProgram

    system = load_system(system)
    chips = tuple(sorted(chip_programs))
    programs = tuple(chip_programs[c] for c in chips)
    if predicted is None:
        predicted = max(p.predicted_cycles for p in programs)
    return SystemProgram(system.name, system.digest, chips, programs, tuple(inputs), tuple(outputs), predicted)


def host_bound_add_cycles(chip, rows: int, cols: int) -> int:
    """``conftest.add_model(rows, cols)`` compiled for ``chip``, by hand: both fp32 inputs cross the one host
    link in turn, then the add, then the result crosses back.

    The add moves one vector (``lanes`` floats) of each operand and of the result per step: 12 bytes an
    element need 12 streams a vector; more than one direction's streams make each vector take several
    cycles, fewer let several vectors go at once (as far as the lane's ALUs allow).

    A host transfer over 16 KiB moves in even bands of rows (the tiler's host bands), each its own LOAD or
    STORE, back to back on the link; the add (at most 64 KiB an operand here) runs in one piece.
    """
    host = chip.host_bytes_per_s / chip.clock_hz
    nbytes = rows * cols * 4
    bands = ceil(nbytes / (16 << 10))
    assert rows % bands == 0 and nbytes <= 64 << 10, "even host bands and an add in one piece, as worked here"
    assert cols == chip.lanes, "a row a vector, as worked here"
    transfer = bands * ceil(nbytes // bands / host)
    streams_per_vector = 12
    step = max(1, ceil(streams_per_vector / chip.streams_per_direction))
    rate = max(1, min(chip.vxm_alus_per_lane, chip.streams_per_direction // streams_per_vector))
    add = ceil(rows / rate) * step
    return 2 * transfer + chip.latency_cycles["MEM"] + add + chip.latency_cycles["VXM"] + transfer + \
        chip.latency_cycles["MEM"]


def simulated_cycles(graph, chip) -> int:
    """The cycles the timing-only simulator measures for ``graph`` compiled from tile to emit, its weights resident
    as a pipeline stage holds them: the machine's figure for a block shard, with none of the plan's cost code in
    it (a plan's expected value is then worked by hand over these)."""
    from lpx_tvm.codegen import Target, Compilation, run_stages
    from lpx_tvm.codegen.parallel.base import weight_budget

    c = Compilation("block", Target.parse(config=chip), graph=graph, resident_budget=weight_budget(graph, chip))
    return Simulator(run_stages(c, "tile", "emit"), chip, timing_only=True).stats.cycles
