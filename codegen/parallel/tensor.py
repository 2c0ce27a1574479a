"""tensor: compile one model's operator graph tensor parallel over a group of chips.

Every chip runs the whole graph on a slice of each matrix product's output
columns (a convolution's output channels) and holds only that slice of its
weights; the slices are all-gathered after each product, with the collective
that fits the chips' links (:mod:`.collectives`: direct on a node, hierarchical
on a rack, a ring elsewhere), so every chip has the full tensor for what follows. Where
Megatron-LM pairs products (an MLP, attention by heads), the second splits by
rows and one all-reduce sums its partial results; a model input inside such a
pair (a decoder's KV cache) reaches each chip as its slice, and each chip
stores its slice of a model output made as slices (the new K/V, an LM head's
logits) instead of gathering it. The chips run the same schedule: each RECV is
placed one hop after the SEND it pairs with, at a fixed offset, and the offset
holds on every chip because every chip runs one schedule: the ranks' graphs are
alike node for node (each computes every output, and stores only its own), and
the scheduler honours every rank's dependences at once (SPMD by construction).
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass, replace
from math import prod

import numpy as np

from ...runtime_sim import ChipConfig, Opcode
from ...runtime_sim.isa import OP_TABLE, Group
from ...runtime_sim.system import SystemConfig
from ...runtime_sim.system_sim import axis_slice
from ..graph import CONVOLUTIONS, PRODUCTS, WEIGHTED, Graph, Node, NodeKind
from .base import Mapping, Part, SystemCompileError, strategy
from .collectives import CollectiveError, choose


def _splittable(g: Graph, node, ranks: int):
    """``(axis of the output that splits, its size)`` when ``node``'s output columns split over ``ranks``."""
    if node.kind in PRODUCTS:
        w = node.inputs[1]
        if not g.is_constant(g.base(w)) or len(g.tensors[w].shape) != 2:
            return None
        n = g.tensors[w].shape[1]
        axis = len(g.tensors[node.output].shape) - 1
    elif node.kind in CONVOLUTIONS and node.attrs["groups"] == 1:
        n = g.tensors[node.inputs[1]].shape[0]
        axis = 1
    else:
        return None
    uneven = node.kind == NodeKind.MATMUL and g.base(node.inputs[1]) not in g.quantized  # a float product's may,
    width = -(-n // ranks)  # as long as no chip's slice is all padding (it would idle and fall out of step)
    if n < ranks or (n % ranks and (not uneven or ranks * width - n >= width)):
        return None
    for extra in node.inputs[2:]:  # per-output-channel vectors split with the weight
        if prod(g.tensors[extra].shape) not in (1, n):
            return None
    return axis, n


def _row_split_regions(g: Graph, ranks: int) -> dict:
    """Megatron's pairing: product index ─► a :class:`_Region` (the nodes between it and the products whose
    columns it consumes, tensor ─► the axis it is split along, ...).

    A product ``B`` (a float matmul by a constant ``[K, N]`` weight, no fused activation, ``K`` and ``N``
    splitting over ``ranks``) whose input is made, through ops that keep a split axis whole per chip
    (elementwise ops, transposes, reshapes that keep the split contiguous, a softmax along another axis,
    a concatenation along another axis, products batched over it: attention's heads), from column-split
    products and model inputs (a decoder's KV cache), and is read by nothing else, splits by rows: each chip
    keeps its slice from the first products on and sums ``B``'s partial results once (an all-reduce) instead
    of all-gathering after every product. A model input read inside, and only there, reaches each chip as
    its slice; a model output made inside (a decoder's new K/V) is stored by each chip, its slice."""
    producer = {node.output: i for i, node in enumerate(g.nodes)}
    readers = {}
    for i, node in enumerate(g.nodes):
        for t in node.inputs:
            readers.setdefault(g.base(t), set()).add(i)
    outputs = {g.base(t) for t in g.outputs}
    regions = {}
    for b, node in enumerate(g.nodes):
        split = _splittable(g, node, ranks)
        if node.kind != NodeKind.MATMUL or split is None or node.attrs.get("act", Opcode.NOP) != Opcode.NOP:
            continue
        h = node.inputs[0]
        k = g.tensors[node.inputs[1]].shape[0]
        if k % ranks or split[1] % ranks:
            continue
        region = _region_behind(g, h, len(g.tensors[h].shape) - 1, ranks, producer, outputs, regions)
        if region is None:
            continue
        _follow_casts(g, region, readers, outputs, b)
        made_inside = {g.nodes[i].output for i in region.nodes}
        sliced_ops = region.nodes - region.columns
        # everything the region makes is read only inside it or by B; its column products and broadcast
        # operands read whole tensors from outside it (inside, tensors exist only as slices); a model input
        # split here is read only by ops on the slices (a chip is given nothing else of it)
        if all(readers.get(g.nodes[i].output, set()) <= region.nodes | {b} for i in region.nodes) and not any(
                g.base(t) in made_inside for t in region.whole) and all(
                readers.get(t, set()) <= sliced_ops for t in region.inputs):
            regions[b] = region
    return regions


@dataclass
class _Region:
    """What splits with one row-split product: the nodes before it, each tensor's split axis, the tensors
    every chip reads whole, the products split by columns, and the model's inputs and outputs in it."""

    nodes: set
    axes: dict
    whole: list
    columns: set
    inputs: set
    outputs: set


def _follow_casts(g: Graph, region: _Region, readers: dict, outputs: set, b: int) -> None:
    """A unary op (reduced precision's CAST back to fp32) that turns a tensor made inside ``region`` into a
    model output nothing reads joins it: the output is made as slices too, and each chip stores its own."""
    for i in list(region.nodes):
        t = g.nodes[i].output
        for j in readers.get(t, set()) - region.nodes - {b}:
            follower = g.nodes[j]
            out = follower.output
            if follower.kind in _UNARY and follower.inputs == [t] and out in outputs and not readers.get(out):
                region.nodes.add(j)
                region.axes[out] = region.axes[t]
                region.outputs.add(out)


def _region_behind(g: Graph, h: int, axis: int, ranks: int, producer: dict, outputs: set, taken: dict):
    """Walk back from ``h`` split along ``axis``: a :class:`_Region`, or None."""
    region = _Region(set(), {}, [], set(), set(), set())
    axes, whole = region.axes, region.whole
    model_inputs = set(g.inputs)
    stack = [(h, axis)]
    while stack:
        t, ax = stack.pop()
        if t in axes:
            if axes[t] != ax:
                return None
            continue
        axes[t] = ax
        shape = g.tensors[t].shape
        if shape[ax] % ranks:
            return None
        base = g.base(t)
        if base != t:  # a reshape: the base's axis that holds the same contiguous split
            base_ax = _same_split(shape, ax, g.tensors[base].shape)
            if base_ax is None:
                return None
            stack.append((base, base_ax))
            continue
        if t in model_inputs:  # each chip is given its slice (a decoder's KV cache: its heads')
            region.inputs.add(t)
            continue
        i = producer.get(t)
        if i is None:
            return None
        if t in outputs:  # made as slices: each chip stores its own (see :func:`tensor_graph`)
            region.outputs.add(t)
        made = g.nodes[i]
        region.nodes.add(i)
        weight = made.inputs[1] if len(made.inputs) > 1 else None
        if made.kind == NodeKind.MATMUL and weight is not None and g.is_constant(g.base(weight)) \
                and ax == len(shape) - 1:
            column = _splittable(g, made, ranks)
            if column is None or column[1] % ranks or i in taken or any(i in r.nodes for r in taken.values()):
                return None  # (a product already split by rows sums whole columns: it cannot start a region)
            whole.append(made.inputs[0])
            region.columns.add(i)
        elif made.kind == NodeKind.MATMUL and ax < len(shape) - 2 \
                and all(g.is_constant(g.base(e)) for e in made.inputs[2:]):
            # batched over the split axis: two activations split alike, or one by a constant every chip holds
            # (an epilogue's bias and scale, one per column, are the same for every batch)
            a, w = made.inputs[:2]
            whole.extend(made.inputs[2:])
            if len(g.tensors[a].shape) != len(shape):
                return None
            stack.append((a, ax))
            if g.is_constant(g.base(w)) and len(g.tensors[w].shape) == 2:
                whole.append(w)
            elif len(g.tensors[w].shape) == len(shape):
                stack.append((w, ax))
            else:
                return None
        elif made.kind == "TRANSPOSE":
            stack.append((made.inputs[0], made.attrs["perm"][ax]))
        elif made.kind == "SOFTMAX" and made.attrs["axis"] % len(shape) != ax:
            stack.append((made.inputs[0], ax))
        elif made.kind == "CONCAT" and made.attrs["axis"] != ax:
            stack += [(x, ax) for x in made.inputs]
        elif made.kind in _ELEMENTWISE:
            for x in made.inputs:
                xs = g.tensors[x].shape
                at = ax - (len(shape) - len(xs))  # numpy broadcasting aligns the trailing axes
                if xs == shape:
                    stack.append((x, ax))
                elif at < 0 or xs[at] == 1:
                    whole.append(x)  # broadcast along the split axis: every chip reads it whole
                else:
                    return None
        else:
            return None
    return region if region.columns else None


def _same_split(shape: tuple, axis: int, base_shape: tuple):
    """The axis of ``base_shape`` that splits as ``shape``'s ``axis`` does (same elements before it), or None."""
    outer = prod(shape[:axis])
    for a in range(len(base_shape)):
        if prod(base_shape[:a]) == outer and prod(base_shape[a:]) == prod(shape[axis:]) and base_shape[a] > 1:
            return a
    return None


_ELEMENTWISE = {op.name for op, spec in OP_TABLE.items() if spec.group in (Group.UNARY, Group.BINARY)}
_UNARY = {op.name for op, spec in OP_TABLE.items() if spec.group == Group.UNARY}


def tensor_graph(g: Graph, rank: int, ranks: int, links: dict, regions: dict) -> tuple:
    """Chip ``rank``'s graph. Products fed by column-split products through ops that keep a split axis whole
    per chip split by rows and sum their partial results in one all-reduce (:func:`_row_split_regions`);
    every other splittable product computes its slice of output columns (channels) from its slice of the
    weights, and an all-gather rebuilds the full tensor for what follows. ``regions``: :func:`_row_split_regions`
    of ``g`` (the same for every rank). Returns (graph, all-gathers, all-reduces, {model output: the axis each chip stores its slice
    along}): a model output made as slices is stored so, not gathered."""
    part = copy.copy(g)
    part.tensors = list(g.tensors)
    part.quantized = dict(g.quantized)
    part.nodes, part.streamed = [], []
    in_region = {i for region in regions.values() for i in region.nodes}
    columns = {i for region in regions.values() for i in region.columns}
    axes = {t: ax for region in regions.values() for t, ax in region.axes.items()}
    region_outputs = {t for region in regions.values() for t in region.outputs}
    listed = Counter(g.base(t) for t in g.outputs)
    sliced = {}  # full tensor ─► this chip's slice of it (along its axis in ``axes``)

    def slice_of(t: int) -> int:
        if t not in sliced and t in axes:
            shape = list(g.tensors[t].shape)
            shape[axes[t]] //= ranks
            base = g.base(t)
            sliced[t] = part.add_tensor(shape, g.tensors[t].dtype,
                                        alias_of=slice_of(base) if base != t else None)
        return sliced.get(t, t)

    # a model input has a split axis only as a region's input: each chip is given its slice
    part.inputs = [slice_of(t) for t in g.inputs]
    part.state = {slice_of(t) for t in g.state}
    part.host_dtype = {slice_of(t): d for t, d in g.host_dtype.items()}
    read = {g.base(t) for node in g.nodes for t in node.inputs}
    stored = {}  # model output ─► the axis along which each chip stores its slice of it
    gathers = reduces = 0
    tag = 0
    span = links["group"].tags()  # the tags one collective may use

    def made_as_slices(node, axis: int) -> None:
        """A model output made inside a region (a new K/V; what else reads it reads the slices): each chip
        stores its own where the output is the tensor itself, listed once; otherwise it is gathered whole."""
        nonlocal tag, gathers
        t = node.output
        if t in g.outputs and listed[t] == 1:
            stored[t] = axis
            return
        part.nodes.append(_allgather(slice_of(t), t, axis, rank, ranks, links, tag, node.layer))
        tag += span
        gathers += 1

    for index, node in enumerate(g.nodes):
        column = index in columns
        if index in in_region and not column:  # on the slices: each chip its own heads or columns
            inputs = [slice_of(t) for t in node.inputs]
            part.nodes.append(replace(node, inputs=inputs, output=slice_of(node.output)))
            if node.output in region_outputs:
                made_as_slices(node, axes[node.output])
            continue
        if index in regions:  # rows of the weight, the partial sums added up by an all-reduce
            h = node.inputs[0]
            k = g.tensors[node.inputs[1]].shape[0]
            lo, hi = rank * k // ranks, (rank + 1) * k // ranks
            weight = g.tensors[g.base(node.inputs[1])].data.reshape(g.tensors[node.inputs[1]].shape)
            # the partial sums' columns rotated by this chip's rank: its block j is block rank + j, so every
            # chip sends and adds the same addresses at the same steps (one schedule for all); a one-shot
            # all-reduce sends and adds them whole, in place
            whole_sums = links["group"].one_shot(g.tensors[node.output].nbytes)
            turn = 0 if whole_sums else -rank * (weight.shape[1] // ranks)
            inputs = [slice_of(h), part.constant(np.roll(weight[lo:hi], turn, axis=1))]
            for k, extra in enumerate(node.inputs[2:], 2):  # per output column: rotated as the partial sums are
                data = np.roll(g.tensors[g.base(extra)].data.reshape(g.tensors[extra].shape), turn, axis=-1)
                if k == 2 and rank:  # the bias is added once; zeros elsewhere keep every chip's program alike
                    data = np.zeros_like(data)
                inputs.append(part.constant(data))  # (fp8's scale, k == 3, on every chip)
            partial = part.add_tensor(g.tensors[node.output].shape, g.tensors[node.output].dtype)
            part.nodes.append(replace(node, inputs=inputs, output=partial))
            part.nodes.append(Node(NodeKind.ALLREDUCE, [partial], node.output,
                                   {"rank": rank, "ranks": ranks, "tag": tag, "rotated": not whole_sums, **links},
                                   node.layer + "+allreduce"))
            tag += span
            reduces += 1
            continue
        split = _splittable(g, node, ranks)
        if split is None:
            part.nodes.append(node)
            continue
        axis, n = split
        width = -(-n // ranks)  # uneven (a float product's): the last chips' slices are padded with zero columns
        lo, hi = min(rank * width, n), min((rank + 1) * width, n)
        inputs = _column_inputs(g, part, node, n, lo, hi, width)
        full = g.tensors[node.output]
        out_shape = list(full.shape)
        out_shape[axis] = width
        if column:  # a column product of a row-split pair: its slice is all the next ops need
            part.nodes.append(replace(node, inputs=inputs, output=slice_of(node.output)))
            if node.output in region_outputs:
                made_as_slices(node, axis)
            continue
        if not n % ranks and node.output in g.outputs and listed[node.output] == 1 and node.output not in read:
            axes[node.output] = axis  # a model output nothing reads (an LM head's logits): each chip stores
            part.nodes.append(replace(node, inputs=inputs, output=slice_of(node.output)))  # its columns
            stored[node.output] = axis
            continue
        slice_id = part.add_tensor(out_shape, full.dtype)
        part.nodes.append(replace(node, inputs=inputs, output=slice_id))
        if n % ranks:  # gathered with the padding, then the real columns copied out
            padded_shape = list(full.shape)
            padded_shape[axis] = width * ranks
            padded = part.add_tensor(padded_shape, full.dtype)
            part.nodes.append(_allgather(slice_id, padded, axis, rank, ranks, links, tag, node.layer))
            part.nodes.append(Node(NodeKind.NARROW, [padded], node.output, {"axis": axis}, node.layer + "+narrow"))
        else:
            part.nodes.append(_allgather(slice_id, node.output, axis, rank, ranks, links, tag, node.layer))
        tag += span
        gathers += 1
    # every chip computes every output, so that the chips' programs are alike; chip 0 stores them all (split
    # ones as its slice), the others their slices of the split ones (:class:`~.base.Part`'s ``stored``)
    part.outputs = [slice_of(t) if t in stored else t for t in g.outputs]
    return part, gathers, reduces, stored


def _columns(a: np.ndarray, axis: int, lo: int, hi: int, width: int) -> np.ndarray:
    """Columns ``[lo, hi)`` of ``a`` along ``axis``, zero-padded to ``width`` (an uneven split's last slices)."""
    part = a[axis_slice(axis, lo, hi)]
    pad = [(0, 0)] * a.ndim
    pad[axis] = (0, width - (hi - lo))
    return np.ascontiguousarray(np.pad(part, pad) if hi - lo < width else part)


def _column_inputs(g: Graph, part: Graph, node, n: int, lo: int, hi: int, width: int) -> list:
    """``node``'s inputs for the columns (output channels) ``[lo, hi)`` of its ``n``: its weight's, their
    integers, scales and zero points where it was dequantised, and its per-channel vectors', each padded
    to ``width``."""
    inputs = list(node.inputs)
    w = g.base(node.inputs[1])
    weight = g.tensors[w].data.reshape(g.tensors[node.inputs[1]].shape)
    axis = 1 if node.kind.endswith(NodeKind.MATMUL) else 0
    inputs[1] = part.constant(_columns(weight, axis, lo, hi, width))
    if w in g.quantized:  # (never uneven) scales and zero points may be one for all columns
        q, scale, zp = g.quantized[w]
        part.quantized[inputs[1]] = tuple(_columns(a, axis, lo, hi, width) if a.shape[axis] == n else a
                                          for a in (q.reshape(weight.shape), scale, zp))
    for k, extra in enumerate(node.inputs[2:], 2):
        data = g.tensors[g.base(extra)].data
        if data is not None and prod(g.tensors[extra].shape) == n:
            shape = list(g.tensors[extra].shape)
            shape[[i for i, d in enumerate(shape) if d == n][-1]] = width
            inputs[k] = part.constant(_columns(data.reshape(-1), 0, lo, hi, width).reshape(shape))
    return inputs


def _allgather(src: int, out: int, axis: int, rank: int, ranks: int, links: dict, tag: int, layer: str):
    return Node(NodeKind.ALLGATHER, [src], out, {"axis": axis, "rank": rank, "ranks": ranks, "tag": tag, **links},
                layer + "+allgather")


def _has_split(g: Graph) -> bool:
    return any(_splittable(g, node, 2) for node in g.nodes)


@strategy("tensor", "every product split by output columns (Megatron pairs by rows, one all-reduce each), "
          "collectives that fit the links; one schedule for every chip", applies=_has_split)
def split_tensor(g: Graph, chip: ChipConfig, system: SystemConfig, dtype: str, chips: int | None) -> Mapping:
    """``g`` tensor parallel over ``chips`` chips of ``system`` (default: all), joined by the collective its
    links allow (:func:`.collectives.choose`)."""
    ranks = min(chips or system.chips, system.chips)
    try:
        group = choose(system, ranks)
    except CollectiveError as err:
        raise SystemCompileError(str(err)) from None
    order = list(group.chips)
    if not any(_splittable(g, node, ranks) for node in g.nodes):
        raise SystemCompileError(f"no matrix product of the model splits over {ranks} chips")
    regions = _row_split_regions(g, ranks)
    parts = []
    for rank, chip_id in enumerate(order):
        part, gathers, reduces, stored = tensor_graph(g, rank, ranks, {"group": group}, regions)
        kept = None if rank == 0 else tuple(k for k, t in enumerate(g.outputs) if t in stored)
        parts.append(Part(chip_id, part, stored=kept))
    split_inputs = {t: region.axes[t] for region in regions.values() for t in region.inputs}
    split_outputs = [t for t in g.outputs if t in stored]

    def pieces(t: int, axis: int, index_of) -> tuple:
        """Each chip's ``(chip, index, axis, lo, hi)`` of ``t`` split along ``axis``."""
        n = g.tensors[t].shape[axis] // ranks
        return tuple((c, index_of(rank), axis, rank * n, (rank + 1) * n) for rank, c in enumerate(order))
    # every chip loads every input (its slice of a split one); chip 0 stores every output, each chip its
    # slice of a split one (chip 0 at the output's index, the others at its index among the split ones)
    inputs = tuple(pieces(t, split_inputs[t], lambda rank, k=k: k) if t in split_inputs
                   else tuple((c, k) for c in order) for k, t in enumerate(g.inputs))
    outputs = tuple(pieces(t, stored[t], lambda rank, k=k, t=t: k if rank == 0 else split_outputs.index(t))
                    if t in stored else ((order[0], k),) for k, t in enumerate(g.outputs))
    # every rank's graph is alike, so the last rank's counts are every rank's
    notes = (f"{ranks}-way tensor parallel on chips {order}, {gathers} all-gathers, {reduces} all-reduces "
             f"({group.algorithm})")
    return Mapping("tensor", parts, inputs, outputs, notes, spmd=True, hint=_unsplit_weights(g, ranks))


def _unsplit_weights(g: Graph, ranks: int) -> str:
    """The largest weights every chip holds whole, because their products do not split over ``ranks``."""
    whole = sorted(((g.tensors[node.inputs[1]].nbytes, node.layer) for node in g.nodes
                    if node.kind in WEIGHTED and g.is_constant(g.base(node.inputs[1]))
                    and _splittable(g, node, ranks) is None), reverse=True)
    if not whole:
        return "every product's weights are split"
    listed = ", ".join(f"{layer} ({nbytes:,} bytes)" for nbytes, layer in whole[:3])
    return f"these products do not split evenly over {ranks} chips and every chip holds their weights whole: {listed}"
