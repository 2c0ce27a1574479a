"""The schedule check of :mod:`.check`, done for the whole program at once.

:func:`.check.check_timing` walks a program instruction by instruction, which
is the rules' plain statement and gives the exact first error, but costs tens
of microseconds of Python per instruction. A design sweep checks thousands of
programs that are all legal, so this module proves legality with array
operations instead:

- an instruction's occupancy and footprints depend only on its opcode, unit,
  attributes and operand shapes, and a program repeats a few hundred such
  kinds thousands of times (:mod:`.columns`): each kind is worked out once;
- exclusive units are free when consecutive holders of each one do not
  overlap; shared rates fit when the running sums, kept as prefix sums of starts
  minus ends, stay within the chip's limits;
- SRAM hazards are the pairs of accesses (one a write, from different
  instructions) where the later one starts while the earlier is still in
  flight and their footprints meet (:func:`.hazards.meet_pairs`, the same rules
  as :func:`.hazards.meets`);
- nothing is read unwritten: a map of the bytes written so far, painted in issue order, kept also by blocks
  flagged once wholly written, so that an access within flagged blocks needs no look at its bytes.

Everything the walk checks is checked here, by the same rules or more strictly
(never less). :func:`proven_timeline` returns ``None`` on anything it cannot
prove, and the caller then walks the program, which names the first broken
rule (or, where this was only stricter, accepts it).
"""

from __future__ import annotations

import numpy as np

from .check import (_CAPACITY, _RATES, ScheduleError, Timeline, _limits, _Resident, _Streams,
                    check_timing)
from .columns import _END, _IN_SRAM, _ROWS, _RUN, _STRIDE, _WRITE, ProgramColumns, ragged_steps
from .hazards import block_of, meet_pairs
from .isa import Opcode
from .timing import paced, stream_links

_BLOCK = 1 << 15  # grains a block of the read-before-write map (128 KiB of fp32); 16K-64K measured best on ResNet-50


def proven_timeline(columns: ProgramColumns, constants=(), sram_size: int | None = None,
                    protected=()) -> Timeline | None:
    """The measured timeline if the whole-program checks prove every rule holds, else ``None``.

    Parameters
    ----------
    columns : ProgramColumns
        The program, with its chip.
    constants, sram_size, protected
        As :func:`.check.check_timing`'s.

    Returns
    -------
    Timeline or None
        ``None`` means: walk the program (:func:`.check.check_timing`) to find what is wrong.
    """
    program, chip = columns.program, columns.chip
    instructions = program.instructions
    if not instructions:  # (validation bounds each instruction's cycles: int64 sums cannot overflow)
        return None
    chained, walk, occupancies, busy = paced_chains(columns)
    try:
        _follow_chains(columns, walk, occupancies)
    except ScheduleError:
        return None
    finish = busy + columns.latency
    makespan = int((columns.cycle + finish).max())
    if makespan != program.predicted_cycles:
        return None
    if not (_buffers_ready(columns, busy, finish) and _units_free(columns, busy)
            and _rates_fit(columns, occupancies, chained, busy)
            and _sram_safe(columns, busy, finish, constants, protected, int(sram_size or chip.sram_bytes))):
        return None
    return Timeline(tuple(occupancies), tuple(columns.order.tolist()), makespan, busy)


def paced_chains(columns) -> tuple:
    """``(chained, walk, occupancies, busy)``: the instructions with an operand on a stream, the same in issue
    order, every instruction's occupancy with each chain's members stretched to its pace
    (:func:`.timing.paced`), and their busy cycles (a stretched member keeps its latency). Chained instructions
    are few: they are walked one by one."""
    chained = np.unique(columns.owner[columns.operand[:, _IN_SRAM] == 0])
    walk = chained[np.argsort(columns.position[chained])].tolist()
    occupancies = paced(list(columns.occupancies), stream_links(columns.program.instructions, walk), columns.chip)
    busy = columns.busy.copy()
    busy[chained] = [occupancies[i].busy for i in chained.tolist()]
    return chained, walk, occupancies, busy


def _follow_chains(columns, walk, occupancies) -> None:
    """Check the chained producers and consumers, in issue order (``walk``)."""
    instructions, streams = columns.program.instructions, _Streams()
    for index in walk:
        ins = instructions[index]
        streams.consumed_by(index, ins, ins.cycle)
        streams.passed_on(index, ins, ins.cycle, occupancies[index])


def _buffers_ready(columns, busy, finish) -> bool:
    """Each plane's weight buffers: a MATMUL reads a tile installed, finished and of its shape; a tile is not
    replaced while a MATMUL still reads it (:class:`.check._Buffers`' rules, buffer by buffer in issue order)."""
    kinds = columns.kind_instructions
    installs = np.array([k.opcode == Opcode.INSTALL for k in kinds])
    matmuls = np.array([k.opcode == Opcode.MATMUL for k in kinds])
    order = columns.order
    kind = columns.kind[order]
    chosen = order[installs[kind] | matmuls[kind]]
    if not len(chosen):
        return True
    kind = columns.kind[chosen]
    classes = sorted({k.srcs[0].dtype.matrix_class for k in kinds if k.opcode in (Opcode.INSTALL, Opcode.MATMUL)})

    def tile(k):  # (plane, buffer, k, n, matrix class): what is installed, or what a MATMUL needs
        if k.opcode == Opcode.INSTALL:
            rows, cols = k.srcs[0].shape
        elif k.opcode == Opcode.MATMUL:
            rows, cols = k.srcs[0].shape[-1], k.dsts[0].shape[-1]
        else:
            return (0,) * 5
        return k.unit_index, k.attrs["buffer"], rows, cols, classes.index(k.srcs[0].dtype.matrix_class)
    tiles = np.array([tile(k) for k in kinds], np.int64)[kind]
    by_buffer = np.lexsort((np.arange(len(chosen)), tiles[:, 1], tiles[:, 0]))  # stable: issue order kept
    chosen, kind, tiles = chosen[by_buffer], kind[by_buffer], tiles[by_buffer]
    n = len(chosen)
    is_install = installs[kind]
    start = np.ones(n, bool)
    start[1:] = (tiles[1:, :2] != tiles[:-1, :2]).any(axis=1)
    group_start = np.maximum.accumulate(np.where(start, np.arange(n), 0))
    # the latest INSTALL at or before each entry of its buffer (group_start - 1 where there is none yet)
    latest = np.maximum.accumulate(np.where(is_install, np.arange(n), group_start - 1))
    use = ~is_install
    tile_of = np.maximum(latest, 0)
    issue = columns.cycle[chosen]
    if (use & (latest < group_start)).any():
        return False  # empty weight buffer
    if (use & (issue[tile_of] + finish[chosen[tile_of]] > issue)).any():
        return False  # install not finished
    if (use & (tiles[:, 2:] != tiles[tile_of, 2:]).any(axis=1)).any():
        return False  # weight shape
    reads_end = np.zeros(n, np.int64)
    np.maximum.at(reads_end, tile_of[use], (issue + busy[chosen])[use])
    replaced = is_install & ~start  # an INSTALL over a buffer that held a tile: the one before it
    previous = latest[np.maximum(np.arange(n) - 1, 0)]
    return not (replaced & (previous >= group_start) & (reads_end[np.maximum(previous, 0)] > issue)).any()


def _units_free(columns, busy) -> bool:
    """Each unit instance's holders, in issue order, each start once the one before has ended."""
    resource_id = {}
    held = [[resource_id.setdefault(r, len(resource_id)) for r in occ.exclusive] for occ in columns.kind_occupancy]
    owner, item = columns.spread([len(h) for h in held])
    resource = np.array([r for h in held for r in h], np.int64)[item]
    by_unit = np.lexsort((columns.position[owner], resource))
    resource, owner = resource[by_unit], owner[by_unit]
    start = columns.cycle[owner]
    end = start + busy[owner]
    same = resource[1:] == resource[:-1]
    return not (same & (start[1:] < end[:-1])).any()


def _rates_fit(columns, occupancies, chained, busy) -> bool:
    """At each issue, what still runs (started earlier in issue order, not yet ended) plus the newcomer fits.

    What runs at instruction ``i``'s issue is every earlier start minus every end by then; an instruction
    busy for no cycles ends as it starts and is counted for no one but itself.
    """
    limits = _limits(columns.chip)
    rates = np.array([_RATES(o) for o in columns.kind_occupancy], np.int64)[columns.kind]
    for index in chained.tolist():  # a chain's stretched members' rates are spread over their longer time
        rates[index] = _RATES(occupancies[index])
    order = columns.order
    issue = columns.cycle[order]
    lasting = (busy > 0)[order]
    rates, busy = rates[order], busy[order]
    end = issue + busy
    by_end = np.argsort(end, kind="stable")
    ends_sorted = end[by_end]
    ended_before = np.searchsorted(ends_sorted, issue, side="right")  # ends at or before each issue
    for k, (key, _) in enumerate(_CAPACITY):
        rate = rates[:, k]
        if not rate.any():
            continue
        counted = np.where(lasting, rate, 0)
        started = np.cumsum(counted) - counted  # strictly earlier in issue order
        ended = np.concatenate(([0], np.cumsum(counted[by_end])))[ended_before]
        total = started - ended + rate
        if ((rate > 0) & (total > limits[key])).any():
            return False
    return True


def _sram_safe(columns, busy, finish, constants, protected, sram_size) -> bool:
    """No hazard between accesses in flight together, nothing read unwritten, no resident byte written."""
    op, addr, index = columns.operand, columns.addr, columns.owner
    in_sram = np.flatnonzero(op[:, _IN_SRAM])
    if not len(in_sram):
        return True
    in_sram = in_sram[np.argsort(columns.position[index[in_sram]], kind="stable")]  # issue order
    op, addr, index = op[in_sram], addr[in_sram], index[in_sram]
    write = op[:, _WRITE].astype(bool)
    keys = np.stack([addr, addr + op[:, _END], op[:, _STRIDE], addr, op[:, _ROWS], op[:, _RUN]])
    if keys[1].max() > sram_size:
        return False  # an access past the walk's byte map is the walk's to judge (the simulator sizes it to all)
    pos = columns.position[index]
    start = columns.cycle[index]
    end = start + np.where(write, finish[index], busy[index])
    w, r = np.flatnonzero(write), np.flatnonzero(~write)
    windows = (  # (earlier access, first and last + 1 of the later ones that start while it is in flight)
        (w, np.arange(len(write)), w + 1, np.searchsorted(start, end[w], side="left")),  # any, while a write is
        (r, w, np.searchsorted(pos[w], pos[r], side="right"), np.searchsorted(start[w], end[r], side="left")))
    for owner, among, lo, hi in windows:  # (writes while a read is)
        for early, late in _windows(owner, lo, hi):
            late = among[late]
            near = (pos[early] != pos[late]) & (keys[0, early] < keys[1, late]) & (keys[1, early] > keys[0, late])
            if meet_pairs(keys[:, early[near]], keys[:, late[near]]).any():  # (few bounding ranges meet)
                return False
    resident = _Resident(constants, protected)
    return not resident.overwritten_by_any(keys[:, write]) and _reads_written(keys, write, resident)


def _windows(owner, lo, hi, most: int = 1 << 21):
    """Every ``(owner[k], j)`` with ``lo[k] <= j < hi[k]``, as pairs of arrays of at most about ``most``
    (an access that lasts long, a big weight streaming in, can be in flight with thousands)."""
    counts = np.maximum(hi - lo, 0)
    bounds = np.searchsorted(np.cumsum(counts), np.arange(most, int(counts.sum()), most), side="left") + 1
    for part in np.split(np.arange(len(owner)), bounds):
        n = counts[part]
        yield np.repeat(owner[part], n), np.repeat(lo[part], n) + ragged_steps(n)


def _reads_written(keys, write, resident) -> bool:
    """Each read lies in one constant or in bytes written earlier in issue order (accesses come in that order).

    Bytes once written stay written, so of the accesses to one footprint only the first (in issue order, a
    read before its own instruction's write) needs the byte map: after it, the footprint is known written.
    """
    pending = np.flatnonzero(write | ~resident.hold(keys[3], keys[1]))
    grouped = pending[np.lexsort((np.arange(len(pending)),) + tuple(keys[:, pending][::-1]))]
    first = np.ones(len(grouped), bool)
    first[1:] = (keys[:, grouped[1:]] != keys[:, grouped[:-1]]).any(axis=0)
    pending = np.sort(grouped[first])
    # every footprint edge is a multiple of the accesses' common divisor (an element size at least): the map
    # keeps one flag per such grain, from the lowest byte these accesses touch to the highest (the weights
    # below the activations, most of SRAM, need none: its pages are zeroed on first touch, at a cost)
    if not len(pending):
        return True
    scaled = keys[:, pending]
    grain = int(np.gcd.reduce(scaled[[0, 1, 2, 5]].ravel())) or 1
    base = int(scaled[0].min())
    scaled = (scaled - base) // grain
    scaled[[2, 5]] = keys[[2, 5]][:, pending] // grain  # a stride and a run are not addresses
    scaled[4] = keys[4, pending]
    # activation memory is reused: most accesses (ResNet-50 fp32: 85%) fall where every byte was written long
    # before, so the map is also kept by blocks, each flagged once wholly written; an access within flagged
    # blocks needs no look at its bytes (a read passes, a write changes nothing)
    size = int(scaled[1].max())
    blocks = -(-size // _BLOCK)
    written = np.zeros(blocks * _BLOCK, np.bool_)
    written[size:] = True  # (beyond every access)
    by_block = written.reshape(blocks, _BLOCK)
    full = bytearray(blocks)  # (bytearray.find: the flagged test costs no numpy call)
    full_flags = np.frombuffer(full, np.bool_)
    first_block, past_block = (scaled[0] // _BLOCK).tolist(), ((scaled[1] - 1) // _BLOCK + 1).tolist()
    all_of = np.logical_and.reduce
    for stride, addr, rows, run, is_write, lo, hi in zip(*scaled[2:].tolist(), write[pending].tolist(),
                                                           first_block, past_block):
        if full.find(0, lo, hi) < 0:
            continue
        view = block_of(written, addr, rows, run, stride)
        if is_write:
            view[...] = True
            full_flags[lo:hi] = all_of(by_block[lo:hi], axis=1)
        elif not all_of(view, axis=None):
            return False
    return True


def checked_timeline(columns: ProgramColumns, constants=(), sram_size: int | None = None,
                     protected=()) -> Timeline:
    """The program's measured timeline, every rule checked: proven whole when it can be, else walked
    instruction by instruction, which raises :class:`.check.ScheduleError` naming the first broken rule."""
    timeline = proven_timeline(columns, constants, sram_size, protected)
    if timeline is None:
        timeline = check_timing(columns.program, columns.chip, constants, sram_size, protected)
    return timeline
