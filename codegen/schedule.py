"""schedule: give every instruction an issue cycle, a unit instance and its streams.

A list scheduler over the dependence graph, longest path to the end first.
Dependences come from the program order the tiler wrote: SRAM accesses to
overlapping bytes (a read after a write waits for the write to finish; a write
after a read waits for the read to end; writes stay in order), and each plane's
weight buffers (a MATMUL after the INSTALL that filled its buffer; the next
INSTALL into it after the MATMULs that use it). A chained pair (a MATMUL
streaming into its EPILOGUE) is placed as one: the consumer issues exactly when
the producer's results arrive.

Each instruction goes at the earliest cycle its dependences allow at which every
resource it needs is free for as long as it needs it: its unit instance, the
host link, the plane's install port, a stream number for a chain, and its share
of the streams, SRAM bandwidth and vector ALUs. The rules are the machine's
(``runtime_sim.timing``); the simulator checks the result against them.
"""

from __future__ import annotations

import heapq
from collections import defaultdict

import numpy as np

from ..runtime_sim import ChipConfig, Instruction, Opcode, Space, TensorRef
from ..runtime_sim.check import _stretched
from ..runtime_sim.hazards import footprint_key
from ..runtime_sim.timing import occupancy
from .calendar import Exclusive, Shared

_SHARED = ("streams", "sram_read", "sram_write", "alus")


class _DepLog:
    """Earlier SRAM accesses by instruction, to find the ones a new access conflicts with."""

    def __init__(self, capacity: int):
        self.keys = {"r": np.zeros((7, max(capacity, 1)), np.int64), "w": np.zeros((7, max(capacity, 1)), np.int64)}
        self.owner = {"r": np.zeros(max(capacity, 1), np.int64), "w": np.zeros(max(capacity, 1), np.int64)}
        self.n = {"r": 0, "w": 0}

    def hits(self, kind: str, ref) -> np.ndarray:
        n = self.n[kind]
        if not n:
            return np.zeros(0, np.int64)
        lo, hi, stride, row0, row1, col0, col1 = footprint_key(ref)
        f = self.keys[kind][:, :n]
        hit = (f[0] < hi) & (f[1] > lo)
        if stride:
            hit &= (f[2] != stride) | ((f[3] < row1) & (f[4] > row0) & (f[5] < col1) & (f[6] > col0))
        return self.owner[kind][:n][hit]

    def add(self, kind: str, ref, index: int) -> None:
        n = self.n[kind]
        self.keys[kind][:, n] = footprint_key(ref)
        self.owner[kind][n] = index
        self.n[kind] = n + 1


def dependences(instructions: list, occ: list) -> list:
    """``preds[i]``: ``(j, delay)`` pairs, meaning instruction i issues at least ``delay`` cycles after j."""
    preds = [dict() for _ in instructions]

    def need(i, j, delay):
        preds[i][j] = max(preds[i].get(j, 0), delay)

    log = _DepLog(sum(len(ins.srcs) + len(ins.dsts) for ins in instructions))
    installs, readers = {}, defaultdict(list)
    for i, ins in enumerate(instructions):
        for ref in ins.srcs:
            if ref.in_sram:
                for j in log.hits("w", ref):
                    need(i, j, occ[j].finish)  # read after write
        for ref in ins.dsts:
            if ref.in_sram:
                for j in log.hits("r", ref):
                    if j != i:
                        need(i, j, occ[j].busy)  # write after read
                for j in log.hits("w", ref):
                    need(i, j, occ[j].finish)  # write after write
        for ref in ins.srcs:
            if ref.in_sram:
                log.add("r", ref, i)
        for ref in ins.dsts:
            if ref.in_sram:
                log.add("w", ref, i)
        if ins.opcode in (Opcode.INSTALL, Opcode.MATMUL):
            key = (ins.unit_index, ins.attrs["buffer"])
            if ins.opcode == Opcode.INSTALL:
                for j in readers.pop(key, []):
                    need(i, j, occ[j].busy)  # the tile is in use until its MATMULs have streamed through
                if key in installs:
                    need(i, installs[key], occ[installs[key]].busy)
                installs[key] = i
            else:
                need(i, installs[key], occ[installs[key]].finish)
                readers[key].append(i)
    return [list(p.items()) for p in preds]


class _Resources:
    def __init__(self, config: ChipConfig):
        self.config = config
        self.exclusive = defaultdict(Exclusive)
        limits = {"streams": config.stream_capacity, "sram_read": config.sram_bytes_per_cycle,
                  "sram_write": config.sram_bytes_per_cycle, "alus": config.vxm_alus_per_lane}
        self.shared = {key: Shared(limits[key]) for key in _SHARED}

    def instances(self, ins, fixed: bool) -> list:
        if fixed:
            return [ins.unit_index]
        return list(range(self.config.unit_count(ins.unit.name)))

    def fit(self, t: int, parts: list) -> int:
        """Earliest cycle >= t at which every part (offset, occupancy, exclusive keys) fits."""
        while True:
            start = t
            for offset, occ, keys in parts:
                for key in keys:
                    start = max(start, self.exclusive[key].earliest(start + offset, occ.busy) - offset)
                for name in _SHARED:
                    start = max(start, self.shared[name].earliest(start + offset, occ.busy, getattr(occ, name))
                                - offset)
            if start == t:
                return t
            t = start

    def book(self, t: int, parts: list) -> None:
        for offset, occ, keys in parts:
            for key in keys:
                self.exclusive[key].book(t + offset, occ.busy)
            for name in _SHARED:
                self.shared[name].book(t + offset, occ.busy, getattr(occ, name))


def _exclusive_keys(occ, unit_index: int) -> list:
    """The occupancy's exclusive resources, with its unit instance replaced by ``unit_index``."""
    keys = []
    for name, index in occ.exclusive:
        keys.append((name, unit_index if name in ("MEM", "MXM", "MXM.load", "VXM", "SXM", "ICU") else index))
    return keys


def schedule(instructions: list, config: ChipConfig, in_order: bool = False, fixed_units=None) -> tuple:
    """Assign issue cycles, unit instances and stream numbers.

    Parameters
    ----------
    instructions : list of Instruction
        In program order; cycles are ignored, and so are unit indexes not in ``fixed_units``.
        A chained operand is a stream ref whose address names its chain.
    config : ChipConfig
    in_order : bool
        Issue each instruction (or chained pair) only after the previous one has
        finished: the reference schedule that scheduling must not change the
        results of.
    fixed_units : set of int, optional
        Instructions whose unit index the tiler chose (a MATMUL's plane).

    Returns
    -------
    (list of Instruction, int)
        The scheduled instructions (sorted by issue cycle) and the makespan.
    """
    fixed_units = set(fixed_units or ())
    n = len(instructions)
    occ = [occupancy(ins, config) for ins in instructions]
    producer, consumer = {}, {}
    for i, ins in enumerate(instructions):
        for ref in ins.dsts:
            if ref.space == Space.STREAM:
                producer[ref.addr] = i
        for ref in ins.srcs:
            if ref.space == Space.STREAM:
                consumer[ref.addr] = i
    chained = {producer[c]: consumer[c] for c in producer if c in consumer}
    for p, c in chained.items():
        if occ[p].busy > occ[c].busy:
            occ[c] = _stretched(occ[c], occ[p].busy)
    preds = dependences(instructions, occ)
    # a node is an instruction, or a chained pair placed together (the consumer at the producer's latency)
    head = {c: p for p, c in chained.items()}
    nodes = [i for i in range(n) if i not in head]
    members = {i: [(i, 0)] + ([(chained[i], occ[i].latency)] if i in chained else []) for i in nodes}
    node_of = {m: i for i in nodes for m, _ in members[i]}
    node_preds = {i: {} for i in nodes}
    for i in nodes:
        for m, offset in members[i]:
            for j, delay in preds[m]:
                if node_of[j] == i:
                    continue
                # the member at +offset must start `delay` after j (a member of node_of[j] at j's offset)
                key = node_of[j]
                j_offset = dict(members[key])[j]
                node_preds[i][key] = max(node_preds[i].get(key, -10**18), j_offset + delay - offset)
    succs = defaultdict(list)
    for i, ps in node_preds.items():
        for j, delay in ps.items():
            succs[j].append((i, delay))
    length = {i: max(offset + occ[m].finish for m, offset in members[i]) for i in nodes}
    priority = {}
    for i in reversed(nodes):  # program order is a topological order: the longest path to the end
        priority[i] = max(length[i], max((delay + priority[s] for s, delay in succs[i]), default=0))
    resources = _Resources(config)
    issue, unit, stream_of = {}, {}, {}
    waiting = {i: len(node_preds[i]) for i in nodes}
    # in order, nodes go strictly in program order; else longest path first
    key = (lambda i: i) if in_order else (lambda i: -priority[i])
    ready = [(key(i), i) for i in nodes if waiting[i] == 0]
    heapq.heapify(ready)
    earliest = defaultdict(int)
    horizon = 0
    stream_calendar = [Exclusive() for _ in range(config.stream_capacity)]
    while ready:
        _, i = heapq.heappop(ready)
        t = max(earliest[i], horizon if in_order else 0)
        t = _place(i, t, members[i], instructions, occ, fixed_units, resources, stream_calendar, issue, unit,
                   stream_of, chained)
        if in_order:
            horizon = t + length[i]
        for s, delay in succs[i]:
            earliest[s] = max(earliest[s], t + delay)
            waiting[s] -= 1
            if waiting[s] == 0:
                heapq.heappush(ready, (key(s), s))
    if len(issue) != n:
        raise RuntimeError("schedule: the dependence graph has a cycle")
    return _finish(instructions, occ, issue, unit, stream_of)


def _place(i, t, group, instructions, occ, fixed_units, resources, stream_calendar, issue, unit, stream_of,
           chained) -> int:
    """Place node ``i`` (an instruction or a chained pair) at the earliest feasible cycle >= t."""
    choice = []
    for m, offset in group:
        ins = instructions[m]
        candidates = resources.instances(ins, m in fixed_units)
        best = min(candidates, key=lambda k: resources.exclusive[(ins.unit.name, k)].earliest(t + offset,
                                                                                               occ[m].busy))
        choice.append((offset, occ[m], _exclusive_keys(occ[m], best), m, best))
    parts = [(o, oc, keys) for o, oc, keys, _, _ in choice]
    number = None
    if i in chained:  # the stream carries the chain from the producer's issue to the consumer's end
        span = group[1][1] + occ[group[1][0]].busy
        while True:
            t = resources.fit(t, parts)
            number = min(range(len(stream_calendar)), key=lambda s: stream_calendar[s].earliest(t, span))
            free_at = stream_calendar[number].earliest(t, span)
            if free_at == t:
                break
            t = free_at
        stream_calendar[number].book(t, span)
    else:
        t = resources.fit(t, parts)
    resources.book(t, parts)
    for offset, _, _, m, best in choice:
        issue[m] = t + offset
        unit[m] = best
    if number is not None:
        stream_of[(i, chained[i])] = number
    return t


def _finish(instructions, occ, issue, unit, stream_of) -> tuple:
    physical = {}
    for (p, c), number in stream_of.items():
        for ref in instructions[p].dsts:
            if ref.space == Space.STREAM:
                physical[(p, ref.addr)] = number
                physical[(c, ref.addr)] = number

    def remap(i, refs):
        return tuple(TensorRef(physical[(i, r.addr)], r.shape, r.dtype, r.strides, Space.STREAM)
                     if r.space == Space.STREAM else r for r in refs)
    out = [Instruction(ins.opcode, unit[i], issue[i], remap(i, ins.srcs), remap(i, ins.dsts), ins.attrs, ins.layer)
           for i, ins in enumerate(instructions)]
    order = sorted(range(len(out)), key=lambda i: (out[i].cycle, i))
    makespan = max((issue[i] + occ[i].finish for i in range(len(out))), default=0)
    return [out[i] for i in order], makespan
