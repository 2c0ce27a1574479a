"""The simulator's fast path: the tiles of one product run as one call.

The schedule splits a product into tiles the size of a matrix plane; the
numbers do not need the split. Where several MATMULs of one layer multiply the
same installed tile by row blocks of one operand that follow each other in
memory, and nothing between them touches what they read or write, they run as
one larger numpy product, and each member's block is accumulated and stored as
its own instruction would have done; the bands of one convolution's IM2COL run
as one. An installed tile nothing overwrites (the common case) is read where it
lies in SRAM, not copied.

Every result comes from the instruction stream, its addresses and its
accumulation order: integer products are exact, so an int8 program's results
are bit-equal to the tile-by-tile reference (:meth:`Simulator.run` with
``reference=True``); a float product may differ only in the order a BLAS kernel
adds within one dot product.

Moving an instruction is legal when no instruction it passes reads what it
writes or writes what it reads or writes (:func:`.hazards.meets` on the SRAM
footprints; a stream, a weight buffer and a host output are regions of their
own). The members of a group move to the place of its last member, or else of
its first.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from .hazards import footprint_key, meets, range_key
from .isa import Opcode
from .semantics import F32, _f32, _store, exact_in_fp32

# regions of their own, below SRAM's addresses: stream n, weight buffer (unit, buffer), host output n
_SPAN = 1 << 40
_STREAMS, _BUFFERS, _OUTPUTS = -(1 << 62), -(1 << 61), -(1 << 60)
_MAX_SPAN = 4096  # a group whose members lie further apart in issue order is not tried (checking costs time)


def _region(base: int, index: int, lo: int = 0, hi: int = _SPAN) -> tuple:
    return range_key(base + index * _SPAN + lo, base + index * _SPAN + hi)


def _key(ref) -> tuple:
    return footprint_key(ref) if ref.in_sram else _region(_STREAMS, ref.addr)


class _Node:
    __slots__ = ("entry", "reads", "writes", "position")

    def __init__(self, entry, reads, writes, position):
        self.entry, self.reads, self.writes, self.position = entry, reads, writes, position


def _conflict(x: _Node, y: _Node) -> bool:
    for w in x.writes:
        if any(meets(w, r) for r in y.reads) or any(meets(w, v) for v in y.writes):
            return True
    return any(meets(r, w) for r in x.reads for w in y.writes)


def fast_entries(sim) -> list:
    """The simulator's bound instructions with the tiles of each product merged where that is legal.

    Returns
    -------
    list of tuple
        ``(function, opcode, outs, ins, attrs, position)``: what :meth:`Simulator.run` calls, in order;
        ``position`` is the issue position an entry runs at (a merged one's: that of the member the others
        moved to).
    """
    program, order = sim.program, sim.order
    instructions = program.instructions
    installer = {}  # (unit, buffer) -> (instruction index, its bound source) of the last INSTALL into it
    slots, matmuls = [], []
    for pos, index in enumerate(order):
        ins = instructions[index]
        fn, op, outs, srcs, attrs = sim.bound(pos)
        reads = [_key(r) for r in ins.srcs]
        writes = [_key(r) for r in ins.dsts]
        if op == Opcode.INSTALL:
            unit = (ins.unit_index, attrs["buffer"])
            installer[unit] = (index, srcs[0])
            if index in sim._stable_installs:  # its MATMULs read the tile where it lies: nothing to do here
                slots.append(None)
                continue
            writes = [_region(_BUFFERS, ins.unit_index * 256 + attrs["buffer"])]
        elif op == Opcode.MATMUL:
            unit = (ins.unit_index, attrs["buffer"])
            source_index, source = installer[unit]
            if source_index in sim._stable_installs:
                tile_ref = instructions[source_index].srcs[0]
                tile_key = footprint_key(tile_ref)
                tile = (tile_key, tile_ref.shape, tile_ref.strides, tile_ref.dtype)  # the same tile: the same bytes
                srcs = [srcs[0], source, *srcs[2:]]
                fn = _matmul_tile
            else:
                tile_key = _region(_BUFFERS, ins.unit_index * 256 + attrs["buffer"])
                tile = source_index  # the same INSTALL's copy, in one unit's buffer
            reads.append(tile_key)
            matmuls.append((pos, ins, tile))
        elif op == Opcode.STORE:
            writes = [_region(_OUTPUTS, attrs["index"], attrs["offset"], attrs["offset"] + ins.srcs[0].nbytes)]
        slots.append(_Node((fn, op, outs, srcs, attrs, pos), reads, writes, pos))
    for build, members in _candidate_groups(matmuls) + _band_runs(slots, instructions, order):
        _merge(slots, members, build)
    return [node.entry for node in slots if node is not None]


def _candidate_groups(matmuls) -> list:
    """Runs of MATMULs one call could compute: row blocks of one operand, following each other in memory,
    against one tile; each run as issue positions, largest first."""
    rows = defaultdict(list)
    for pos, ins, tile in matmuls:
        a, out = ins.srcs[0], ins.dsts[0]
        common = (ins.layer, a.dtype, out.dtype, len(ins.srcs), ins.attrs["zp_a"], ins.attrs["zp_b"])
        if a.in_sram:
            rows[common + (tile, _strides(a), a.shape[1])].append((a.addr, a.shape[0], pos))
    groups = []
    for key, members in rows.items():
        item, (s0, _) = key[1].itemsize, key[-2]
        groups += _address_runs([(addr, addr + n * s0 * item, pos) for addr, n, pos in members])
    return [(_row_group, g) for g in sorted(groups, key=len, reverse=True)]


def _band_runs(slots, instructions, order) -> list:
    """Runs of IM2COLs of one convolution whose column blocks follow each other: its bands."""
    bands = defaultdict(list)
    for node in slots:
        if node is None or node.entry[1] != Opcode.IM2COL:
            continue
        ins = instructions[order[node.position]]
        src, dst, attrs = ins.srcs[0], ins.dsts[0], ins.attrs
        key = (ins.layer, src.dtype, src.shape[:2], src.shape[3], src.strides, dst.shape[:3], dst.strides,
               *(tuple(attrs[k]) for k in ("kernel", "stride", "dilation")), attrs["groups"], attrs["pad_value"],
               attrs["pad"][1], attrs["pad"][3])
        step = (dst.strides[3] if dst.strides else 1) * dst.dtype.itemsize
        bands[key].append((dst.addr, dst.addr + dst.shape[3] * step, node.position))
    return [(_band_group, run) for blocks in bands.values() for run in _address_runs(blocks)]


def _strides(ref) -> tuple:
    if ref.strides is not None:
        return tuple(ref.strides)
    return (ref.shape[1], 1)


def _address_runs(blocks) -> list:
    """Split ``(start, next start, position)`` blocks into runs where each block starts where the last ends."""
    by_start = defaultdict(list)
    for block in blocks:
        by_start[block[0]].append(block)
    runs, used = [], set()
    for block in sorted(blocks):
        if block[2] in used:
            continue
        run = [block]
        used.add(block[2])
        while True:
            following = [b for b in by_start.get(run[-1][1], ()) if b[2] not in used]
            if not following:
                break
            nearest = min(following, key=lambda b: abs(b[2] - run[-1][2]))
            run.append(nearest)
            used.add(nearest[2])
        if len(run) > 1:
            runs.append([pos for _, _, pos in run])
    return runs


def _merge(slots, positions, build) -> None:
    """Merge the instructions at ``positions`` (address order) into one node where that is legal and ``build``
    makes them one call; else try each half."""
    if len(positions) < 2:
        return
    nodes = [slots[p] for p in positions]
    fn = build([n.entry for n in nodes]) if all(n is not None for n in nodes) and _legal(slots, positions) \
        else None
    if fn is not None:
        target = max(positions) if _movable(slots, positions, max(positions)) else min(positions)
        merged = _Node((fn, nodes[0].entry[1], [], [], {}, target),
                       [k for n in nodes for k in n.reads], [k for n in nodes for k in n.writes], target)
        for p in positions:
            slots[p] = None
        slots[target] = merged
        return
    half = len(positions) // 2
    _merge(slots, positions[:half], build)
    _merge(slots, positions[half:], build)


def _legal(slots, positions) -> bool:
    if max(positions) - min(positions) > _MAX_SPAN:
        return False
    nodes = [slots[p] for p in positions]
    for i, x in enumerate(nodes):
        if any(_conflict(x, y) or _conflict(y, x) for y in nodes[i + 1:]):
            return False
    return _movable(slots, positions, max(positions)) or _movable(slots, positions, min(positions))


def _movable(slots, positions, target: int) -> bool:
    """Whether every member can move to ``target`` past the instructions between."""
    members = set(positions)
    for p in positions:
        node = slots[p]
        lo, hi = (p, target) if p < target else (target, p)
        for s in range(lo + 1, hi):
            other = slots[s]
            if other is not None and s not in members and (_conflict(node, other) or _conflict(other, node)):
                return False
    return True


def _product(a, tile, attrs, int_out: bool) -> np.ndarray:
    """``(a - zp_a) @ (tile - zp_b)`` as :func:`.semantics._matmul` computes it, before accumulating."""
    if int_out:
        wide = F32 if exact_in_fp32(a.dtype, attrs["zp_a"], tile.dtype, attrs["zp_b"], a.shape[-1]) else np.float64
        shifted, weights = a.astype(wide), tile.astype(wide)
        if attrs["zp_a"]:
            shifted -= wide(attrs["zp_a"])
        if attrs["zp_b"]:
            weights -= wide(attrs["zp_b"])
        return np.matmul(shifted, weights)
    return np.matmul(_f32(a), _f32(tile))


def _finish(out, part, acc) -> None:
    """Accumulate and store one member's block as its MATMUL does."""
    if acc is not None:
        part += acc  # in place, in the product's type, as the reference adds it (then rounds once more)
    if out.dtype == np.int32:
        np.copyto(out, part, casting="unsafe")
    else:
        _store(out, part)


def _matmul_tile(outs, ins, attrs):
    """A MATMUL whose tile is read where it was installed from (nothing overwrote it since)."""
    out = outs[0]
    _finish(out, _product(ins[0], ins[1], attrs, out.dtype == np.int32), ins[2] if len(ins) == 3 else None)


def _root(array: np.ndarray):
    """The object that owns an array's memory (an SRAM image, or a program's encoded bytes)."""
    while True:
        if getattr(array, "base", None) is not None:  # an array's, or as_strided's holder's
            array = array.base
        elif isinstance(array, memoryview):
            array = array.obj
        else:
            return array


def _stacked(blocks, axis: int = 0):
    """The blocks, which follow each other along ``axis``, as one view, and where each starts; None where they
    are not blocks of one array."""
    first = blocks[0]
    bounds = np.cumsum([0] + [b.shape[axis] for b in blocks]).tolist()
    root = _root(first)
    for block, start in zip(blocks, bounds):
        if (block.strides != first.strides or _root(block) is not root
                or block.shape[:axis] + block.shape[axis + 1:] != first.shape[:axis] + first.shape[axis + 1:]
                or block.ctypes.data != first.ctypes.data + start * first.strides[axis]):
            return None, bounds
    shape = first.shape[:axis] + (bounds[-1],) + first.shape[axis + 1:]
    return np.lib.stride_tricks.as_strided(first, shape, first.strides), bounds


def _band_group(entries):
    """One IM2COL for the bands of one convolution: the input rows they read, padded only where the whole
    input is, give the columns they write side by side. None where the bands are not that."""
    attrs = [e[4] for e in entries]
    (kh, _), (sh, _), (dh, _) = attrs[0]["kernel"], attrs[0]["stride"], attrs[0]["dilation"]
    top, left, _, right = attrs[0]["pad"]
    bottom = attrs[-1]["pad"][2]
    if any(a["pad"][0] for a in attrs[1:]) or any(a["pad"][2] for a in attrs[:-1]):
        return None  # a band padded inside the input: its padding is not the whole input's
    sources = [e[3][0] for e in entries]
    first = sources[0]
    row_bytes = first.strides[2]
    offsets = [(s.ctypes.data - first.ctypes.data) / row_bytes for s in sources]
    if (any(s.strides != first.strides or s.shape[:2] + s.shape[3:] != first.shape[:2] + first.shape[3:]
            or _root(s) is not _root(first) for s in sources) or any(o != int(o) or o < 0 for o in offsets)):
        return None
    columns, starts = _stacked([e[2][0] for e in entries], axis=3)
    width = (first.shape[3] + left + right - (attrs[0]["kernel"][1] - 1) * attrs[0]["dilation"][1] - 1) \
        // attrs[0]["stride"][1] + 1
    if columns is None or any(start % width for start in starts):
        return None
    # band k's first output row must read the input row the whole convolution's would
    if any((start // width) * sh - top != int(o) - a["pad"][0] for start, o, a in zip(starts, offsets, attrs)):
        return None
    height = int(offsets[-1]) + sources[-1].shape[2]
    if (height + top + bottom - (kh - 1) * dh - 1) // sh + 1 != starts[-1] // width:
        return None
    rows = np.lib.stride_tricks.as_strided(first, first.shape[:2] + (height, first.shape[3]), first.strides)
    merged = dict(attrs[0], pad=(top, left, bottom, right))
    im2col = entries[0][0]
    return lambda _outs, _ins, _attrs: im2col([columns], [rows], merged)


def _row_group(entries):
    """One call for MATMULs that multiply consecutive row blocks of one operand by one tile; None where the
    blocks are not rows of one array (they lie in two weights' bytes)."""
    stacked, bounds = _stacked([e[3][0] for e in entries])
    if stacked is None:
        return None
    tile_of = entries[0][3][1]
    outs = [e[2][0] for e in entries]
    accs = [e[3][2] if len(e[3]) == 3 else None for e in entries]
    attrs = entries[0][4]
    int_out = outs[0].dtype == np.int32
    installed = not isinstance(tile_of, np.ndarray)  # a weight buffer: its tile as the last INSTALL left it

    def run(_outs, _ins, _attrs):
        tile = tile_of.value if installed else tile_of
        product = _product(stacked, tile, attrs, int_out)
        for k, out in enumerate(outs):
            _finish(out, product[bounds[k]:bounds[k + 1]], accs[k])
    return run
