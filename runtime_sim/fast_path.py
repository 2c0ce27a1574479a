"""The simulator's fast path: what the schedule splits and the numbers do not need split, run as one call.

The schedule splits a product into tiles the size of a matrix plane and
elementwise work into bands; the numbers need neither split. Built once at
load, over the bound instruction stream:

- the K-chunks of a product that add into one partial sum in SRAM join into
  one product (operand blocks side by side, tiles stacked), the last chunk,
  which streams to the epilogue, apart;
- a result that streams to exactly one consumer joins that consumer (a
  stream's contents are dead once read);
- entries that compute the same steps on blocks of one array, along one axis,
  run as one call of the same semantics functions on stacked views: a
  product's row blocks against one installed tile (or one operand against its
  tiles' column blocks), the bands of an elementwise chain; around a product,
  blocks that lie apart are gathered and its result scattered;
- the bands of one convolution's IM2COL run as one;
- an installed tile nothing overwrites (the common case) is read where it lies
  in SRAM, not copied.

Every result comes from the instruction stream: its addresses and its tiles.
Integer products are exact (a joined integer product stays within the K that
fp32 sums exactly), so an int8 program's results are bit-equal to the
tile-by-tile reference (:meth:`Simulator.run` with ``reference=True``); a
float product may differ only in the order its terms are added.

Moving an entry is legal when no entry it passes reads what it writes or
writes what it reads or writes (:func:`.hazards.meets` on the SRAM footprints;
a stream, a weight buffer and a host output are regions of their own). The
members of a group move to the place of its last member, or else of its first.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from .fusion import fused
from .hazards import footprint_key, meets, overlaps, range_key
from .isa import BINARY_OPS, UNARY_OPS, Opcode
from .program import aligned_array
from .semantics import exact_in_fp32, to_f32, widen_half

# regions of their own, below SRAM's addresses: stream n, weight buffer (unit, buffer), host output n
_SPAN = 1 << 40
_STREAMS, _BUFFERS, _OUTPUTS = -(1 << 62), -(1 << 61), -(1 << 60)
_MAX_SPAN = 4096  # a group whose members lie further apart in issue order is not tried (checking costs time)


def _region(base: int, index: int, lo: int = 0, hi: int = _SPAN) -> tuple:
    return range_key(base + index * _SPAN + lo, base + index * _SPAN + hi)


def _key(ref) -> tuple:
    return footprint_key(ref) if ref.in_sram else _region(_STREAMS, ref.addr)


def _buffer_key(ins) -> tuple:
    """The weight buffer an INSTALL fills and a MATMUL reads."""
    return _region(_BUFFERS, ins.unit_index * 256 + ins.attrs["buffer"])


class _Accesses:
    """What an entry reads and writes: footprint keys (:func:`_key`)."""

    __slots__ = ("reads", "writes")

    def __init__(self, reads, writes):
        self.reads, self.writes = reads, writes


class _Node:
    """One entry of the fast path: a run of steps ``(function, opcode, outs, ins, attrs)``, each after the
    first reading the one before it through a stream (``chained[k]``: which of step k's inputs)."""

    __slots__ = ("steps", "chained", "reads", "writes", "position", "merged")

    def __init__(self, steps, chained, reads, writes, position, merged=False):
        self.steps, self.chained, self.reads, self.writes, self.position = steps, chained, reads, writes, position
        self.merged = merged  # several entries' one call: not merged again

    @property
    def entry(self) -> tuple:
        steps = fused(_into_destination(self.steps, self.chained), self.chained)
        if len(steps) == 1:
            return (*steps[0], self.position)

        def run(_outs, _ins, _attrs):
            for fn, _, outs, ins, attrs in steps:
                fn(outs, ins, attrs)
        run.opcodes = tuple(step[1] for step in steps)  # what one call runs, for whoever counts calls
        return (run, steps[-1][1], [], [], {}, self.position)


# elementwise steps: they may read their chained input where they write their result
_IN_PLACE = {*UNARY_OPS, *BINARY_OPS, Opcode.EPILOGUE}


def _into_destination(steps, chained) -> list:
    """``steps`` (``(function, opcode, outs, ins, attrs)``) with each result that only the next step reads
    computed where that step writes, where the next step is elementwise and works in place: a float product
    where its EPILOGUE stores it, an elementwise chain in its last step's destination; no pass that copies a
    result, or transposes it into an output laid out channels first. The steps run as one call and the last
    writes every byte of the destination, so nothing sees those bytes between them; none of the later steps'
    other inputs may lie in it (they would be read after it is written), nor a product's or EPILOGUE's own."""
    steps = list(steps)
    for j in reversed(range(len(steps) - 1)):
        fn, op, outs, ins, attrs = steps[j]
        next_fn, next_op, next_outs, next_ins, next_attrs = steps[j + 1]
        dest, reading = next_outs[0], chained[j + 1]
        if next_op not in _IN_PLACE or reading is None or outs[0].dtype != dest.dtype or outs[0].shape != dest.shape:
            continue
        # a unary or binary step may write over its own inputs: it is one elementwise pass, or computes its
        # result whole before storing it (an EPILOGUE's scale is read after its sum is written)
        first = j + 1 if op in UNARY_OPS or op in BINARY_OPS else j
        others = [getattr(x, "value", x) for k in range(first, len(steps)) for i, x in enumerate(steps[k][3])
                  if i != chained[k]]
        if any(isinstance(x, np.ndarray) and np.may_share_memory(dest, x) for x in others):
            continue
        steps[j] = (fn, op, [dest], ins, attrs)
        steps[j + 1] = (next_fn, next_op, next_outs, [dest if i == reading else x for i, x in enumerate(next_ins)],
                        next_attrs)
    return steps


def _clash(x, y) -> bool:
    """Whether ``x`` and ``y`` (nodes or their accesses) cannot pass each other: one writes what the other
    reads or writes. Plain loops: the fast path's build asks this some hundred thousand times."""
    for w in x.writes:
        for k in y.reads:
            if meets(w, k):
                return True
        for k in y.writes:
            if meets(w, k):
                return True
    for r in x.reads:
        for k in y.writes:
            if meets(r, k):
                return True
    return False


class _LiveTile:
    """An installed tile read where it lies in SRAM (its INSTALL is stable): what a weight buffer answers,
    converted at each call, since the SRAM it views may change between calls."""

    __slots__ = ("value",)
    keeps_conversions = False  # converted at each call: a product of few rows reads it as it lies

    def __init__(self, view):
        self.value = view

    def converted(self, dtype, zero_point: int = 0):
        if self.value.dtype == dtype and not zero_point:
            return self.value
        if np.dtype(dtype) == np.float32:
            # widened whole for a product of many rows: the 2**112 its bits are multiplied by makes every fp16
            # subnormal a normal float, so this pass is the only one that meets a subnormal (an 8192 x 2048
            # tile, 2.5% subnormal: 37 ms, against 42 ms from normal floats after 71 ms working out ``lows``)
            tile = widen_half(self.value) if self.value.dtype == np.float16 else to_f32(self.value)
        else:
            tile = self.value.astype(dtype)
        return tile - dtype(zero_point) if zero_point else tile


# what may be computed on stacked operands: elementwise ops along any axis, a product along its rows
_ELEMENTWISE = {*UNARY_OPS, *BINARY_OPS, Opcode.EPILOGUE, Opcode.QADD, Opcode.QUANTIZE, Opcode.DEQUANTIZE}
_STACKABLE = _ELEMENTWISE | {Opcode.MATMUL}


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
    slots, tiles = [], {}
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
            writes = [_buffer_key(ins)]
        elif op == Opcode.MATMUL:
            source_index, source = installer[(ins.unit_index, attrs["buffer"])]
            if source_index in sim._stable_installs:
                reads.append(footprint_key(instructions[source_index].srcs[0]))
                srcs = [srcs[0], _tile_of(tiles, source), *srcs[2:]]
            else:
                reads.append(_buffer_key(ins))
        elif op == Opcode.STORE:
            writes = [_region(_OUTPUTS, attrs["index"], attrs["offset"], attrs["offset"] + ins.srcs[0].nbytes)]
        slots.append(_Node([(fn, op, outs, srcs, attrs)], [None], reads, writes, pos))
    _accumulations(slots, instructions, order, tiles)
    scratch = _Scratch()
    _chain(slots, instructions, order, scratch)
    for build, members in _stack_runs(slots, instructions, order, scratch) + _band_runs(slots, instructions, order):
        _merge(slots, members, build)
    return [node.entry for node in slots if node is not None]


def _tile_of(tiles: dict, view: np.ndarray) -> _LiveTile:
    """One live tile for every INSTALL, or joined product, over the same bytes (the same tile, on whichever
    plane), so that the products reading it are found by it and their row blocks stack on it."""
    key = (view.ctypes.data, view.shape, view.strides, view.dtype.str)
    if key not in tiles:
        tiles[key] = _LiveTile(view)
    return tiles[key]


def _accumulations(slots, instructions, order, tiles: dict) -> None:
    """Join the K-chunks of a product that accumulate in place into one partial sum in SRAM: one MATMUL of
    their operand blocks side by side (along K) by their tiles stacked (a weight's chunks lie one after the
    other), where it can move down to the next chunk; the values the partial sum passes through on the way
    are not made. The last chunk, which streams the total on, joins too where the partial sum is dead after
    it. An integer product stays within the K that fp32 sums exactly, so it stays bit-equal (and at fp32's
    speed)."""
    last_writer = {}  # a partial sum's view (address, shape, strides) -> the position of its last MATMUL
    later = None  # every instruction's SRAM accesses, gathered the first time a last chunk asks
    for pos, node in enumerate(slots):
        if node is None or len(node.steps) != 1 or node.steps[0][1] != Opcode.MATMUL:
            continue
        out, ins = node.steps[0][2][0], node.steps[0][3]
        adds_to = (ins[2].ctypes.data, ins[2].shape, ins[2].strides) if len(ins) == 3 else None
        # the last chunk adds the partial sum and streams the total on: it joins the run where nothing reads
        # the partial sum's bytes again (then no one sees that it was never written)
        streams = not instructions[order[pos]].dsts[0].in_sram
        if streams:
            previous = last_writer.get(adds_to)
        else:
            key = (out.ctypes.data, out.shape, out.strides)
            previous = last_writer.get(key) if adds_to == key else None
            last_writer[key] = pos
        if previous is None or slots[previous] is None:
            continue
        first = slots[previous]
        joined = _joined_chunks(first, node, tiles)
        if joined is None:
            continue
        if streams:
            later = later or _LaterAccesses(instructions, order)
            if not later.dead_after(pos, first.writes[0]):
                continue
        if not _movable(slots, [previous], pos):
            continue
        # reads: the operand, the sums the chunks add to (the partial sum, and whatever the first chunk added
        # to), the tile; the operand's and the tile's one footprint each for the whole run of chunks, so the
        # checks for the next chunk's move stay as cheap. A last chunk's node keeps the partial sum among its
        # writes too (it no longer writes it, but nothing may move past it as though it never touched it)
        added_to = list(dict.fromkeys(first.reads[1:-1] + node.reads[1:-1]))
        reads = [_union_key(first.reads[0], node.reads[0]), *added_to, _union_key(first.reads[-1], node.reads[-1])]
        slots[pos] = _Node([(joined[0], joined[1], node.steps[0][2], *joined[3:])], [None], reads,
                           node.writes + first.writes if streams else node.writes, pos)
        slots[previous] = None


class _LaterAccesses:
    """Every instruction's SRAM accesses in issue order (reads before writes within one), to ask whether bytes
    are dead after a position: overwritten whole before anything reads them, or never touched again (a
    program never writes the resident state, which the next run reads, so a partial sum is never in it)."""

    _WINDOW = 1 << 13  # accesses looked at past a position: past them the bytes count as live

    def __init__(self, instructions, order):
        positions, writes, keys = [], [], []
        for pos, index in enumerate(order):
            ins = instructions[index]
            for is_write, refs in ((False, ins.srcs), (True, ins.dsts)):
                for ref in refs:
                    if ref.in_sram:
                        positions.append(pos)
                        writes.append(is_write)
                        keys.append(footprint_key(ref))
        self.positions, self.writes = np.asarray(positions), np.asarray(writes, bool)
        self.keys = np.asarray(keys, np.int64).T.reshape(6, -1)

    def dead_after(self, position: int, key: tuple) -> bool:
        """Whether the bytes of footprint ``key`` are dead after ``position``."""
        start = int(np.searchsorted(self.positions, position, side="right"))
        end = min(start + self._WINDOW, len(self.positions))
        hits = np.flatnonzero(overlaps(self.keys[:, start:end], key))
        if not len(hits):
            return end == len(self.positions)
        first = start + int(hits[0])
        if not self.writes[first]:  # read first (an instruction's reads come before its writes)
            return False
        written = tuple(int(v) for v in self.keys[:, first])
        # rewritten whole: the same footprint, or a plain range over a plain range
        return written == key or (written[2] == 0 and key[2] == 0 and written[0] <= key[0] and written[1] >= key[1])


def _union_key(x: tuple, y: tuple) -> tuple:
    """One footprint (:func:`.hazards.footprint_key`) holding ``x`` and ``y``: exact where ``y`` continues
    ``x``'s rows or its columns, else their bounding range (which can only find more conflicts)."""
    lo, hi = min(x[0], y[0]), max(x[1], y[1])
    stride = x[2]
    if stride and y[2] == stride:
        if x[5] == y[5] and y[3] == x[3] + x[4] * stride:  # y's rows after x's
            return (lo, hi, stride, x[3], x[4] + y[4], x[5])
        if x[4] == y[4] and y[3] == x[3] + x[5] and x[5] + y[5] < stride:  # y's columns after x's
            return (lo, hi, stride, x[3], x[4], x[5] + y[5])
    return range_key(lo, hi)


def _joined_chunks(first: _Node, second: _Node, tiles: dict):
    """One MATMUL step for two K-chunks of a product (``second`` adds to what ``first`` writes), or None where
    their operand blocks or their tiles do not follow each other along K."""
    fn, op, outs, ins, attrs = first.steps[0]
    _, _, _, next_ins, next_attrs = second.steps[0]
    if len(first.steps) != 1 or _without_buffer(next_attrs) != _without_buffer(attrs):
        return None
    a, tile = ins[0], ins[1]
    next_a, next_tile = next_ins[0], next_ins[1]
    if not (isinstance(tile, _LiveTile) and isinstance(next_tile, _LiveTile) and isinstance(a, np.ndarray)
            and a.dtype == next_a.dtype and tile.value.dtype == next_tile.value.dtype):
        return None
    k = a.shape[-1] + next_a.shape[-1]
    if outs[0].dtype == np.int32 and not exact_in_fp32(a.dtype, attrs["zp_a"], tile.value.dtype, attrs["zp_b"], k):
        return None
    operand = _stacked([a, next_a], a.ndim - 1)[0]
    weights = _stacked([tile.value, next_tile.value], 0)[0]
    if operand is None or weights is None:
        return None
    return fn, op, outs, [operand, _tile_of(tiles, weights), *ins[2:]], attrs


def _chain(slots, instructions, order, scratch) -> None:
    """Join each instruction whose result streams to exactly one consumer with that consumer, where it can
    move down to it. A stream's contents are dead once read: the joined steps pass the result through a
    buffer of their own (the k-th a chain needs is ``scratch``'s k-th), and the stream is no longer among
    what they touch, so a later write of the same stream does not hold them back."""
    touches = defaultdict(list)  # stream key -> (position, writes it) of every access, in issue order
    for pos, node in enumerate(slots):
        if node is not None:
            ins = instructions[order[pos]]
            for ref in ins.srcs:
                if not ref.in_sram:
                    touches[_key(ref)].append((pos, False))
            for ref in ins.dsts:
                if not ref.in_sram:
                    touches[_key(ref)].append((pos, True))
    following = {}  # (stream key, position) -> the accesses after it
    for key, accesses in touches.items():
        for k, (pos, _) in enumerate(accesses):
            following[(key, pos)] = accesses[k + 1:k + 3]
    for pos, node in enumerate(slots):
        if node is None or node.steps[-1][1] not in _STACKABLE:
            continue
        dsts = instructions[order[pos]].dsts
        if len(dsts) != 1 or dsts[0].in_sram:
            continue
        after = following[(_key(dsts[0]), pos)]
        # read next by one instruction, and written (or never touched) after that read
        if not after or after[0][1] or (len(after) > 1 and not after[1][1]):
            continue
        consumer_at = after[0][0]
        consumer = slots[consumer_at]
        if consumer is None or len(consumer.steps) != 1 or consumer.steps[0][1] not in _STACKABLE:
            continue
        stream = node.steps[-1][2][0]
        reading = [i for i, x in enumerate(consumer.steps[0][3]) if x is stream]
        if len(reading) != 1:
            continue
        # the stream is the producer's last step's write and the consumer's reading-th read; neither touches it
        # once a buffer of their own carries it (a joined last K-chunk's writes end with its partial sum's)
        streamed = len(node.writes) - 1 - node.writes[::-1].index(_key(dsts[0]))
        producer = _Accesses(node.reads, node.writes[:streamed] + node.writes[streamed + 1:])
        if any(slots[s] is not None and _clash(producer, slots[s]) for s in range(pos + 1, consumer_at)):
            continue
        (fn, op, _, ins, attrs), = consumer.steps
        carrier = scratch.take(len(node.steps) - 1, stream.shape, stream.dtype)  # after its earlier steps' ones
        last_fn, last_op, _, last_ins, last_attrs = node.steps[-1]
        ins = [carrier if i == reading[0] else x for i, x in enumerate(ins)]
        # (by its key: a MATMUL's bound inputs hold its weight buffer at 1, its reads hold the tile's key last)
        at = consumer.reads.index(_key(dsts[0]))
        reads = consumer.reads[:at] + consumer.reads[at + 1:]
        slots[consumer_at] = _Node(node.steps[:-1] + [(last_fn, last_op, [carrier], last_ins, last_attrs),
                                                      (fn, op, consumer.steps[0][2], ins, attrs)],
                                   node.chained + reading, node.reads + reads, producer.writes + consumer.writes,
                                   consumer_at)
        slots[pos] = None


def _signature(node: _Node, layer: int) -> tuple:
    return (layer,) + tuple(
        (op, repr(sorted(_without_buffer(attrs).items())), chained, tuple(_kind(x) for x in ins),
         tuple(_kind(x) for x in outs))
        for (_, op, outs, ins, attrs), chained in zip(node.steps, node.chained))


def _without_buffer(attrs: dict) -> dict:
    """A MATMUL's attributes but the weight buffer it reads: its tile is an operand (the products that share
    one are found by it), and the tiles of a weight fill the buffers in turn."""
    return {k: v for k, v in attrs.items() if k != "buffer"}


def _kind(x) -> tuple:
    return (x.ndim, x.dtype.str) if isinstance(x, np.ndarray) else (type(x).__name__,)


def _stack_runs(slots, instructions, order, scratch) -> list:
    """Runs of entries that compute the same thing on blocks that follow each other in memory along one axis
    (their results' blocks): each run as positions, largest first."""
    alike = defaultdict(list)
    for pos, node in enumerate(slots):
        if node is not None and all(step[1] in _STACKABLE for step in node.steps):
            alike[_signature(node, instructions[order[pos]].layer)].append(pos)
    runs = []
    for positions in alike.values():
        if len(positions) < 2:
            continue
        found = _adjacent_runs(positions, {p: slots[p].steps[-1][2][0] for p in positions})
        if slots[positions[0]].steps[0][1] == Opcode.MATMUL:  # products of one tile by adjacent row blocks
            by_tile = defaultdict(list)
            for p in positions:
                by_tile[id(slots[p].steps[0][3][1])].append(p)
            for group in by_tile.values():
                found += _adjacent_runs(group, {p: slots[p].steps[0][3][0] for p in group})
        runs += found
    return [(_stack_builder(axis, scratch), run) for axis, run in sorted(runs, key=lambda r: len(r[1]), reverse=True)]


def _adjacent_runs(positions, blocks) -> list:
    """``(axis, positions)`` runs whose ``blocks`` follow each other along one axis, in address order."""
    arrays = [p for p in positions if isinstance(blocks[p], np.ndarray)]
    by_address = sorted(arrays, key=lambda p: blocks[p].ctypes.data)
    runs, run, axis = [], by_address[:1], None
    for p in by_address[1:]:
        here = _stack_axis(blocks[run[-1]], blocks[p])
        if here is not None and here == (axis if axis is not None else here):
            run.append(p)
            axis = here
            continue
        if len(run) > 1:
            runs.append((axis, run))
        run, axis = [p], None
    if len(run) > 1:
        runs.append((axis, run))
    return runs


def _stack_axis(a: np.ndarray, b: np.ndarray):
    """The axis along which block ``b`` follows block ``a`` in one array, or None."""
    for axis in range(a.ndim):
        if _stacked([a, b], axis)[0] is not None:
            return axis
    return None


def _stack_builder(axis: int, scratch):
    return lambda nodes: _stack_group(nodes, axis, scratch)


class _Scratch:
    """The buffers merged entries gather blocks into and scatter results from, shared by every entry of one
    simulator: an entry needs its own only during its call, so the entries' k-th buffers of one dtype are one
    buffer as large as the largest of them, not one each (a long prompt's products gather megabytes each)."""

    def __init__(self):
        self._flat = {}

    def user(self):
        """A function ``(shape, dtype) -> buffer`` for one entry: its k-th request gets the k-th buffer."""
        slots = iter(range(1 << 30))
        return lambda shape, dtype: self.take(next(slots), shape, dtype)

    def take(self, slot: int, shape, dtype) -> np.ndarray:
        """The ``slot``-th buffer, viewed as ``shape`` and ``dtype``."""
        shape, dtype = tuple(shape), np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        flat = self._flat.get((slot, dtype))
        if flat is None or flat.nbytes < nbytes:  # (entries built before keep the smaller one)
            flat = self._flat[(slot, dtype)] = aligned_array(nbytes)  # (a host kernel writes it in place)
        return flat[:nbytes].view(dtype).reshape(shape)


def _stack_group(nodes, axis: int, scratch: _Scratch):
    """One call per step for entries whose operands are blocks of one array along ``axis`` (or one array they
    all read whole, broadcast along it); a product's row blocks that lie apart are gathered, and its result's
    blocks scattered. None where the entries are not that."""
    steps, gathers, scatters = [], [], []
    buffer = scratch.user()
    previous = None
    last = len(nodes[0].steps) - 1
    # copies around a product cost little beside it: only where one runs are blocks gathered and scattered
    with_product = any(step[1] == Opcode.MATMUL for step in nodes[0].steps)
    for j, (fn, op, _, _, attrs) in enumerate(nodes[0].steps):
        product = op == Opcode.MATMUL
        if product and axis > 1:
            return None
        outs = [n.steps[j][2][0] for n in nodes]
        out = _stacked(outs, axis)[0] if j == last else None
        if out is None:
            if j == last and not with_product:
                return None
            shape = list(outs[0].shape)  # a buffer as large as the members' blocks together
            shape[axis] = sum(o.shape[axis] for o in outs)
            out = buffer(shape, outs[0].dtype)
            if j == last:
                scatters = _pieces(out, outs, axis)
        ins = []
        for i in range(len(nodes[0].steps[j][3])):
            if i == nodes[0].chained[j]:
                ins.append(previous)
                continue
            blocks = [n.steps[j][3][i] for n in nodes]
            if product and i == 1:
                operand = _tile(blocks, axis)
            elif product and i == 0 and axis == 1:  # one operand against adjacent column blocks of tiles
                operand = blocks[0] if _same(blocks) else None
            else:
                operand = _stacked_operand(blocks, outs, axis, buffer if with_product else None)
            if operand is None:
                return None
            if isinstance(operand, _Gathered):
                gathers.append(operand.pieces)
                operand = operand.array
            ins.append(operand)
        steps.append((fn, op, [out], ins, attrs))
        previous = out
    steps = fused(_into_destination(steps, nodes[0].chained), nodes[0].chained)

    def run(_outs, _ins, _attrs):
        for pieces in gathers:
            for whole, block in pieces:
                np.copyto(whole, block)
        for fn, _, outs, ins, attrs in steps:
            fn(outs, ins, attrs)
        for whole, block in scatters:
            np.copyto(block, whole)
    run.opcodes = tuple(step[1] for step in nodes[0].steps)
    return run


class _Gathered:
    """A buffer the members' blocks of one operand are copied into before each call."""

    def __init__(self, blocks, axis, buffer):
        shape = list(blocks[0].shape)
        shape[axis] = sum(b.shape[axis] for b in blocks)
        self.array = buffer(shape, blocks[0].dtype)
        self.pieces = _pieces(self.array, blocks, axis)


def _pieces(whole: np.ndarray, blocks, axis: int) -> list:
    """``(block of whole, block)`` for each member's block, in order along ``axis``."""
    pieces, start = [], 0
    for block in blocks:
        pieces.append((whole[(slice(None),) * axis + (slice(start, start + block.shape[axis]),)], block))
        start += block.shape[axis]
    return pieces


def _same(blocks) -> bool:
    first = blocks[0]
    return all(b is first for b in blocks) or (isinstance(first, np.ndarray) and all(
        isinstance(b, np.ndarray) and b.ctypes.data == first.ctypes.data and b.shape == first.shape
        and b.strides == first.strides and _root(b) is _root(first) for b in blocks))


def _tile(blocks, axis: int):
    """The tile of a product's stacked members: the one they share (row blocks), or their tiles side by side
    (column blocks), read live; None where neither."""
    if axis == 0:
        return blocks[0] if _same(blocks) else None
    if not all(isinstance(b, _LiveTile) for b in blocks):
        return None
    columns = _stacked([b.value for b in blocks], 1)[0]
    return None if columns is None else _LiveTile(columns)


def _stacked_operand(blocks, outs, axis: int, gather=None):
    """Members' ``blocks`` of one operand as one: the one array they all read whole (it broadcasts along
    ``axis``), their blocks stacked, or a buffer from ``gather`` they are copied into; None where none holds."""
    first = blocks[0]
    if not isinstance(first, np.ndarray):
        return None
    along = axis - (outs[0].ndim - first.ndim)  # numpy broadcasts from the right
    if _same(blocks):
        return first if along < 0 or first.shape[along] == 1 else None
    if along != axis or any(b.shape[axis] != o.shape[axis] for b, o in zip(blocks, outs)):
        return None
    stacked = _stacked(blocks, axis)[0]
    if stacked is None and gather is not None:
        return _Gathered(blocks, axis, gather)
    return stacked


def _band_runs(slots, instructions, order) -> list:
    """Runs of IM2COLs of one convolution whose column blocks follow each other: its bands."""
    bands = defaultdict(list)
    for pos, node in enumerate(slots):
        if node is None or node.steps[0][1] != Opcode.IM2COL:
            continue
        ins = instructions[order[pos]]
        src, dst, attrs = ins.srcs[0], ins.dsts[0], ins.attrs
        key = (ins.layer, src.dtype, src.shape[:2], src.shape[3], src.strides, dst.shape[:3], dst.strides,
               *(tuple(attrs[k]) for k in ("kernel", "stride", "dilation")), attrs["groups"], attrs["pad_value"],
               attrs["pad"][1], attrs["pad"][3])
        bands[key].append(pos)
    return [(_band_group, run) for positions in bands.values()
            for _, run in _adjacent_runs(positions, {p: slots[p].steps[0][2][0] for p in positions})]


def _merge(slots, positions, build) -> None:
    """Merge the instructions at ``positions`` (address order) into one node where that is legal and ``build``
    makes them one call; else try each half."""
    if len(positions) < 2:
        return
    nodes = [slots[p] for p in positions]
    target = _target(slots, positions) if all(n is not None and not n.merged for n in nodes) else None
    fn = build(nodes) if target is not None else None
    if fn is not None:
        merged = _Node([(fn, nodes[0].steps[-1][1], [], [], {})], [None], [k for n in nodes for k in n.reads],
                       [k for n in nodes for k in n.writes], target, merged=True)
        for p in positions:
            slots[p] = None
        slots[target] = merged
        return
    half = len(positions) // 2
    _merge(slots, positions[:half], build)
    _merge(slots, positions[half:], build)


def _target(slots, positions):
    """Where the stacked members can all move to, when they are independent: the last one's place, the
    first's, or another member's; None where nowhere."""
    if max(positions) - min(positions) > _MAX_SPAN:
        return None
    nodes = [slots[p] for p in positions]
    for i, x in enumerate(nodes):
        if any(_clash(x, y) for y in nodes[i + 1:]):
            return None
    ordered = sorted(positions)
    for target in [ordered[-1], ordered[0], *ordered[1:-1]]:
        if _movable(slots, positions, target):
            return target
    return None


def _movable(slots, positions, target: int) -> bool:
    """Whether every member can move to ``target`` past the instructions between."""
    members = set(positions)
    for p in positions:
        node = slots[p]
        lo, hi = (p, target) if p < target else (target, p)
        for s in range(lo + 1, hi):
            other = slots[s]
            if other is not None and s not in members and _clash(node, other):
                return False
    return True


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


def _band_group(nodes):
    """One IM2COL for the bands of one convolution: the input rows they read, padded only where the whole
    input is, give the columns they write side by side. None where the bands are not that."""
    entries = [n.steps[0] for n in nodes]
    attrs = [e[4] for e in entries]
    (kh, kw), (sh, sw), (dh, dw) = attrs[0]["kernel"], attrs[0]["stride"], attrs[0]["dilation"]
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
    width = (first.shape[3] + left + right - (kw - 1) * dw - 1) // sw + 1
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

    def run(_outs, _ins, _attrs):
        im2col([columns], [rows], merged)
    run.opcodes = (Opcode.IM2COL,)
    return run
