"""tile: split each operator into instructions that fit the units.

A convolution becomes an IM2COL on the switch unit (skipped for 1x1 stride-1
convolutions, whose input already is the matrix) and a matrix product mapped
onto the planes by :mod:`.mxm` (installs, K-tiled MATMULs, a chained EPILOGUE
per job); a matrix product maps the same way, batch by batch. A depthwise
convolution is one DWCONV on the vector unit instead, since expanding it by
im2col costs k² times its input for a matrix-vector product per channel.
Everything else is one instruction.

Weights are resident, unless together they would take more than a budget (what
SRAM leaves beside the activations' peak): then the largest
matrix-product weights stay in host memory and are streamed in column blocks
(STREAM on the host link into a ring of buffers, so the next block streams while
the current one computes) each time they are used. That is slow, bounded by
the host link, and the timing says so; but the layer runs on lpx instead of
falling back.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil, prod

import numpy as np

from ..runtime_sim import ChipConfig, Opcode
from ..runtime_sim.isa import OP_TABLE, Group, make_attrs
from .graph import PRODUCTS, Graph, Node, NodeKind
from .mxm import PlaneMapper, Product, add_tree
from .views import Operand, dense_strides, stream, transposed, view, whole

STREAM_RING = 3  # streamed weight blocks in flight: one computing, two streaming ahead
# a network input arrives in row bands, and vector and switch work on big NCHW tensors is cut into row bands
# of about this many bytes (the larger operand), so a layer starts on the first rows the one before finishes
BAND_BYTES = 64 << 10
# a host transfer is cut finer: the first layer waits for its first band to cross the link, the slowest path
HOST_BAND_BYTES = 16 << 10
_BANDED_GROUPS = (Group.UNARY, Group.BINARY, Group.QUANT, Group.QBINARY)


def row_bands(rows: int, total_bytes: int, band_bytes: int) -> list:
    """``[(r0, r1), ...]``: ``rows`` cut into bands of about ``band_bytes`` each (at most 16 bands)."""
    n = max(1, min(rows, 16, ceil(total_bytes / band_bytes)))
    step = ceil(rows / n)
    return [(r, min(r + step, rows)) for r in range(0, rows, step)]


def window_rows(o0: int, o1: int, size: int, k: int, s: int, d: int, pad: int) -> tuple:
    """Input rows ``[i0, i1)`` and the band's top and bottom padding for output rows ``[o0, o1)``."""
    first, last = o0 * s - pad, (o1 - 1) * s - pad + (k - 1) * d
    i0, i1 = max(first, 0), min(last + 1, size)
    return i0, i1, i0 - first, last + 1 - i1


@dataclass
class TileOp:
    opcode: Opcode
    srcs: list
    dsts: list
    attrs: dict  # named, as the op table defines them
    layer: str
    unit_index: int | None = None  # fixed by the tiler (a MATMUL's plane), else chosen by schedule


def stream_tile_bytes(config: ChipConfig) -> int:
    """The most bytes one streamed weight block may take (a ring of them is in SRAM at once)."""
    return config.sram_bytes // 16


def _epilogue(node: Node) -> dict:
    attrs = {"act": node.attrs["act"], "act_args": tuple(node.attrs["act_args"])}
    if node.kind.startswith("q"):
        attrs["zp_out"] = node.attrs["zp_out"]
    return attrs


def _zero_points(node: Node, weight_first: bool) -> tuple:
    """(zp of A, zp of B): the weight is A for convolutions, B for matrix products."""
    if not node.kind.startswith("q"):
        return 0, 0
    zp_x, zp_w = node.attrs["zp_in"], node.attrs["zp_w"]
    return (zp_w, zp_x) if weight_first else (zp_x, zp_w)


class _Tiler:
    def __init__(self, g: Graph, config: ChipConfig):
        self.g, self.config = g, config
        self.ops: list = []
        self.chains = 0
        self.mapper = PlaneMapper(g, config, self.emit, self.new_chain)
        self.readers = {}  # base tensor ─► the kinds of the nodes that read it
        for node in g.nodes:
            for t in node.inputs:
                self.readers.setdefault(g.base(t), []).append(node.kind)

    def emit(self, opcode, srcs, dsts, attrs, layer, unit_index=None) -> None:
        self.ops.append(TileOp(opcode, list(srcs), list(dsts), dict(attrs), layer, unit_index))

    def new_chain(self) -> int:
        self.chains += 1
        return self.chains

    # ---- convolutions --------------------------------------------------
    def conv2d(self, node: Node) -> None:
        g = self.g
        x, w = node.inputs[0], node.inputs[1]
        n, c, h, wd = g.tensors[x].shape
        oc, cg, kh, kw = g.tensors[w].shape
        _, _, oh, ow = g.tensors[node.output].shape
        groups = node.attrs["groups"]
        k, p, ocg = cg * kh * kw, oh * ow, oc // groups
        pads = tuple(node.attrs["padding"])
        window = {"kernel": (kh, kw), "stride": tuple(node.attrs["strides"]), "pad": pads,
                  "dilation": tuple(node.attrs["dilation"])}
        if groups == c == oc:  # depthwise: per-channel taps on the vector unit, no 9-25x im2col blow-up
            srcs = [whole(g, x), whole(g, w, (c, kh, kw))] + [whole(g, t, (c, 1, 1)) for t in node.inputs[2:]]
            attrs = {**window, "act": node.attrs["act"], "act_args": tuple(node.attrs["act_args"])}
            if node.kind == NodeKind.QCONV2D:
                attrs.update(zp_in=node.attrs["zp_in"], zp_out=node.attrs["zp_out"])
            self.emit(Opcode.DWCONV, srcs, [whole(g, node.output)], attrs, node.layer)
            return
        if (kh, kw) == (1, 1) and window["stride"] == (1, 1) and not any(pads):
            cols = x
        else:
            cols = g.add_tensor((n, groups, k, p), g.tensors[x].dtype)
            # int8 pads with the input zero point: the padded value must dequantise to 0
            attrs = {**window, "groups": groups, "pad_value": node.attrs.get("zp_in", 0)}
            self.banded_window(Opcode.IM2COL, x, cols, (n, groups, k, oh, ow), attrs, node.layer)
        zp_a, zp_b = _zero_points(node, weight_first=True)
        out, extras = node.output, node.inputs[2:]
        dtype = g.tensors[x].dtype
        for image in range(n):
            for group in range(groups):
                wv = lambda m0, m1, k0, k1, gi=group: view(g, w, (groups, ocg, k), (gi,), [(m0, m1), (k0, k1)])
                cv = lambda k0, k1, n0, n1, i=image, gi=group: view(g, cols, (n, groups, k, p), (i, gi),
                                                                   [(k0, k1), (n0, n1)])
                ov = lambda m0, m1, n0, n1, i=image, gi=group: view(g, out, (n, groups, ocg, p), (i, gi),
                                                                    [(m0, m1), (n0, n1)])
                ev = lambda m0, m1, n0, n1, t, gi=group: [_per_row(g, e, groups, ocg, gi, m0, m1, t)
                                                          for e in extras]
                self.mapper.map(Product(ocg, k, p, wv, cv, ov, ev, dtype, zp_a, zp_b, _epilogue(node),
                                        rows_first=False), node.layer)

    # ---- matrix products -----------------------------------------------
    def matmul(self, node: Node, streamed_width: int | None, then: Node | None = None,
               b_transposed: int | None = None) -> None:
        """A (batched) matrix product; ``then``, a softmax over its columns, chained from each job's epilogue;
        ``b_transposed``, the tensor whose last two axes swapped are B (its transpose is read in place)."""
        g = self.g
        a, b = node.inputs[0], node.inputs[1]
        a_shape, b_shape = g.tensors[a].shape, g.tensors[b].shape
        out_shape = g.tensors[node.output].shape
        m, k, n = a_shape[-2], a_shape[-1], b_shape[-1]
        batch = out_shape[:-2]
        zp_a, zp_b = _zero_points(node, weight_first=False)
        dtype = g.tensors[a].dtype
        extras = node.inputs[2:]
        ab, bb = prod(a_shape[:-2]), prod(b_shape[:-2])
        a_index = np.broadcast_to(np.arange(ab).reshape(a_shape[:-2] or (1,)), batch or (1,)).reshape(-1)
        b_index = np.broadcast_to(np.arange(bb).reshape(b_shape[:-2] or (1,)), batch or (1,)).reshape(-1)
        ring = None
        if streamed_width is not None:
            ring = [self.g.add_tensor((k, streamed_width), g.tensors[b].dtype) for _ in range(STREAM_RING)]
        for i, (ia, ib) in enumerate(zip(a_index, b_index)):
            av = lambda m0, m1, k0, k1, j=int(ia): view(g, a, (ab, m, k), (j,), [(m0, m1), (k0, k1)])
            ov = lambda m0, m1, n0, n1, j=i: view(g, node.output, (prod(batch or (1,)), m, n), (j,),
                                                  [(m0, m1), (n0, n1)])
            if ring is None:
                if b_transposed is None:
                    bv = lambda k0, k1, n0, n1, j=int(ib): view(g, b, (bb, k, n), (j,), [(k0, k1), (n0, n1)])
                else:
                    bv = lambda k0, k1, n0, n1, j=int(ib): transposed(view(g, b_transposed, (bb, n, k), (j,),
                                                                          [(n0, n1), (k0, k1)]))
                ev = lambda m0, m1, n0, n1, t: [_per_column(g, e, n, n0, n1, t) for e in extras]
                chained = None
                if then is not None:
                    tv = lambda m0, m1, n0, n1, j=i: view(g, then.output, (prod(batch or (1,)), m, n), (j,),
                                                          [(m0, m1), (n0, n1)])
                    chained = (Opcode[then.kind], {"axis": 1}, then.layer, tv)
                self.mapper.map(Product(m, k, n, av, bv, ov, ev, dtype, zp_a, zp_b, _epilogue(node),
                                        "B" if then is not None else None, chained), node.layer)
            else:
                self._streamed(node, av, ov, ring, m, k, n, dtype, zp_a, zp_b)

    def _streamed(self, node, av, ov, ring, m, k, n, dtype, zp_a, zp_b) -> None:
        """STREAM each column block of a host-resident weight into the ring, then map the block's product."""
        g = self.g
        width = g.tensors[ring[0]].shape[1]
        weight = g.tensors[g.base(node.inputs[1])].data.reshape(k, n)
        extras = node.inputs[2:]
        for block, c0 in enumerate(range(0, n, width)):
            c1 = min(c0 + width, n)
            slot = ring[block % len(ring)]
            g.streamed.append(weight[:, c0:c1])  # a view: encode writes the block's bytes, in C order
            self.emit(Opcode.STREAM, [], [view(g, slot, ranges=[(0, k), (0, c1 - c0)])],
                      {"index": len(g.streamed) - 1}, node.layer)
            bv = lambda k0, k1, n0, n1, s=slot: view(g, s, ranges=[(k0, k1), (n0, n1)])
            bo = lambda m0, m1, n0, n1, o=c0: ov(m0, m1, n0 + o, n1 + o)
            ev = lambda m0, m1, n0, n1, t, o=c0: [_per_column(g, e, n, n0 + o, n1 + o, t) for e in extras]
            self.mapper.map(Product(m, k, c1 - c0, av, bv, bo, ev, dtype, zp_a, zp_b, _epilogue(node), "B"),
                            node.layer)

    # ---- chip to chip ------------------------------------------------------
    def _block(self, t: int, axis: int, width: int, r: int, ranks: int, piece: int = 0, pieces: int = 1):
        """Block ``r`` (mod ``ranks``) of ``t`` along ``axis`` (``width`` elements from ``r · width``), or its
        ``piece``-th of ``pieces`` parts along the same axis (a block sent over several links side by side)."""
        g = self.g
        lo = (r % ranks) * width
        return view(g, t, ranges=[(0, d) for d in g.tensors[t].shape[:axis]]
                    + [(lo + piece * width // pieces, lo + (piece + 1) * width // pieces)])

    def _phase(self, node: Node, phase, number: int, sent, received, width: int, mine=None) -> None:
        """SEND and RECV every exchange of one phase of a collective (:mod:`.parallel.collectives`):
        ``sent(block, piece, pieces)`` and ``received(...)`` name the views. An exchange's blocks are spread
        over its links, a block to a link, or each block cut into pieces when there are more links than
        blocks. Every rank emits the same tags in the same order, so each RECV pairs with this rank's SEND of
        its tag (the scheduler places it one hop later: its sender runs the same schedule). A reduce phase then
        adds what it received into ``mine``'s blocks: a ring's exchange by exchange (the next sends the sum),
        side by side exchanges' as a tree, in place (received blocks are scratch until the all-gather)."""
        group = node.attrs["group"]
        per_piece = max(group.ranks, group.links)
        ring = group.algorithm == "ring"
        for e, ex in enumerate(phase.exchanges):
            links = len(ex.to_ports)
            split = min(max(links // max(len(ex.send), 1), 1), width)
            pieces = [(k, j) for k in range(len(ex.send)) for j in range(split)]
            for n, (k, j) in enumerate(pieces):
                tag = node.attrs["tag"] + (number * group.ranks + e) * per_piece + n
                self.emit(Opcode.SEND, [sent(ex.send[k], j, split)], [], {"peer": ex.to, "tag": tag},
                          node.layer, ex.to_ports[n % links])
                self.emit(Opcode.RECV, [], [received(ex.recv[k], j, split)], {"peer": ex.frm, "tag": tag},
                          node.layer, ex.frm_ports[n % len(ex.frm_ports)])
            if phase.reduce and ring:
                for target, got in zip(ex.add_into, ex.recv):
                    self.emit(Opcode.ADD, [mine(target), received(got)], [mine(target)], {}, node.layer)
        if not phase.reduce or ring:
            return
        for j, target in enumerate(phase.exchanges[0].add_into):
            add_tree(self.emit, [mine(target)] + [received(ex.recv[j]) for ex in phase.exchanges], node.layer)

    def allgather(self, node: Node) -> None:
        """An all-gather (tensor parallel): this chip's slice into its block of the full tensor, then the
        group's exchanges (:meth:`~.parallel.collectives.Group.gather`: direct, hierarchical or a ring)."""
        a = node.attrs
        axis, rank, ranks, out = a["axis"], a["rank"], a["ranks"], node.output
        width = self.g.tensors[node.inputs[0]].shape[axis]

        def block(r, piece=0, pieces=1):
            return self._block(out, axis, width, r, ranks, piece, pieces)
        self.emit(Opcode.COPY, [whole(self.g, node.inputs[0])], [block(rank)], {}, node.layer)
        for number, phase in enumerate(a["group"].gather(rank)):
            self._phase(node, phase, number, block, block, width)

    def alltoall(self, node: Node) -> None:
        """An all-to-all along ``axis``: this chip's block ``j`` of the input goes to rank ``j``, and rank ``j``'s
        block for this chip lands as block ``j`` of the output (:meth:`~.parallel.collectives.Group.all_to_all`);
        this chip's own block is copied across."""
        a = node.attrs
        axis, rank, ranks = a["axis"], a["rank"], a["ranks"]
        x, out = node.inputs[0], node.output
        width = self.g.tensors[x].shape[axis] // ranks

        def sent(r, piece=0, pieces=1):
            return self._block(x, axis, width, r, ranks, piece, pieces)

        def received(r, piece=0, pieces=1):
            return self._block(out, axis, width, r, ranks, piece, pieces)
        self.emit(Opcode.COPY, [sent(rank)], [received(rank)], {}, node.layer)
        for number, phase in enumerate(a["group"].all_to_all(rank)):
            self._phase(node, phase, number, sent, received, width)

    def allreduce(self, node: Node) -> None:
        """An all-reduce of this chip's partial sums (a row-split product's), over blocks of the last axis: the
        group's reduce-scatter, then its all-gather of the summed blocks
        (:meth:`~.parallel.collectives.Group.all_reduce`).

        A row-split product's partial sums arrive with their columns rotated by the rank (their block ``j``
        is block ``rank + j``), so that in a ring or a direct exchange every chip touches the same addresses at
        the same step; others (an expert's, ``rotated=False``) are in place, and the one schedule honours every
        rank's addresses. Peers' partial sums land in the output's other blocks (scratch: the all-gather
        overwrites them)."""
        a = node.attrs
        partial, out = node.inputs[0], node.output
        rank, ranks, group = a["rank"], a["ranks"], a["group"]
        axis = len(self.g.tensors[out].shape) - 1
        width = self.g.tensors[out].shape[axis] // ranks
        turn = rank if a.get("rotated", True) else 0  # (partial sums made in place, an expert's, are not)

        def block(r, piece=0, pieces=1):
            return self._block(out, axis, width, r, ranks, piece, pieces)

        def mine(r, piece=0, pieces=1):  # global block r of the (rotated) partial sums
            return self._block(partial, axis, width, r - turn, ranks, piece, pieces)

        if group.one_shot(self.g.tensors[out].nbytes):
            self._one_shot(node, partial, out)
            return
        scatter, owned, gather = group.all_reduce(rank)
        for number, phase in enumerate(scatter):
            self._phase(node, phase, number, mine, block, width, mine)
        self.emit(Opcode.COPY, [mine(owned)], [block(owned)], {}, node.layer)
        for number, phase in enumerate(gather, len(scatter)):
            self._phase(node, phase, number, block, block, width)

    def _one_shot(self, node: Node, partial: int, out: int) -> None:
        """A one-shot all-reduce (:meth:`~.parallel.collectives.Group.one_shot`): at each level, this chip's
        sums so far go whole to every peer (cut into a piece a link along the last axis) and the peers' land in
        scratch tensors; then all are added as a tree, in place, the last sum into the output.

        Across a grid of nodes the columns go two ways at once: the first half within the node and then across
        the nodes, the second half across and then within. Each kind of link then carries half the bytes at
        each level, and is free for the other half's second level by the time it comes (one way, the links
        across the nodes, fewer a pair, would carry all of it and the links within the node would wait)."""
        g, a = self.g, node.attrs
        group, rank = a["group"], a["rank"]
        shape, dtype = g.tensors[out].shape, g.tensors[out].dtype
        axis, n = len(shape) - 1, shape[-1]
        levels = group.one_shot_stages(rank)
        scratch = [g.add_tensor(shape, dtype) for _ in range(max(len(level) for level in levels))]
        per_piece = max(group.ranks, group.links)
        routes = [(0, n, levels)] if len(levels) == 1 or n < 2 else [
            (0, n // 2, levels), (n // 2, n, levels[::-1])]

        def columns(t, lo, hi):
            return view(g, t, ranges=[(0, d) for d in shape[:axis]] + [(lo, hi)])
        for r, (lo, hi, order) in enumerate(routes):
            have = partial
            for number, level in enumerate(order):
                for e, (to, to_ports, frm, frm_ports) in enumerate(level):
                    split = min(len(to_ports), hi - lo)
                    for j in range(split):
                        tag = a["tag"] + ((r * len(levels) + number) * group.ranks + e) * per_piece + j
                        piece = (lo + j * (hi - lo) // split, lo + (j + 1) * (hi - lo) // split)
                        self.emit(Opcode.SEND, [columns(have, *piece)], [], {"peer": to, "tag": tag}, node.layer,
                                  to_ports[j])
                        self.emit(Opcode.RECV, [], [columns(scratch[e], *piece)], {"peer": frm, "tag": tag},
                                  node.layer, frm_ports[j % len(frm_ports)])
                last = number == len(order) - 1
                add_tree(self.emit, [columns(have, lo, hi)] + [columns(scratch[e], lo, hi) for e in range(len(level))],
                         node.layer, into=columns(out if last else have, lo, hi))

    def broadcast(self, node: Node) -> None:
        """One COPY from a view of the input that repeats it (stride 0) along the axes it broadcasts."""
        g = self.g
        out = g.tensors[node.output].shape
        shape = g.tensors[node.inputs[0]].shape
        shape = (1,) * (len(out) - len(shape)) + tuple(shape)
        dense = dense_strides(shape)
        strides = tuple(0 if d == 1 and o != 1 else st for d, o, st in zip(shape, out, dense))
        self.emit(Opcode.COPY, [Operand(node.inputs[0], out, 0, strides)], [whole(g, node.output)], {}, node.layer)

    def narrow(self, node: Node) -> None:
        """The leading columns (along ``axis``) of a padded tensor: an uneven split's all-gather, unpadded."""
        g, axis = self.g, node.attrs["axis"]
        full = g.tensors[node.output].shape
        src = view(g, node.inputs[0], ranges=[(0, d) for d in full[:axis + 1]])
        self.emit(Opcode.COPY, [src], [whole(g, node.output)], {}, node.layer)

    # ---- everything else -------------------------------------------------
    def transfer(self, node: Node) -> None:
        """A pipeline's SEND or RECV of a whole tensor to or from another chip."""
        g = self.g
        link = {"peer": node.attrs["peer"], "tag": node.attrs["tag"]}
        srcs, dsts = ([whole(g, node.inputs[0])], []) if node.kind == NodeKind.SEND else ([], [whole(g, node.output)])
        self.emit(Opcode[node.kind.upper()], srcs, dsts, link, node.layer, node.attrs["port"])

    @property
    def by_kind(self) -> dict:
        """How each compound kind is tiled but the products (whose tiling takes what the whole graph decided);
        any other kind is one instruction (:meth:`single`)."""
        return {NodeKind.CONV2D: self.conv2d, NodeKind.QCONV2D: self.conv2d, NodeKind.ALLGATHER: self.allgather,
                NodeKind.ALLREDUCE: self.allreduce, NodeKind.ALLTOALL: self.alltoall,
                NodeKind.BROADCAST: self.broadcast, NodeKind.NARROW: self.narrow, NodeKind.SEND: self.transfer,
                NodeKind.RECV: self.transfer}

    def single(self, node: Node) -> None:
        # a single-instruction node's attributes are named as the op table names them
        g, opcode = self.g, Opcode[node.kind]
        out = g.tensors[node.output]
        group = OP_TABLE[opcode].group
        attrs = make_attrs(opcode, node.attrs)
        if group == Group.WINDOW and len(out.shape) == 4:
            self.banded_window(opcode, node.inputs[0], node.output, out.shape, attrs, node.layer)
            return
        if _row_bandable(g, node, opcode, attrs):
            self.vector_chain([node])
            return
        self.emit(opcode, [whole(g, t) for t in node.inputs], [whole(g, node.output)], attrs, node.layer)

    def vector_chain(self, nodes: list) -> None:
        """Row-bandable vector ops, each reading the one before (:func:`_vector_chains`), band by band: within
        a band each op's result streams straight into the next, and only the last one's is stored."""
        g = self.g
        shape = g.tensors[nodes[0].output].shape
        biggest = max(g.tensors[t].nbytes for node in nodes for t in node.inputs + [node.output])
        # products read their operands matrix by matrix (a head's scores, then the next head's): bands then
        # run through the leading axes' rows in order, so a product starts on the first whole matrix; a
        # window reads every channel's rows, so bands of rows cut across the leading axes
        readers = self.readers.get(g.base(nodes[-1].output), ())
        flat = bool(readers) and all(kind in PRODUCTS for kind in readers)
        lead = prod(shape[:-2]) if flat else 1
        seen = (1,) * (len(shape) - 2) + (lead * shape[-2], shape[-1]) if flat else shape
        for h0, h1 in row_bands(seen[-2], biggest, BAND_BYTES):
            def band(t):
                if g.tensors[t].shape != shape:  # broadcast along the rows: all of it, every band
                    return whole(g, t)
                return view(g, t, seen, ranges=[(0, d) for d in seen[:-2]] + [(h0, h1)])
            carried = None  # (the previous op's output, the stream it is on)
            for k, node in enumerate(nodes):
                opcode = Opcode[node.kind]
                srcs = [carried[1] if carried and g.base(t) == carried[0] else band(t) for t in node.inputs]
                dst = band(node.output)
                if k < len(nodes) - 1:
                    dst = stream(self.new_chain(), dst.shape, g.tensors[node.output].dtype)
                self.emit(opcode, srcs, [dst], make_attrs(opcode, node.attrs), node.layer)
                carried = (g.base(node.output), dst)

    def banded_window(self, opcode, x: int, out: int, out_shape: tuple, attrs: dict, layer: str) -> None:
        """A window op (pooling, im2col) in bands of output rows, each reading its input rows and halo.

        ``out_shape`` is ``(N, C, OH, OW)`` for pooling, ``(N, G, K, OH, OW)`` for im2col's columns.
        """
        g = self.g
        n, c, h, w = g.tensors[x].shape
        oh = out_shape[-2]
        (kh, _), (sh, _), (dh, _) = attrs["kernel"], attrs["stride"], attrs["dilation"]
        pt, pl, pb, pr = attrs["pad"]
        for o0, o1 in row_bands(oh, max(g.tensors[out].nbytes, g.tensors[x].nbytes), BAND_BYTES):
            i0, i1, top, bottom = window_rows(o0, o1, h, kh, sh, dh, pt)
            src = view(g, x, ranges=[(0, n), (0, c), (i0, i1)])
            dst = view(g, out, out_shape, ranges=[(0, s) for s in out_shape[:-2]] + [(o0, o1)])
            if opcode == Opcode.IM2COL:  # the columns of those rows: [N, G, K, rows·OW]
                dst = Operand(dst.tensor, out_shape[:3] + ((o1 - o0) * out_shape[-1],), dst.offset,
                              None if (o0, o1) == (0, oh) else dst.strides[:3] + (1,))
            self.emit(opcode, [src], [dst], {**attrs, "pad": (top, pl, bottom, pr)}, layer)

    def load(self, index: int, tid: int) -> None:
        """LOAD a network input; a big one in bands of rows (the second-last axis) per leading index, so the
        first layer starts on the first rows."""
        self._host_bands(Opcode.LOAD, index, tid)

    def store(self, index: int, tid: int) -> None:
        """STORE a network output; a big one in bands of rows, each as soon as its rows are made."""
        self._host_bands(Opcode.STORE, index, tid)

    def _host_bands(self, opcode, index: int, tid: int) -> None:
        g = self.g
        t = g.tensors[tid]
        bands = row_bands(t.shape[-2], t.nbytes, HOST_BAND_BYTES) if len(t.shape) >= 2 else []

        loading = opcode == Opcode.LOAD
        # the layer names the tensor: its place among the function's inputs or outputs, and its shape
        name = f"{'load input' if loading else 'store output'} {index} [{', '.join(map(str, t.shape))}]"

        def move(ref, attrs):  # a LOAD writes the SRAM ref, a STORE reads it
            srcs, dsts = ([], [ref]) if loading else ([ref], [])
            self.emit(opcode, srcs, dsts, attrs, name)
        if len(bands) < 2:
            move(whole(g, tid), {"index": index})
            return
        lead, rows, cols = prod(t.shape[:-2]), t.shape[-2], t.shape[-1]
        item = t.dtype.itemsize
        for h0, h1 in bands:
            for plane in range(lead):
                move(view(g, tid, (lead, rows, cols), (plane,), [(h0, h1)]),
                     {"index": index, "offset": (plane * rows + h0) * cols * item})


def _row_bandable(g: Graph, node: Node, opcode: Opcode, attrs: dict) -> bool:
    """Can this op run in bands of rows (the second-last axis), so the next op starts on the first ones?
    Elementwise ops, and a softmax or layer norm over the last axis alone; every operand the output's shape,
    or one that broadcasts along the rows (a vector of the last axis)."""
    shape = g.tensors[node.output].shape
    group = OP_TABLE[opcode].group
    if len(shape) < 2:
        return False
    if group == Group.NORM:
        last = attrs["axis"] == len(shape) - 1 if opcode == Opcode.SOFTMAX else attrs.get("n_axes") == 1
        if not last:
            return False
    elif group not in _BANDED_GROUPS:
        return False
    for t in node.inputs:
        other = g.tensors[t].shape
        if other != shape and (len(other) > 1 and prod(other[:-1]) != 1):
            return False
    return True


def _vector_chains(g: Graph, config: ChipConfig, skip=frozenset()) -> list:
    """Runs of row-bandable vector ops (node indexes, two or more) in which each op reads the one before and
    nothing else reads it: the ops of a run pass each band along streams, ALU to ALU, without SRAM between
    them (GELU's erf, its QDQ pairs, a layer norm's dequantise and requantise). Where an op could continue
    two runs it continues the longer. A run holds a vector queue per op: it takes at most what the planes'
    epilogues leave of them."""
    uses = g.uses()
    kept = {g.base(t) for t in g.outputs} | set(g.state)  # stored, or resident: never only on a stream
    made_by = {node.output: j for j, node in enumerate(g.nodes)}
    longest = config.unit_count("VXM") - config.mxm_planes
    run_of, continued = {}, set()  # node ─► the run it ends; nodes a later op continues
    for i, node in enumerate(g.nodes):
        if i in skip or node.kind not in Opcode.__members__:
            continue
        opcode = Opcode[node.kind]
        if not _row_bandable(g, node, opcode, make_attrs(opcode, node.attrs)):
            continue
        shape = g.tensors[node.output].shape
        best = None
        for t in node.inputs:
            j = made_by.get(g.base(t))
            if j is None or j not in run_of or j in continued or uses.get(g.base(t)) != 1 \
                    or g.base(t) in kept or g.tensors[t].shape != shape \
                    or g.tensors[g.nodes[j].output].shape != shape or len(run_of[j]) >= longest:
                continue
            if best is None or len(run_of[j]) > len(run_of[best]):
                best = j
        if best is None:
            run_of[i] = [i]
        else:
            continued.add(best)
            run_of[i] = run_of[best] + [i]
    return [run for i, run in run_of.items() if i not in continued and len(run) > 1]


def _per_row(g, tid, groups, rows, group, m0, m1, transposed) -> Operand:
    """A per-output-channel vector (bias, requant) for channels m0..m1 of a group, shaped for its block."""
    v = view(g, tid, (groups, rows), (group,), [(m0, m1)])
    return Operand(v.tensor, (1, m1 - m0) if transposed else (m1 - m0, 1), v.offset)


def _per_column(g, tid, n, n0, n1, transposed) -> Operand:
    """A per-output-column vector (a matmul's bias) for columns n0..n1, shaped for its block."""
    v = view(g, tid, (n,), ranges=[(n0, n1)])
    return Operand(v.tensor, (n1 - n0, 1) if transposed else (1, n1 - n0), v.offset)


def _streamable(g: Graph, node: Node, config: ChipConfig) -> int | None:
    """Column-block width for streaming this matmul's weight, or None when it cannot stream."""
    if node.kind not in PRODUCTS or not g.is_constant(node.inputs[1]) \
            or len(g.tensors[node.inputs[1]].shape) != 2:
        return None
    k, n = g.tensors[node.inputs[1]].shape
    for extra in node.inputs[2:]:  # bias (and int8's requantisation scale): one value per column
        shape = g.tensors[extra].shape
        if not shape or shape[-1] != n or prod(shape[:-1]) != 1:
            return None
    itemsize = g.tensors[node.inputs[1]].dtype.itemsize
    fits = stream_tile_bytes(config) // (k * itemsize)  # columns of one block
    if fits < 1:
        return None
    # whole column tiles of the array where they fit, else as many columns as fit
    return min(n, fits // config.mxm_cols * config.mxm_cols or fits)


def _weights_to_stream(g: Graph, config: ChipConfig, resident_budget: int) -> dict:
    """matmul node index -> block width, largest weights first, until resident weights fit the budget."""
    resident = {g.base(t) for node in g.nodes for t in node.inputs if g.is_constant(g.base(t))}
    total = sum(g.tensors[t].nbytes for t in resident)
    widths = {i: width for i, node in enumerate(g.nodes) if (width := _streamable(g, node, config))}
    chosen = {}
    for i in sorted(widths, key=lambda i: g.tensors[g.nodes[i].inputs[1]].nbytes, reverse=True):
        if total <= resident_budget:
            break
        chosen[i] = widths[i]
        total -= g.tensors[g.nodes[i].inputs[1]].nbytes
    return chosen


def _chained_softmaxes(g: Graph, config: ChipConfig) -> dict:
    """matmul node index -> the SOFTMAX over its columns that can run chained from its epilogues: the
    product's only reader, its output nowhere else, the columns within one tile of the array."""
    readers = {}
    for j, node in enumerate(g.nodes):
        for t in node.inputs:
            readers.setdefault(g.base(t), []).append(j)
    outputs = {g.base(t) for t in g.outputs}
    chained = {}
    for i, node in enumerate(g.nodes):
        out = g.tensors[node.output]
        if node.kind != NodeKind.MATMUL or node.output in outputs or len(readers.get(node.output, ())) != 1 \
                or out.shape[-1] > config.mxm_cols or g.tensors[node.inputs[0]].shape[-2] != out.shape[-2]:
            continue
        (j,) = readers[node.output]
        reader = g.nodes[j]
        if reader.kind == "SOFTMAX" and reader.inputs == [node.output] and reader.attrs["axis"] == len(out.shape) - 1:
            chained[i] = reader
    return chained


def _transposes_read_in_place(g: Graph, skip) -> dict:
    """Matmuls whose B is a TRANSPOSE of the last two axes read by nothing else (attention's ``K^T``, made
    afresh every decode step from the cache): node index -> (the TRANSPOSE's index, the transposed tensor). The
    matrix planes install their tiles from the transposed view as they install a stationary A's, so the SXM's
    copy is not made."""
    producer = {node.output: j for j, node in enumerate(g.nodes)}
    uses = g.uses()  # reads by base tensor, graph outputs included: an alias read elsewhere counts too
    folded = {}
    for i, node in enumerate(g.nodes):
        if node.kind not in PRODUCTS or i in skip or len(node.inputs) < 2:
            continue
        j = producer.get(node.inputs[1])
        if j is None or g.nodes[j].kind != "TRANSPOSE" or uses.get(node.inputs[1]) != 1:
            continue
        rank, perm = len(g.tensors[node.inputs[1]].shape), tuple(g.nodes[j].attrs.get("perm", ()))
        if perm == tuple(range(rank - 2)) + (rank - 1, rank - 2):
            folded[i] = (j, g.nodes[j].inputs[0])
    return folded


def tile(g: Graph, config: ChipConfig, resident_budget: int | None = None) -> list:
    """The tile ops of a graph, in program order.

    ``resident_budget`` caps the bytes of resident weights; the largest
    streamable weights beyond it are streamed. None: every weight is resident
    (the stages choose a budget from what the activations need, :func:`.stages.budgets`).

    Returns
    -------
    list of TileOp
        LOADs of the inputs, the operators' tiles, STOREs of the outputs.
    """
    tiler = _Tiler(g, config)
    for i, t in enumerate(g.inputs):
        if g.base(t) not in g.state:  # resident state is in SRAM already
            tiler.load(i, t)
    g.streamed = []
    streamed = {} if resident_budget is None else _weights_to_stream(g, config, resident_budget)
    chained = {i: softmax for i, softmax in _chained_softmaxes(g, config).items() if i not in streamed}
    done = {id(softmax) for softmax in chained.values()}
    # a run is tiled where its last op is: every op in it reads only what is made before that
    runs = {run[-1]: run for run in _vector_chains(g, config, {j for j, n in enumerate(g.nodes) if id(n) in done})}
    done |= {id(g.nodes[j]) for run in runs.values() for j in run[:-1]}
    in_place = _transposes_read_in_place(g, set(streamed))  # (a vector chain holds no matmul)
    done |= {id(g.nodes[j]) for j, _ in in_place.values()}
    for i, node in enumerate(g.nodes):
        if id(node) in done:
            continue
        if i in runs:
            tiler.vector_chain([g.nodes[j] for j in runs[i]])
            continue
        if node.kind in PRODUCTS:
            tiler.matmul(node, streamed.get(i), chained.get(i), in_place.get(i, (None, None))[1])
        else:
            tiler.by_kind.get(node.kind, tiler.single)(node)
    for i, t in enumerate(g.outputs):
        tiler.store(i, t)
    return tiler.ops
