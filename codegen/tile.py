"""tile: split each operator into instructions that fit the units.

A convolution becomes an IM2COL on the switch unit (skipped for 1x1 stride-1
convolutions, whose input already is the matrix) and MATMULs on the matrix
planes; a depthwise convolution is one DWCONV on the vector unit instead,
since expanding it by im2col costs k² times its input for a matrix-vector
product per channel. Large matrix products are split by output rows into one tile per plane
so the planes work in parallel; every tile is a contiguous slice, so it is an
ordinary SRAM operand.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod


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
    attrs: tuple
    layer: str


def _whole(g: Graph, tid: int, shape=None) -> Operand:
    return Operand(tid, tuple(shape or g.tensors[tid].shape))


def _row_tiles(rows: int, config: ChipConfig) -> list:
    """Split ``rows`` output rows into up to one tile per matrix plane."""
    n = min(config.mxm_planes, rows // config.mxm_rows) if rows >= 2 * config.mxm_rows else 1
    step = -(-rows // max(n, 1))
    step = -(-step // config.mxm_rows) * config.mxm_rows
    return [(r, min(r + step, rows)) for r in range(0, rows, step)]


def _epilogue(node: Node) -> tuple:
    lo, hi = node.attrs["act_args"]
    return (float(node.attrs["act"]), float(lo), float(hi))


def _matmul_tiles(g, node, a: Operand, b: Operand, out: Operand, bias: Operand | None, config, row_axis_bytes):
    """MATMUL tiles split by the rows of ``a``/``out`` (only when they have no batch)."""
    a_shape, out_shape = a.shape, out.shape
    rows = a_shape[-2]
    if prod(a_shape[:-2]) != 1 or prod(out_shape[:-2]) != 1:
        tiles = [(0, rows)]
    else:
        tiles = _row_tiles(rows, config)
    itemsize = g.tensors[node.output].dtype.itemsize
    ops = []
    for r0, r1 in tiles:
        n = r1 - r0
        ta = Operand(a.tensor, a_shape[:-2] + (n, a_shape[-1]), a.offset + r0 * a_shape[-1] * itemsize)
        to = Operand(out.tensor, out_shape[:-2] + (n, out_shape[-1]), out.offset + r0 * out_shape[-1] * itemsize)
        srcs = [ta, b]
        if bias is not None:
            if row_axis_bytes:  # per-row bias (convolution): slice it with the rows
                srcs.append(Operand(bias.tensor, bias.shape[:-2] + (n, 1), bias.offset + r0 * row_axis_bytes))
            else:
                srcs.append(bias)
        ops.append(TileOp(Opcode.MATMUL, srcs, [to], _epilogue(node), node.layer))
    return ops


def _conv2d(g: Graph, node: Node, config: ChipConfig) -> list:
    x, w = node.inputs[0], node.inputs[1]
    n, c, h, wd = g.tensors[x].shape
    oc, cg, kh, kw = g.tensors[w].shape
    _, _, oh, ow = g.tensors[node.output].shape
    groups = node.attrs["groups"]
    k, p, ocg = cg * kh * kw, oh * ow, oc // groups
    (sh, sw), (dh, dw) = node.attrs["strides"], node.attrs["dilation"]
    pt, pl, pb, pr = node.attrs["padding"]
    window = (kh, kw, sh, sw, pt, pl, pb, pr, dh, dw, groups)
    if groups == c == oc:  # depthwise: per-channel taps on the vector unit, no 9-25x im2col blow-up
        srcs = [_whole(g, x), _whole(g, w, (c, kh, kw))]
        if len(node.inputs) > 2:
            srcs.append(_whole(g, node.inputs[2], (c, 1, 1)))
        return [TileOp(Opcode.DWCONV, srcs, [_whole(g, node.output)], window + _epilogue(node), node.layer)]
    ops = []
    if (kh, kw, sh, sw, pt, pl, pb, pr) == (1, 1, 1, 1, 0, 0, 0, 0):
        cols = _whole(g, x, (n, groups, k, p))
    else:
        cols_id = g.add_tensor((n, groups, k, p), g.tensors[x].dtype)
        cols = _whole(g, cols_id)
        ops.append(TileOp(Opcode.IM2COL, [_whole(g, x)], [cols], window, node.layer))
    weight = _whole(g, w, (groups, ocg, k))
    out = _whole(g, node.output, (n, groups, ocg, p))
    bias = _whole(g, node.inputs[2], (groups, ocg, 1)) if len(node.inputs) > 2 else None
    itemsize = g.tensors[node.output].dtype.itemsize
    # the weight is the row operand: its rows are output channels, contiguous in NCHW when n == groups == 1
    if n == 1 and groups == 1:
        return ops + _matmul_tiles(g, node, weight, cols, out, bias, config, itemsize)
    srcs = [weight, cols] + ([bias] if bias else [])
    return ops + [TileOp(Opcode.MATMUL, srcs, [out], _epilogue(node), node.layer)]


def _matmul(g: Graph, node: Node, config: ChipConfig) -> list:
    a, b = (_whole(g, t) for t in node.inputs[:2])
    bias = _whole(g, node.inputs[2]) if len(node.inputs) > 2 else None
    return _matmul_tiles(g, node, a, b, _whole(g, node.output), bias, config, 0)


def _attrs(node: Node) -> tuple:
    a = node.attrs
    if node.kind == "CLIP":
        return (a["lo"], a["hi"])
    if node.kind.startswith("REDUCE_"):
        return tuple(a["axes"])
    if node.kind == "SOFTMAX" or node.kind == "CONCAT":
        return (a["axis"],)
    if node.kind == "LAYERNORM":
        return (a["eps"], a["n_axes"])
    if node.kind in ("MAXPOOL", "AVGPOOL"):
        return tuple(a["window"])
    if node.kind == "TRANSPOSE":
        return tuple(a["perm"])
    return ()


def tile(g: Graph, config: ChipConfig) -> list:
    """The instruction templates of a graph, in program order.

    Returns
    -------
    list of TileOp
        LOADs of the inputs, the operators' tiles, STOREs of the outputs.
    """
    ops = [TileOp(Opcode.LOAD, [], [_whole(g, t)], (i,), "load") for i, t in enumerate(g.inputs)]
    for node in g.nodes:
        if node.kind == "conv2d":
            ops += _conv2d(g, node, config)
        elif node.kind == "matmul":
            ops += _matmul(g, node, config)
        else:
            ops.append(TileOp(Opcode[node.kind], [_whole(g, t) for t in node.inputs],
                              [_whole(g, node.output)], _attrs(node), node.layer))
    ops += [TileOp(Opcode.STORE, [_whole(g, t)], [], (i,), "store") for i, t in enumerate(g.outputs)]
    return ops


