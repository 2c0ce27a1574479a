"""What set each layer's end: its critical path, walked back from its last result.

A statically scheduled instruction issues at the first cycle every rule allows
(:mod:`.timing`), so one of those rules is *tight* at its issue: the previous
holder of its unit instance ended that cycle, a producer's result arrived, the
weight tile it reads finished installing, or a shared rate (ALUs, streams, SRAM
bandwidth) had no room a cycle earlier. From a layer's last-arriving result the
walk follows the tight rule back, one instruction at a time, until it reaches the
layer's first issue. Every cycle of the span goes to one cause:

- the kind of work of the instruction on the path in it (``matrix``, ``weight
  install``, ``vector``, ``SRAM bandwidth``, ``switch``, ``host link``, ``link``);
- ``dependency``: waiting on another layer's result;
- ``latency``: results in a unit's pipeline, or cycles no rule explains (a host or chip link's latency is
  the link's).

The layer's ``bound`` is the cause with the most cycles.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from .check import _CAPACITY, _RATES, _limits
from .columns import _END, _IN_SRAM, _ROWS, _RUN, _STRIDE, _WRITE
from .hazards import meet_pairs
from .isa import Opcode
from .timing import stream_links

CAUSES = ("matrix", "weight install", "vector", "SRAM bandwidth", "switch", "host link", "link", "dependency",
          "latency")
_CAUSE_OF_BOUND = {"matrix": "matrix", "install": "weight install", "vector": "vector",
                   "streams": "SRAM bandwidth", "switch": "switch", "host": "host link", "link": "link",
                   "latency": "latency"}
LEGEND = ("bound: what set the layer's end, from its critical path (walked back from its last result along the "
          "rule that held each instruction back): the work on the path (matrix, weight install, vector, SRAM "
          "bandwidth, switch, host link, link: a link's latency included), dependency (waiting on another layer's "
          "result) or latency (results in a unit's pipeline); the cause with the most cycles of the span")


class CriticalPaths:
    """The tight rule at each instruction's issue, found on demand (the walks visit few instructions)."""

    def __init__(self, columns, occupancies, busy: np.ndarray):
        program, chip = columns.program, columns.chip
        self.columns, self.occupancies = columns, occupancies
        self.instructions = program.instructions
        self.start = columns.cycle
        self.end = self.start + busy
        self.finish = self.end + columns.latency
        self.cause = [_CAUSE_OF_BOUND.get(o.bound, "latency") for o in occupancies]
        # the cycles after its work until its results arrive: a pipeline's, but a link's latency is the link's
        self.tail = [c if c in ("host link", "link") else "latency" for c in self.cause]
        n = len(self.instructions)
        order = columns.order.tolist()
        self.chained_from = {consumer: producer for producer, consumer in stream_links(self.instructions, order)}
        for consumer, producer in self.chained_from.items():  # a stretched member runs at its chain's pace
            if busy[consumer] > columns.busy[consumer]:
                self.cause[consumer] = self.cause[producer]
        self.unit_before = np.full(n, -1, np.int64)  # the previous holder of a resource, where it ended at issue
        self.installer = {}  # MATMUL -> the INSTALL of the tile it reads
        last_holder, last_install = {}, {}
        for i in order:
            for resource in occupancies[i].exclusive:
                p = last_holder.get(resource)
                if p is not None and self.end[p] == self.start[i] and self.unit_before[i] < 0:
                    self.unit_before[i] = p
                last_holder[resource] = i
            ins = self.instructions[i]
            if ins.opcode == Opcode.INSTALL:
                last_install[(ins.unit_index, ins.attrs["buffer"])] = i
            elif ins.opcode == Opcode.MATMUL:
                self.installer[i] = last_install.get((ins.unit_index, ins.attrs["buffer"]), -1)
        self.group_of, self.group = {}, defaultdict(list)  # a placed-as-one group: its first member, and all
        for i in order:
            before = self.chained_from.get(i, self.installer.get(i, -1))
            first = self.group_of.get(before, before) if before is not None and before >= 0 else -1
            if first >= 0:
                self.group_of.setdefault(before, before)
                self.group_of[i] = first
                if not self.group[first]:
                    self.group[first].append(before)
                self.group[first].append(i)
        op, addr, owner = columns.operand, columns.addr, columns.owner
        keys = np.stack([addr, addr + op[:, _END], op[:, _STRIDE], addr, op[:, _ROWS], op[:, _RUN]])
        in_sram = op[:, _IN_SRAM].astype(bool)
        writes = np.flatnonzero(in_sram & op[:, _WRITE].astype(bool))
        writes = writes[np.argsort(self.finish[owner[writes]], kind="stable")]
        self.write_finish, self.write_owner, self.write_keys = self.finish[owner[writes]], owner[writes], keys[:, writes]
        reads = np.flatnonzero(in_sram & ~op[:, _WRITE].astype(bool))
        self.reads_of = defaultdict(list)
        for k, i in zip(reads.tolist(), owner[reads].tolist()):
            self.reads_of[i].append(k)
        self.read_keys = keys
        self.rates = np.array([_RATES(o) for o in occupancies], np.int64).reshape(n, len(_CAPACITY))
        self.limits = np.array([_limits(chip)[key] for key, _ in _CAPACITY], np.int64)

    def linked(self, i: int) -> int:
        """The member of ``i``'s group placed just before it (the MATMUL its chained EPILOGUE follows, the
        INSTALL its MATMUL reads), where that link is what timed it; else -1."""
        s = self.start[i]
        chained = self.chained_from.get(i)
        if chained is not None and self.start[chained] + self.columns.latency[chained] == s:
            return chained
        installer = self.installer.get(i, -1)
        return installer if installer >= 0 and self.finish[installer] == s else -1

    def producers(self, i: int) -> list:
        """The instructions whose results in SRAM arrived the cycle ``i`` issued and which ``i`` reads."""
        s = int(self.start[i])
        reads = self.reads_of.get(i)
        if not reads:
            return []
        lo, hi = np.searchsorted(self.write_finish, [s, s + 1])
        found = []
        if hi > lo:
            candidates = self.write_keys[:, lo:hi]
            for k in reads:
                hit = meet_pairs(candidates, self.read_keys[:, k:k + 1].repeat(hi - lo, axis=1))
                found += self.write_owner[lo:hi][hit].tolist()
        return found

    def rate_holder(self, i: int) -> int:
        """One of the instructions holding a shared rate that had no room for ``i`` a cycle before it issued,
        and that ended at the issue; -1 where no rate was full."""
        s = int(self.start[i])
        running = np.flatnonzero((self.start < s) & (self.end >= s) & (self.end > self.start))
        if not len(running):
            return -1
        full = (self.rates[running].sum(axis=0) + self.rates[i] > self.limits) & (self.rates[i] > 0)
        for k in np.flatnonzero(full).tolist():
            ending = running[(self.end[running] == s) & (self.rates[running, k] > 0)]
            if len(ending):
                return int(ending[0])
        return -1

    def walk(self, members: np.ndarray, lo: int, hi: int, row_of: np.ndarray) -> dict:
        """The span ``[lo, hi)`` of the layer made of instructions ``members``, cycle by cycle to its causes.

        ``row_of`` gives each instruction's layer row (a producer in another row is a dependency).
        """
        causes = defaultdict(int)
        last = members[np.lexsort((members, self.finish[members]))[-1]]
        row = row_of[last]
        x, t, seen = int(last), hi, set()
        while t > lo and x not in seen:
            seen.add(x)
            s, e = int(self.start[x]), int(self.end[x])
            if t > e:
                causes[self.tail[x]] += t - max(e, lo)
            if min(e, t) > max(s, lo):
                causes[self.cause[x]] += min(e, t) - max(s, lo)
            t = min(t, s)
            if t <= lo:
                break
            x, gap = self._setter(x, row, row_of)
            if x < 0:
                causes[gap] += t - lo
                break
            if gap:  # (only cycles no rule explains leave a gap before the next instruction on the path)
                causes[gap] += t - max(int(self.end[x]), lo)
                t = int(self.end[x])
        return dict(causes)

    def _setter(self, x: int, row: int, row_of) -> tuple:
        """``(instruction, cause of the cycles before x)`` the walk goes on to; ``(-1, cause)`` ends it.

        A group (an INSTALL, its MATMUL, the EPILOGUE chained to it) is placed as one, at fixed offsets:
        where nothing outside held ``x`` back, the walk goes on to the member before it, and from the first
        to whatever held back a later one (the EPILOGUE's vector queue, the MATMUL's input).
        """
        step = self._held_by(x, row, row_of)
        if step is not None:
            return step
        before = self.linked(x)
        if before >= 0:
            return before, None
        for member in self.group.get(self.group_of.get(x, -1), ()):
            if member != x:
                step = self._held_by(member, row, row_of)
                if step is not None:
                    return step
        earlier = np.flatnonzero((row_of == row) & (self.end <= self.start[x]) & (np.arange(len(row_of)) != x))
        if not len(earlier):
            return -1, "latency"
        return int(earlier[np.argmax(self.end[earlier])]), "latency"

    def _held_by(self, x: int, row: int, row_of):
        """What outside its group held ``x`` back: ``(instruction, None)``, ``(-1, "dependency")``, or None."""
        data = self.producers(x)
        unit = int(self.unit_before[x])
        for p in data:
            if row_of[p] == row:
                return p, None
        if unit >= 0 and row_of[unit] == row:
            return unit, None
        if data:
            return -1, "dependency"
        if unit >= 0:
            return unit, None
        holder = self.rate_holder(x)
        return (holder, None) if holder >= 0 else None


def bound_of(causes: dict) -> str:
    """The cause with the most cycles (ties go to the earlier in :data:`CAUSES`)."""
    return max(CAUSES, key=lambda c: (causes.get(c, 0), -CAUSES.index(c))) if causes else "latency"
