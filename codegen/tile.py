"""tile: split each operator into instructions that fit the units.

A convolution becomes an IM2COL on the switch unit (skipped for 1x1 stride-1
convolutions, whose input already is the matrix) and MATMULs on the matrix
planes; a depthwise convolution is one DWCONV on the vector unit instead,
since expanding it by im2col costs k² times its input for a matrix-vector
product per channel. Large matrix products are split by output rows into one tile per plane
so the planes work in parallel; every tile is a contiguous slice, so it is an
ordinary SRAM operand.

Weights are resident, unless together they would take more than a budget
(half of SRAM, less when the activations do not fit beside them):
then the largest matrix-product weights, largest first, stay in host memory and
are streamed in column tiles (STREAM on the host link, then a MATMUL per tile)
each time they are used. That is slow, bounded by the host link, and the cost
model says so; but the layer runs on lpx instead of falling back.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import numpy as np

from ..runtime_sim import ChipConfig, Opcode
from .graph import Graph, Node


@dataclass(frozen=True)
class Operand:
    """A contiguous piece of a graph tensor: ``offset`` bytes into its base tensor."""

    tensor: int
    shape: tuple
    offset: int = 0


@dataclass
class TileOp:
    opcode: Opcode
    srcs: list
    dsts: list
    attrs: dict  # named, as the op table defines them
    layer: str


def _whole(g: Graph, tid: int, shape=None) -> Operand:
    return Operand(tid, tuple(shape or g.tensors[tid].shape))


def _row_tiles(rows: int, config: ChipConfig) -> list:
    """Split ``rows`` output rows into up to one tile per matrix plane."""
    n = min(config.mxm_planes, rows // config.mxm_rows) if rows >= 2 * config.mxm_rows else 1
    step = -(-rows // max(n, 1))
    step = -(-step // config.mxm_rows) * config.mxm_rows
    return [(r, min(r + step, rows)) for r in range(0, rows, step)]


def _epilogue(node: Node) -> dict:
    return {"act": node.attrs["act"], "act_args": tuple(node.attrs["act_args"])}


def _matmul_attrs(node: Node, weight_first: bool) -> dict:
    """Float MATMUL: the epilogue; int8 MATMUL: the epilogue and the zero points of a, b and out.

    ``weight_first``: the weight is operand a (convolutions), else b (matrix products).
    """
    if not node.kind.startswith("q"):
        return _epilogue(node)
    zp_x, zp_w = node.attrs["zp_in"], node.attrs["zp_w"]
    zp_a, zp_b = (zp_w, zp_x) if weight_first else (zp_x, zp_w)
    return {**_epilogue(node), "zp_a": zp_a, "zp_b": zp_b, "zp_out": node.attrs["zp_out"]}


def _matmul_tiles(g, node, a: Operand, b: Operand, out: Operand, extras: list, config, per_row: bool, attrs):
    """MATMUL tiles split by the rows of ``a``/``out`` (only when they have no batch).

    ``extras`` (bias, and the requantisation scale of int8) are sliced with the
    rows when ``per_row`` (a convolution's output channels), else shared.
    """
    a_shape, out_shape = a.shape, out.shape
    rows = a_shape[-2]
    if prod(a_shape[:-2]) != 1 or prod(out_shape[:-2]) != 1:
        tiles = [(0, rows)]
    else:
        tiles = _row_tiles(rows, config)
    a_item, out_item = (g.tensors[g.base(t.tensor)].dtype.itemsize for t in (a, out))
    ops = []
    for r0, r1 in tiles:
        n = r1 - r0
        ta = Operand(a.tensor, a_shape[:-2] + (n, a_shape[-1]), a.offset + r0 * a_shape[-1] * a_item)
        to = Operand(out.tensor, out_shape[:-2] + (n, out_shape[-1]), out.offset + r0 * out_shape[-1] * out_item)
        srcs = [ta, b]
        for extra in extras:
            if per_row:
                item = g.tensors[g.base(extra.tensor)].dtype.itemsize
                srcs.append(Operand(extra.tensor, extra.shape[:-2] + (n, 1), extra.offset + r0 * item))
            else:
                srcs.append(extra)
        ops.append(TileOp(Opcode.MATMUL, srcs, [to], attrs, node.layer))
    return ops


def _conv2d(g: Graph, node: Node, config: ChipConfig) -> list:
    x, w = node.inputs[0], node.inputs[1]
    n, c, h, wd = g.tensors[x].shape
    oc, cg, kh, kw = g.tensors[w].shape
    _, _, oh, ow = g.tensors[node.output].shape
    groups = node.attrs["groups"]
    k, p, ocg = cg * kh * kw, oh * ow, oc // groups
    (sh, sw), (dh, dw) = node.attrs["strides"], node.attrs["dilation"]
    pads = tuple(node.attrs["padding"])
    window = {"kernel": (kh, kw), "stride": (sh, sw), "pad": pads, "dilation": (dh, dw)}
    if groups == c == oc:  # depthwise: per-channel taps on the vector unit, no 9-25x im2col blow-up
        srcs = [_whole(g, x), _whole(g, w, (c, kh, kw))] + [_whole(g, t, (c, 1, 1)) for t in node.inputs[2:]]
        tail = _epilogue(node)
        if node.kind == "qconv2d":
            tail.update(zp_in=node.attrs["zp_in"], zp_out=node.attrs["zp_out"])
        return [TileOp(Opcode.DWCONV, srcs, [_whole(g, node.output)], {**window, **tail}, node.layer)]
    ops = []
    if (kh, kw, sh, sw) == (1, 1, 1, 1) and not any(pads):
        cols = _whole(g, x, (n, groups, k, p))
    else:
        cols_id = g.add_tensor((n, groups, k, p), g.tensors[x].dtype)
        cols = _whole(g, cols_id)
        # int8 pads with the input zero point: the padded value must dequantise to 0
        ops.append(TileOp(Opcode.IM2COL, [_whole(g, x)], [cols],
                          {**window, "groups": groups, "pad_value": node.attrs.get("zp_in", 0)}, node.layer))
    weight = _whole(g, w, (groups, ocg, k))
    out = _whole(g, node.output, (n, groups, ocg, p))
    extras = [_whole(g, t, (groups, ocg, 1)) for t in node.inputs[2:]]
    attrs = _matmul_attrs(node, weight_first=True)
    # the weight is the row operand: its rows are output channels, contiguous in NCHW when n == groups == 1
    if n == 1 and groups == 1:
        return ops + _matmul_tiles(g, node, weight, cols, out, extras, config, True, attrs)
    return ops + [TileOp(Opcode.MATMUL, [weight, cols] + extras, [out], attrs, node.layer)]


def stream_tile_bytes(config: ChipConfig) -> int:
    """The most bytes one streamed weight tile may take (two are in flight at once)."""
    return config.sram_bytes // 16


def _streamable(g: Graph, node: Node, config: ChipConfig) -> int | None:
    """Column-tile width for streaming this matmul's weight, or None when it cannot stream."""
    if node.kind not in ("matmul", "qmatmul") or not g.is_constant(node.inputs[1]) \
            or len(g.tensors[node.inputs[1]].shape) != 2:
        return None
    a_shape, (k, n) = g.tensors[node.inputs[0]].shape, g.tensors[node.inputs[1]].shape
    if prod(a_shape[:-2]) != 1:
        return None
    for extra in node.inputs[2:]:  # bias (and int8's requantisation scale): one value per column
        shape = g.tensors[extra].shape
        if not shape or shape[-1] != n or prod(shape[:-1]) != 1:
            return None
    itemsize = g.tensors[node.inputs[1]].dtype.itemsize
    widths = [d for d in range(1, n + 1) if n % d == 0 and k * d * itemsize <= stream_tile_bytes(config)]
    return max(widths) if widths else None


def _weights_to_stream(g: Graph, config: ChipConfig, resident_budget: int) -> dict:
    """matmul node index -> tile width, largest weights first, until resident weights fit the budget."""
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


def _streamed_matmul(g: Graph, node: Node, width: int) -> list:
    """STREAM each column tile of the weight, MATMUL it; M > 1 gathers the tiles with one TRANSPOSE."""
    a, w = node.inputs[0], node.inputs[1]
    m = g.tensors[a].shape[-2]
    weight = g.tensors[g.base(w)].data.reshape(g.tensors[w].shape)
    n = weight.shape[1]
    tiles = n // width
    itemsize = g.tensors[node.output].dtype.itemsize
    dtype = g.tensors[w].dtype
    gathered = g.add_tensor((tiles, m, width), g.tensors[node.output].dtype) if m > 1 else None
    ops = []
    for t in range(tiles):
        g.streamed.append(np.ascontiguousarray(weight[:, t * width:(t + 1) * width]))
        buffer = g.add_tensor((weight.shape[0], width), dtype)
        ops.append(TileOp(Opcode.STREAM, [], [_whole(g, buffer)], {"index": len(g.streamed) - 1}, node.layer))
        srcs = [Operand(a, (m, weight.shape[0])), _whole(g, buffer)]
        for extra in node.inputs[2:]:
            srcs.append(Operand(extra, (width,), t * width * g.tensors[g.base(extra)].dtype.itemsize))
        out = (Operand(gathered, (m, width), t * m * width * itemsize) if gathered is not None
               else Operand(node.output, (1, width), t * width * itemsize))
        ops.append(TileOp(Opcode.MATMUL, srcs, [out], _matmul_attrs(node, weight_first=False), node.layer))
    if gathered is not None:
        ops.append(TileOp(Opcode.TRANSPOSE, [_whole(g, gathered)], [_whole(g, node.output, (m, tiles, width))],
                          {"perm": (1, 0, 2)}, node.layer))
    return ops


def _matmul(g: Graph, node: Node, config: ChipConfig) -> list:
    a, b = (_whole(g, t) for t in node.inputs[:2])
    extras = [_whole(g, t) for t in node.inputs[2:]]
    attrs = _matmul_attrs(node, weight_first=False)
    return _matmul_tiles(g, node, a, b, _whole(g, node.output), extras, config, False, attrs)


def tile(g: Graph, config: ChipConfig, resident_budget: int | None = None) -> list:
    """The instruction templates of a graph, in program order.

    ``resident_budget`` (default: half of SRAM) caps the bytes of resident
    weights; the largest streamable weights beyond it are streamed.

    Returns
    -------
    list of TileOp
        LOADs of the inputs, the operators' tiles, STOREs of the outputs.
    """
    ops = [TileOp(Opcode.LOAD, [], [_whole(g, t)], {"index": i}, "load") for i, t in enumerate(g.inputs)]
    g.streamed = []
    budget = config.sram_bytes // 2 if resident_budget is None else resident_budget
    streamed = _weights_to_stream(g, config, budget)
    for i, node in enumerate(g.nodes):
        if i in streamed:
            ops += _streamed_matmul(g, node, streamed[i])
        elif node.kind in ("conv2d", "qconv2d"):
            ops += _conv2d(g, node, config)
        elif node.kind in ("matmul", "qmatmul"):
            ops += _matmul(g, node, config)
        else:
            # a single-instruction node's attributes are named as the op table names them
            ops.append(TileOp(Opcode[node.kind], [_whole(g, t) for t in node.inputs],
                              [_whole(g, node.output)], dict(node.attrs), node.layer))
    ops += [TileOp(Opcode.STORE, [_whole(g, t)], [], {"index": i}, "store") for i, t in enumerate(g.outputs)]
    return ops


