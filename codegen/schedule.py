"""schedule: give every instruction an issue cycle, a unit instance and its streams.

A list scheduler over the dependence graph: groups in the order their
dependences let them start, the longest path to the end first among those
(``_TIME_GRAIN``).
Dependences come from the program order the tiler wrote: SRAM accesses to
overlapping bytes (a read after a write waits for the write to finish; a write
after a read waits for the read to end; writes stay in order), and each plane's
weight buffers. An INSTALL, the MATMUL that uses its tile and the EPILOGUE its
results stream into are placed as one group: the MATMUL issues when the tile is
in, the EPILOGUE exactly when the MATMUL's results arrive; the scheduler picks
the plane's weight buffer and the stream that carries the results, so planes
double-buffer without the tiler fixing an order.

Each instruction goes at the earliest cycle its dependences allow at which every
resource it needs is free for as long as it needs it: its unit instance, the
host link, the plane's install port, a stream number for a chain, and its share
of the streams, SRAM bandwidth and vector ALUs. The rules are the machine's
(``runtime_sim.timing``); the simulator checks the result against them.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, bisect_right, insort
from collections import defaultdict

import numpy as np

from ..runtime_sim import ChipConfig, Instruction, Opcode, Space, TensorRef
from ..runtime_sim.hazards import footprint_key, meets, overlaps
from ..runtime_sim.timing import occupancy, paced
from .calendar import Exclusive, Shared

_SHARED = ("streams", "sram_read", "sram_write", "alus")
# Ready groups are taken in the order their dependences let them start, to this many cycles, and by the
# longest path to the end within that. By the longest path alone, a group that could start only late was
# booked before one that could start at once and could take the slots that one needed. Over the zoo's 70
# runs (tsp in fp32, fp16, bf16 and int8; lp30 in fp8): 1.3% fewer cycles (geometric mean), from 9.2% fewer
# (inception_v1, fp16) to 3.2% more (inception_v2, fp8 on lp30, where every grain tried cost 2-4% on both
# inceptions and gained 5-8% on vgg19). On tsp, grains of 64 and 128 measured best; 1 (strict time order)
# cost up to 1.7% more (alexnet, int8) and 2048 gained half as much.
_TIME_GRAIN = 128
# Entries a dependence query tests one by one in Python rather than in numpy. Python's test won at every
# size the zoo meets (ResNet-50's queries: 51 candidates on average, 258 at most; its dependences took
# 0.33 s against 0.54 s with numpy past 24, a 24,061-instruction prefill's 2.1 s against 3.2 s): numpy's
# per-call cost is most of a query's work until a block is far more crowded than these.
_FEW = 2048


class _DepLog:
    """Earlier SRAM accesses by instruction, to find the ones a new access conflicts with.

    An entry is filed by the blocks of SRAM it touches, in blocks of its own size's scale (16 KiB, or the
    power of two at or above its span: an entry lies in one or two blocks of its scale), so a query compares
    only against accesses near it, and a large access is not listed in every 16 KiB block it covers (a query
    then gathered it from each of them). A query looks in every scale entries were filed at. An entry a later
    dense write covers whole is retired (see :meth:`add`).
    """

    _SHIFT = 14

    def __init__(self, capacity: int):
        capacity = max(capacity, 1)
        self.keys = {"r": np.zeros((6, capacity), np.int64), "w": np.zeros((6, capacity), np.int64)}
        self.n = {"r": 0, "w": 0}
        self.blocks = {"r": {}, "w": {}}  # kind -> scale (a shift) -> block -> entries
        self.filed = {"r": {}, "w": {}}  # kind -> scale -> the blocks filed into, in order
        self.key_tuples = {"r": [], "w": []}  # the same keys, for the pure-Python test of a few entries
        self.owners = {"r": [], "w": []}  # the instruction that made each entry

    @staticmethod
    def _spanned(lo: int, hi: int, shift: int) -> range:
        return range(lo >> shift, ((hi - 1) >> shift) + 1)

    def _found(self, kind: str, lo: int, hi: int) -> list:
        """The entry lists of the blocks ``[lo, hi)`` touches, at every scale (only the blocks ever filed
        into are visited: most of a large query's blocks at a small scale hold nothing)."""
        found = []
        for shift, blocks in self.blocks[kind].items():
            filed = self.filed[kind][shift]
            first, last = bisect_left(filed, lo >> shift), bisect_right(filed, (hi - 1) >> shift)
            found += [entries for b in filed[first:last] if (entries := blocks[b])]
        return found

    def hits(self, kind: str, key: tuple):
        """Owners of the earlier accesses of ``kind`` that meet the footprint ``key``."""
        lo, hi = key[0], key[1]
        found = self._found(kind, lo, hi)
        if sum(len(f) for f in found) <= _FEW:  # numpy's cost a call is most of the work for a few entries
            tuples, owners = self.key_tuples[kind], self.owners[kind]
            ids = found[0] if len(found) == 1 else sorted({j for f in found for j in f})
            # the bounding ranges first: most candidates miss there, before a call
            return [owners[j] for j in ids
                    if (t := tuples[j])[0] < hi and t[1] > lo and meets(t, key)]
        ids = found[0] if len(found) == 1 else np.unique(np.concatenate(found))
        ids = np.asarray(ids, np.int64)
        owners = self.owners[kind]
        return [owners[j] for j in ids[overlaps(self.keys[kind][:, ids], key)].tolist()]

    def add(self, kind: str, key: tuple, index: int) -> None:
        """Log an access. A dense write first retires the earlier plain-range accesses inside it: a later
        access that meets them meets the write, which is ordered after them (write after write, write after
        read), so the edge to the write implies theirs with at least their delay. A retired entry lies in
        blocks the write spans (at the entry's scale) and nowhere else, so dropping it there forgets it."""
        lo, hi = key[0], key[1]
        if kind == "w" and key[2] == 0:
            # plain ranges only: a strided entry can meet a later access of another stride through its
            # bounding range (as :func:`overlaps` compares them) where that access misses the write
            for k in ("r", "w"):
                tuples = self.key_tuples[k]
                for shift, blocks in self.blocks[k].items():
                    filed = self.filed[k][shift]
                    for b in filed[bisect_left(filed, lo >> shift):bisect_right(filed, (hi - 1) >> shift)]:
                        entries = blocks[b]
                        if entries:
                            blocks[b] = [j for j in entries
                                         if tuples[j][2] or tuples[j][0] < lo or tuples[j][1] > hi]
        n = self.n[kind]
        self.keys[kind][:, n] = key
        self.key_tuples[kind].append(tuple(int(v) for v in key))
        self.owners[kind].append(index)
        self.n[kind] = n + 1
        shift = max(self._SHIFT, (hi - lo - 1).bit_length())
        blocks = self.blocks[kind].setdefault(shift, {})
        filed = self.filed[kind].setdefault(shift, [])
        for b in self._spanned(lo, hi, shift):
            entries = blocks.get(b)
            if entries is None:
                blocks[b] = entries = []
                insort(filed, b)
            entries.append(n)


def dependences(instructions: list, occ: list) -> list:
    """``preds[i]``: ``(j, delay)`` pairs, meaning instruction i issues at least ``delay`` cycles after j.

    These are the SRAM dependences; a MATMUL's tie to its INSTALL and a chained
    consumer's to its producer are fixed offsets within a group (:func:`_groups`).
    """
    preds = [dict() for _ in instructions]

    def need(i, j, delay):
        preds[i][j] = max(preds[i].get(j, 0), delay)

    log = _DepLog(sum(len(ins.srcs) + len(ins.dsts) for ins in instructions))
    for i, ins in enumerate(instructions):
        reads = [footprint_key(ref) for ref in ins.srcs if ref.in_sram]
        writes = [footprint_key(ref) for ref in ins.dsts if ref.in_sram]
        for key in reads:
            for j in log.hits("w", key):
                need(i, j, occ[j].finish)  # read after write
        for key in writes:
            for j in log.hits("r", key):
                if j != i:
                    need(i, j, occ[j].busy)  # write after read
            for j in log.hits("w", key):
                need(i, j, occ[j].finish)  # write after write
        for key in reads:
            log.add("r", key, i)
        for key in writes:
            log.add("w", key, i)
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

    def fit(self, t: int, parts: list, pieces: dict | None = None) -> int:
        """``t`` if every part (offset, occupancy, exclusive keys) fits at ``t``, else the next cycle worth
        trying: the latest of the first cycles from which each part's resources are free.

        One pass, not a search to the end: the caller chooses the unit instances again at the cycle this
        returns (keys chosen at ``t`` can be the wrong ones later: a vector unit that frees last). Parts of
        one node (a chained pair) overlap in time, so a shared resource is checked against their combined
        demand, piece by piece (``pieces``: :func:`_pieces` of each shared resource, when the caller has them).
        """
        start = t
        for offset, occ, keys in parts:
            for key in keys:
                start = max(start, self.exclusive[key].earliest(t + offset, occ.busy) - offset)
        for name in _SHARED:
            for lo, hi, demand in (pieces[name] if pieces is not None else _pieces(parts, name)):
                start = max(start, self.shared[name].earliest(t + lo, hi - lo, demand) - lo)
        return start

    def book(self, t: int, parts: list) -> None:
        for offset, occ, keys in parts:
            for key in keys:
                self.exclusive[key].book(t + offset, occ.busy)
            for name in _SHARED:
                self.shared[name].book(t + offset, occ.busy, getattr(occ, name))


def _pieces(parts: list, name: str) -> list:
    """``(lo, hi, demand)``: a node's combined demand of one shared resource, constant on each piece."""
    if len(parts) == 1:  # most nodes: one instruction, one piece
        offset, occ, _ = parts[0]
        demand = getattr(occ, name)
        return [(offset, offset + occ.busy, demand)] if demand and occ.busy > 0 else []
    cuts = sorted({c for offset, occ, _ in parts for c in (offset, offset + occ.busy)})
    out = []
    for lo, hi in zip(cuts, cuts[1:]):
        demand = sum(getattr(occ, name) for offset, occ, _ in parts if offset <= lo and hi <= offset + occ.busy)
        if demand:
            out.append((lo, hi, demand))
    return out


def _exclusive_keys(occ, unit_index: int) -> list:
    """The occupancy's exclusive resources, with its unit instance replaced by ``unit_index``."""
    keys = []
    for name, index in occ.exclusive:
        keys.append((name, unit_index if name in ("MEM", "MXM", "MXM.load", "VXM", "SXM", "ICU") else index))
    return keys


def _groups(instructions: list, occ: list, pairs: dict | None = None) -> tuple:
    """Instructions placed together at fixed offsets, and the pooled resources each group needs.

    A chained consumer issues when its producer's results arrive (a stream
    number carries them); a MATMUL issues when the INSTALL that fills its
    weight buffer has finished (a buffer of the plane holds the tile). Returns
    ``(groups, pools)``: ``groups`` maps a root to ``[(member, offset), ...]``,
    ``pools`` a root to ``[(pool, first member, last member), ...]``.
    """
    pinned, pools = {}, defaultdict(list)
    producer, consumer = {}, {}
    installs = {}
    for i, ins in enumerate(instructions):
        for ref in ins.dsts:
            if ref.space == Space.STREAM:
                producer[ref.addr] = i
        for ref in ins.srcs:
            if ref.space == Space.STREAM:
                consumer[ref.addr] = i
        if ins.opcode == Opcode.INSTALL:
            installs[(ins.unit_index, ins.attrs["buffer"])] = i
        elif ins.opcode == Opcode.MATMUL:
            pinned[i] = (installs[(ins.unit_index, ins.attrs["buffer"])], "buffer")
    chains = {}
    for chain, p in producer.items():
        if chain in consumer:
            pinned[consumer[chain]] = (p, "stream")
            chains[consumer[chain]] = chain
    for recv, send in (pairs or {}).items():  # a RECV takes its data one hop after the SEND it answers
        pinned[recv] = (send, "link")
    root, offset = {}, {}

    def resolve(i):
        if i not in root:
            if i in pinned:
                j, kind = pinned[i]
                resolve(j)
                root[i] = root[j]
                offset[i] = offset[j] + (occ[j].finish if kind == "buffer" else occ[j].latency)
            else:
                root[i], offset[i] = i, 0
    for i in range(len(instructions)):
        resolve(i)
    groups = defaultdict(list)
    for i in range(len(instructions)):
        groups[root[i]].append((i, offset[i]))
    for i, (j, kind) in pinned.items():
        if kind != "link":  # a link pair needs no stream number or weight buffer
            pools[root[i]].append((kind, j, i, chains.get(i)))
    return dict(groups), pools


def schedule(instructions: list, config: ChipConfig, in_order: bool = False, fixed_units=None,
             pinned: dict | None = None, pairs: dict | None = None, alike: tuple = ()) -> tuple:
    """Assign issue cycles, unit instances, stream numbers and weight buffers.

    Parameters
    ----------
    instructions : list of Instruction
        In program order; cycles are ignored, and so are unit indexes not in
        ``fixed_units``. A chained operand is a stream ref whose address names
        its chain, and an INSTALL's buffer names the tile its MATMUL uses: the
        scheduler picks the physical stream and buffer.
    config : ChipConfig
    in_order : bool
        Issue each group only after the previous one has finished: the
        reference schedule that scheduling must not change the results of.
    fixed_units : set of int, optional
        Instructions whose unit index the tiler chose (a MATMUL's plane).
    pinned : dict, optional
        Instruction ─► the cycle it must issue at (a RECV takes its data exactly as it arrives); placed
        before anything else, so that nothing takes what it needs then.
    pairs : dict, optional
        RECV ─► the SEND it is placed one hop (the SEND's latency) after: a collective in which every chip
        runs this schedule, so the data each RECV takes left a neighbour at its own SEND's cycle.
    alike : tuple of lists of Instruction
        The other ranks of an SPMD collective: instruction ``i`` of each does what ``instructions[i]`` does
        (the same opcode, shapes and units) at addresses of its own (the block of a gathered tensor it
        holds). The one schedule every rank runs honours every rank's SRAM dependences.

    Returns
    -------
    (list of Instruction, int, list of int)
        The scheduled instructions (sorted by issue cycle), the makespan, and each scheduled instruction's
        index in ``instructions`` (so that another rank's can take the same cycles, :func:`restamp`).
    """
    fixed_units = set(fixed_units or ())
    n = len(instructions)
    occ = [occupancy(ins, config) for ins in instructions]
    groups, pools = _groups(instructions, occ, pairs)
    # a chain's members run at one pace
    occ = paced(occ, [(p, c) for root in groups for kind, p, c, _ in pools[root] if kind == "stream"], config)
    preds = dependences(instructions, occ)
    for other in alike:
        for mine, theirs in zip(preds, dependences(other, occ)):
            merged = dict(mine)
            for j, delay in theirs:
                merged[j] = max(merged.get(j, delay), delay)
            mine[:] = merged.items()
    nodes = sorted(groups)  # roots, in program order (a topological order of the groups)
    where = {m: (root, off) for root, members in groups.items() for m, off in members}
    node_preds = {i: {} for i in nodes}
    for i in nodes:
        for m, offset in groups[i]:
            for j, delay in preds[m]:
                key, j_offset = where[j]
                if key != i:  # member at +offset starts `delay` after j, itself at +j_offset of its group
                    node_preds[i][key] = max(node_preds[i].get(key, -10**18), j_offset + delay - offset)
    succs = defaultdict(list)
    for i, ps in node_preds.items():
        for j, delay in ps.items():
            succs[j].append((i, delay))
    length = {i: max(offset + occ[m].finish for m, offset in groups[i]) for i in nodes}
    priority = {}
    for i in reversed(nodes):  # the longest path to the end
        priority[i] = max(length[i], max((delay + priority[s] for s, delay in succs[i]), default=0))
    placer = _Placer(config, instructions, occ, fixed_units)
    fixed_at = {}
    for i, cycle in sorted((pinned or {}).items(), key=lambda kv: kv[1]):
        if where[i][0] != i or len(groups[i]) != 1:
            raise ValueError(f"schedule: instruction {i} is pinned but placed with others")
        fixed_at[i] = placer.place(groups[i], pools[i], cycle)
        if fixed_at[i] != cycle:
            raise ValueError(f"schedule: instruction {i} must issue at cycle {cycle}, its resources are busy")
    waiting = {i: len(node_preds[i]) for i in nodes}
    earliest = defaultdict(int)  # of a ready group: the cycle its dependences let it start
    if in_order:
        key = lambda i: i  # strictly program order
    elif pairs:  # every chip of the collective places its groups in one order, which its own cycles cannot sway
        key = lambda i: -priority[i]
    else:  # time order, the longest path first among groups free to start in one grain
        key = lambda i: (earliest[i] // _TIME_GRAIN, -priority[i])
    ready = [(key(i), i) for i in nodes if waiting[i] == 0]
    heapq.heapify(ready)
    horizon = 0
    while ready:
        _, i = heapq.heappop(ready)
        if i in fixed_at:
            t = fixed_at[i]
            if earliest[i] > t:
                raise ValueError(f"schedule: instruction {i} must issue at cycle {t}, but its dependences end at "
                                 f"cycle {earliest[i]}")
        else:
            t = placer.place(groups[i], pools[i], max(earliest[i], horizon if in_order else 0))
        if in_order:
            horizon = t + length[i]
        for s, delay in succs[i]:
            earliest[s] = max(earliest[s], t + delay)
            waiting[s] -= 1
            if waiting[s] == 0:
                heapq.heappush(ready, (key(s), s))
    if len(placer.issue) != n:
        raise RuntimeError("schedule: the dependence graph has a cycle")
    return placer.finish()


class _Placer:
    """Places groups on the resource calendars and remembers the choices."""

    def __init__(self, config, instructions, occ, fixed_units):
        self.config, self.instructions, self.occ, self.fixed = config, instructions, occ, fixed_units
        self.resources = _Resources(config)
        self.issue, self.unit, self.pooled = {}, {}, {}
        self.streams = [Exclusive() for _ in range(config.stream_capacity)]
        self.buffers = defaultdict(Exclusive)  # (plane, buffer)

    def _pool(self, kind, first, last, t, offsets):
        """Candidates (calendar, choice) and the span [from, to) relative to the group's issue."""
        lo = offsets[first]
        hi = offsets[last] + self.occ[last].busy
        if kind == "stream":
            return [(cal, k) for k, cal in enumerate(self.streams)], lo, hi
        plane = self.unit.get(first, self.instructions[first].unit_index)
        return [(self.buffers[(plane, b)], b) for b in range(self.config.mxm_weight_buffers)], lo, hi

    def _instances(self, group, t) -> list:
        """Each member's unit instance: the one free soonest for it if the group issues at ``t``."""
        choice, held = [], []  # held: (unit, instance, from, to) of the group's members so far
        for m, offset in group:
            ins, occ = self.instructions[m], self.occ[m]
            candidates = self.resources.instances(ins, m in self.fixed)
            # chained members overlap in time (an epilogue and the softmax it feeds): each on a unit of its own
            free = [k for k in candidates if not any(u == ins.unit.name and j == k and lo < offset + occ.busy
                                                     and offset < hi for u, j, lo, hi in held)]
            best = min(free or candidates,
                       key=lambda k: self.resources.exclusive[(ins.unit.name, k)].earliest(t + offset, occ.busy))
            choice.append((offset, occ, _exclusive_keys(occ, best), m, best))
            held.append((ins.unit.name, best, offset, offset + occ.busy))
        return choice

    def place(self, group, pools, t) -> int:
        """Place ``group`` at the earliest feasible cycle >= t; returns the group's issue cycle. Instances are
        chosen again whenever the group has to move later: the instance free soonest at the first cycle tried
        may be the one that is busy at the cycle it lands on."""
        offsets = dict(group)
        pieces = None  # the shared resources' demand: the same whichever instances the members take
        while True:
            choice = self._instances(group, t)
            parts = [(o, oc, keys) for o, oc, keys, _, _ in choice]
            if pieces is None:
                pieces = {name: _pieces(parts, name) for name in _SHARED}
            fitted = self.resources.fit(t, parts, pieces)
            if fitted != t:
                t = fitted
                continue
            for _, _, _, m, best in choice:
                self.unit[m] = best  # (a weight buffer is one of its plane's)
            picks, later = [], t
            for kind, first, last, chain in pools:
                candidates, lo, hi = self._pool(kind, first, last, t, offsets)
                # a chain of chains (matmul ─► epilogue ─► softmax) holds two streams at once: not the same one
                held = {id(p[3]) for p in picks if p[5] < hi and lo < p[6]}
                candidates = [c for c in candidates if id(c[0]) not in held] or candidates
                cal, k = min(candidates, key=lambda c: c[0].earliest(t + lo, hi - lo))
                later = max(later, cal.earliest(t + lo, hi - lo) - lo)
                picks.append((kind, first, last, cal, k, lo, hi, chain))
            if later == t:
                break
            t = later
        self.resources.book(t, parts)
        for kind, first, last, cal, k, lo, hi, chain in picks:
            cal.book(t + lo, hi - lo)
            self.pooled[(kind, first, chain)] = k
            self.pooled[(kind, last, chain)] = k
        for offset, _, _, m, _ in choice:
            self.issue[m] = t + offset
        return t

    def finish(self) -> tuple:
        out = []
        for i, ins in enumerate(self.instructions):
            def remap(refs):
                return tuple(TensorRef(self.pooled[("stream", i, r.addr)], r.shape, r.dtype, r.strides, Space.STREAM)
                             if r.space == Space.STREAM else r for r in refs)
            attrs = ins.attrs
            if ins.opcode in (Opcode.INSTALL, Opcode.MATMUL):
                attrs = {**attrs, "buffer": self.pooled[("buffer", i, None)]}
            out.append(Instruction(ins.opcode, self.unit[i], self.issue[i], remap(ins.srcs), remap(ins.dsts), attrs,
                                   ins.layer))
        order = sorted(range(len(out)), key=lambda i: (out[i].cycle, i))
        makespan = max((self.issue[i] + self.occ[i].finish for i in range(len(out))), default=0)
        return [out[i] for i in order], makespan, order


def restamp(instructions: list, scheduled: list, order: list, keep_units=()) -> list:
    """Another rank's ``instructions`` (unscheduled, in program order) at the cycles, unit instances, streams
    and weight buffers :func:`schedule` gave the rank it is ``alike`` to (``scheduled`` and ``order``, as it
    returned them). Units in ``keep_units`` (a chip's C2C ports, which name its own links) stay its own."""
    out = []
    for template, i in zip(scheduled, order):
        mine = instructions[i]
        if mine.opcode != template.opcode:
            raise ValueError(f"restamp: instruction {i} is {mine.opcode.name} here and {template.opcode.name} "
                             "in the schedule it should share")
        attrs = dict(mine.attrs)
        if "buffer" in template.attrs:
            attrs["buffer"] = template.attrs["buffer"]

        def streams(refs, theirs):
            return tuple(t if r.space == Space.STREAM else r for r, t in zip(refs, theirs))
        unit = mine.unit_index if mine.unit.name in keep_units else template.unit_index
        out.append(Instruction(mine.opcode, unit, template.cycle, streams(mine.srcs, template.srcs),
                               streams(mine.dsts, template.dsts), attrs, mine.layer))
    return out
