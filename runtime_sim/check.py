"""Check a program's static schedule against the machine, and measure its cycles.

The hardware has no back-pressure: every instruction issues at the cycle the
program states, and at that cycle everything it needs must be free and every
operand must have arrived. :func:`check_timing` walks the program in issue
order and rejects the first instruction that breaks one of these rules, with
a :class:`ScheduleError` naming the instruction, the cycle, the resource and
the rule:

- ``unit overlap``: a unit instance (a plane's array, a vector queue, a switch,
  a DMA engine) runs one instruction at a time;
- ``host link``: one host transfer at a time on the one PCIe link;
- ``install port``: a plane installs one weight tile at a time;
- ``stream bandwidth``, ``SRAM read bandwidth``, ``SRAM write bandwidth``,
  ``vector ALUs``: what runs in the same cycles shares the chip's streams, its
  slices' read and write ports and each lane's ALUs;
- ``RAW hazard``, ``WAR hazard``, ``WAW hazard``: an SRAM operand is read only
  after its producer has finished, and not overwritten while it is still read;
- ``read before write``: nothing reads SRAM that nothing wrote (inputs arrive
  by LOAD, constants at load);
- ``live constant overwritten``: resident weights are never written;
- ``empty weight buffer``, ``install not finished``, ``weights in use``,
  ``weight shape``: a MATMUL uses a tile installed before it, and a tile is not
  replaced while a MATMUL still uses it;
- ``chained stream``, ``stream conflict``: a chained consumer issues exactly when
  its producer's results arrive, and a stream carries one chain at a time; the
  members of a chain run at one pace (:func:`.timing.chain_pace`);
- ``predicted cycles``: the cycle count in the program's header is the one measured.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, field
from operator import attrgetter

import numpy as np

from .config import ChipConfig
from .hazards import AccessLog, block_view, footprint_key, overlaps, range_key
from .isa import Opcode, Space
from .program import ProgramFormatError
from .timing import Occupancy, occupancy, paced, stream_links


class ScheduleError(ProgramFormatError):
    """A program breaks one of the machine's static-schedule rules."""

    def __init__(self, rule: str, index: int, cycle: int, detail: str):
        self.rule, self.index, self.cycle = rule, index, cycle
        super().__init__(f"{rule}: instruction {index} at cycle {cycle}: {detail}")


@dataclass(frozen=True)
class Timeline:
    """The measured schedule: each instruction's occupancy (busy extended to their chain's pace for chained instructions)."""

    occupancies: tuple  # by instruction index
    order: tuple  # instruction indexes in issue order
    makespan: int
    busy: np.ndarray = field(compare=False)  # the occupancies' busy cycles, as an array


_EXCLUSIVE_RULES = {"HOST": "host link", "MXM.load": "install port"}
_CAPACITY = (("sram_read", "SRAM read bandwidth"), ("sram_write", "SRAM write bandwidth"),
             ("streams", "stream bandwidth"), ("alus", "vector ALUs"))


_RATES = attrgetter(*(key for key, _ in _CAPACITY))


def _limits(chip: ChipConfig) -> dict:
    return {"streams": chip.stream_capacity, "sram_read": chip.sram_bytes_per_cycle,
            "sram_write": chip.sram_bytes_per_cycle, "alus": chip.vxm_alus_per_lane}


class _Buffers:
    """The planes' weight buffers: what is installed, when it is ready, until when it is read."""

    def __init__(self):
        self.state = {}  # (plane, buffer) -> [ready cycle, tile shape, dtype, reads end]

    def install(self, index, ins, issue, occ):
        key = (ins.unit_index, ins.attrs["buffer"])
        old = self.state.get(key)
        if old is not None and old[3] > issue:
            raise ScheduleError("weights in use", index, issue,
                                f"MXM{key[0]} buffer {key[1]} is read by a MATMUL until cycle {old[3]}")
        self.state[key] = [issue + occ.finish, ins.srcs[0].shape, ins.srcs[0].dtype, 0]

    def use(self, index, ins, issue, occ):
        key = (ins.unit_index, ins.attrs["buffer"])
        tile = self.state.get(key)
        if tile is None:
            raise ScheduleError("empty weight buffer", index, issue, f"MXM{key[0]} buffer {key[1]} holds no tile")
        if tile[0] > issue:
            raise ScheduleError("install not finished", index, issue,
                                f"MATMUL before its weight installation into MXM{key[0]} buffer {key[1]} ends "
                                f"at cycle {tile[0]}")
        k, n = tile[1]
        if ins.srcs[0].shape[-1] != k or ins.dsts[0].shape[-1] != n \
                or ins.srcs[0].dtype.matrix_class != tile[2].matrix_class:  # int8 and uint8 mix, as in QLinearMatMul
            raise ScheduleError("weight shape", index, issue,
                                f"MXM{key[0]} buffer {key[1]} holds {tile[2].short}[{k}x{n}], the MATMUL takes "
                                f"{ins.srcs[0]} to {ins.dsts[0]}")
        tile[3] = max(tile[3], issue + occ.busy)


class _Streams:
    """Chained results in flight: the producer of each stream, when its data arrives, and who took it."""

    def __init__(self):
        self.producer = {}  # stream id -> [index, arrival, busy, ref, free from]

    def produce(self, index, ref, issue, occ):
        old = self.producer.get(ref.addr)
        if old is not None and old[4] > issue:
            raise ScheduleError("stream conflict", index, issue,
                                f"stream S{ref.addr} still carries instruction {old[0]}'s result until cycle {old[4]}")
        # a result nobody consumes still flows until its last vector has passed
        self.producer[ref.addr] = [index, issue + occ.latency, occ.busy, ref, issue + occ.finish]

    def consume(self, index, ref, issue) -> None:
        """Check the consumer's timing."""
        chain = self.producer.get(ref.addr)
        if chain is None or chain[0] is None:
            raise ScheduleError("chained stream", index, issue, f"stream S{ref.addr} carries nothing to read")
        if (chain[3].shape, chain[3].dtype) != (ref.shape, ref.dtype):
            raise ScheduleError("chained stream", index, issue,
                                f"stream S{ref.addr} carries {chain[3]}, the instruction reads {ref}")
        if issue < chain[1]:
            raise ScheduleError("chained stream", index, issue,
                                f"reads stream S{ref.addr} before instruction {chain[0]}'s result arrives at "
                                f"cycle {chain[1]}")
        if issue > chain[1]:
            raise ScheduleError("chained stream", index, issue,
                                f"stream S{ref.addr}: instruction {chain[0]}'s result arrived at cycle {chain[1]} "
                                "and has flowed past (streams do not wait)")

    def taken(self, ref, end: int) -> None:
        chain = self.producer[ref.addr]
        chain[0], chain[4] = None, end

    def consumed_by(self, index, ins, issue) -> None:
        """Check each chained source of ``ins``."""
        for ref in ins.srcs:
            if ref.space == Space.STREAM:
                self.consume(index, ref, issue)

    def passed_on(self, index, ins, issue, occ) -> None:
        """Free the streams ``ins`` has read and start the chains it produces."""
        for ref in ins.srcs:
            if ref.space == Space.STREAM:
                self.taken(ref, issue + occ.busy)
        for ref in ins.dsts:
            if ref.space == Space.STREAM:
                self.produce(index, ref, issue, occ)


def check_timing(program, chip: ChipConfig, constants=(), sram_size: int | None = None,
                 protected=()) -> Timeline:
    """Check every rule at every instruction's issue cycle; return the measured timeline.

    Parameters
    ----------
    program : Program
    chip : ChipConfig
    constants : sequence of TensorRef
        Resident data present at load (counts as written; must never be written).
    sram_size : int, optional
        Bytes of SRAM the program's operands span (default: the chip's).
    protected : sequence of (lo, hi)
        Further byte ranges no instruction may write (other programs' resident weights).

    Raises
    ------
    ScheduleError
        Naming the instruction, its cycle, the resource and the rule it breaks.
    """
    instructions = program.instructions
    size = sram_size or chip.sram_bytes
    memory = _Memory(size, constants, protected)
    order = sorted(range(len(instructions)), key=lambda i: (instructions[i].cycle, i))
    free = {}
    running = _Running(_limits(chip))
    buffers, streams = _Buffers(), _Streams()
    occupancies = paced([occupancy(ins, chip) for ins in instructions], stream_links(instructions, order), chip)
    makespan = 0
    for index in order:
        ins = instructions[index]
        issue = ins.cycle
        occ = occupancies[index]
        streams.consumed_by(index, ins, issue)
        _check_exclusive(index, issue, occ, free)
        running.admit(index, issue, occ)
        memory.check(index, ins, issue, occ)
        if ins.opcode == Opcode.INSTALL:
            buffers.install(index, ins, issue, occ)
        elif ins.opcode == Opcode.MATMUL:
            buffers.use(index, ins, issue, occ)
        streams.passed_on(index, ins, issue, occ)
        makespan = max(makespan, issue + occ.finish)
    if program.predicted_cycles != makespan:
        raise ScheduleError("predicted cycles", len(instructions), makespan,
                            f"the header predicts {program.predicted_cycles} cycles, the schedule takes {makespan}")
    return Timeline(tuple(occupancies), tuple(order), makespan,
                    np.fromiter((o.busy for o in occupancies), np.int64, len(occupancies)))


class _Running:
    """Instructions still busy, and what they use of each shared resource together (kept as running sums:
    a program has thousands of instructions and dozens in flight)."""

    def __init__(self, limits: dict):
        self.limits = tuple(limits[key] for key, _ in _CAPACITY)
        self.total = [0] * len(_CAPACITY)
        self._ends = []  # (end, index, rates)

    def admit(self, index: int, issue: int, occ: Occupancy) -> None:
        """Retire what has ended by ``issue``, check that ``occ``'s rates fit beside the rest, and start it."""
        total, ends = self.total, self._ends
        while ends and ends[0][0] <= issue:
            for k, rate in enumerate(heapq.heappop(ends)[2]):
                total[k] -= rate
        rates = _RATES(occ)
        for k, rate in enumerate(rates):
            if rate and total[k] + rate > self.limits[k]:
                key, rule = _CAPACITY[k]
                raise ScheduleError(rule, index, issue, f"{total[k] + rate} > {self.limits[k]} "
                                    f"({key.replace('_', ' ')}) with {len(ends)} instructions running")
        heapq.heappush(ends, (issue + occ.busy, index, rates))
        for k, rate in enumerate(rates):
            total[k] += rate


def _check_exclusive(index, issue, occ, free) -> None:
    for res in occ.exclusive:
        busy_until, holder = free.get(res, (0, None))
        if issue < busy_until:
            rule = _EXCLUSIVE_RULES.get(res[0], "unit overlap")
            raise ScheduleError(rule, index, issue, f"{res[0]}{res[1]} is busy until cycle {busy_until} with "
                                f"instruction {holder}")
    for res in occ.exclusive:
        free[res] = (issue + occ.busy, index)


class _Resident:
    """What is in SRAM from the load on: the constants (readable, never written) and the byte ranges of other
    programs' weights (never written). Kept as footprints, not a byte map: weights are most of a chip's SRAM."""

    def __init__(self, constants, protected):
        self.constant_ranges = sorted((ref.addr, ref.end) for ref in constants)
        self._starts = [lo for lo, _ in self.constant_ranges]
        self._ends = np.array([hi for _, hi in self.constant_ranges], np.int64)
        keys = sorted([footprint_key(ref) for ref in constants] + [range_key(lo, hi) for lo, hi in protected])
        self.keys = np.array(keys, np.int64).T.reshape(6, len(keys))
        # with the footprints sorted by their first byte, those that can meet [lo, hi) start below hi; the
        # running maximum of their ends says at once whether any reaches past lo
        self._los = [k[0] for k in keys]
        self._reach = np.maximum.accumulate([k[1] for k in keys]).tolist() if keys else []

    def holds(self, ref) -> bool:
        """Whether ``ref`` lies within one constant (read from the load on)."""
        k = bisect.bisect_right(self._starts, ref.addr) - 1
        return k >= 0 and ref.end <= self.constant_ranges[k][1]

    def overwritten_by(self, key: tuple) -> bool:
        below = bisect.bisect_left(self._los, key[1])
        if not below or self._reach[below - 1] <= key[0]:
            return False
        return bool(overlaps(self.keys[:, :below], key).any())

    def hold(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """:meth:`holds` for arrays of byte ranges ``[lo, hi)``."""
        if not self.constant_ranges:
            return np.zeros(len(lo), bool)
        k = np.searchsorted(self._starts, lo, side="right") - 1
        return (k >= 0) & (hi <= self._ends[np.maximum(k, 0)])

    def overwritten_by_any(self, keys: np.ndarray) -> bool:
        """:meth:`overwritten_by` for any of the footprints ``keys`` (6 × n): only those whose range reaches a
        resident one are compared."""
        if not self._los:
            return False
        below = np.searchsorted(self._los, keys[1], side="left")
        near = np.flatnonzero((below > 0) & (np.asarray(self._reach)[np.maximum(below - 1, 0)] > keys[0]))
        return any(self.overwritten_by(tuple(keys[:, k].tolist())) for k in near)


class _Memory:
    """The SRAM rules: hazards against the accesses in flight, reads only of written bytes, resident weights
    never written."""

    def __init__(self, size, constants, protected):
        self.log = AccessLog()
        self.written = np.zeros(size, np.bool_)  # bytes instructions wrote (untouched pages cost nothing)
        self.whole = set()  # footprints known to be written in full: written bytes stay written
        self.resident = _Resident(constants, protected)

    def check(self, index, ins, issue, occ) -> None:
        """Check ``ins``'s SRAM operands at ``issue``, then log its accesses."""
        log = self.log
        log.forget_ended_by(issue)  # instructions come in issue order: only accesses still in flight can matter
        reads = [(ref, footprint_key(ref)) for ref in ins.srcs if ref.in_sram]
        writes = [(ref, footprint_key(ref)) for ref in ins.dsts if ref.in_sram]
        for ref, key in reads:
            produced = log.raw(key)
            if produced > issue:
                raise ScheduleError("RAW hazard", index, issue,
                                    f"reads {ref} before its producer finishes at cycle {produced}")
            if key not in self.whole and not self.resident.holds(ref):
                if not block_view(self.written, ref).all():
                    raise ScheduleError("read before write", index, issue, f"reads {ref}, which nothing has written")
                self.whole.add(key)
        for ref, key in writes:
            read_until = log.war(key)
            if read_until > issue:
                raise ScheduleError("WAR hazard", index, issue,
                                    f"overwrites {ref} while a reader reads it until cycle {read_until}")
            written_at = log.raw(key)
            if written_at > issue:
                raise ScheduleError("WAW hazard", index, issue,
                                    f"writes {ref} before an earlier write finishes at cycle {written_at}")
            if self.resident.overwritten_by(key):
                raise ScheduleError("live constant overwritten", index, issue, f"writes {ref} over resident weights")
            if key not in self.whole:
                block_view(self.written, ref)[...] = True
                self.whole.add(key)
        log.record([key for _, key in reads], [key for _, key in writes], issue + occ.busy, issue + occ.finish)
