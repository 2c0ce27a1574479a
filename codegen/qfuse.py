"""qfuse: DequantizeLinear ─► conv/matmul ─► QuantizeLinear becomes one int8 operator.

A QDQ model (ONNX Runtime's quantiser) wraps every convolution and matrix
product in dequantise/quantise pairs and stores its weights as integers. Where
the pattern is complete (per-tensor activation scale, integer weights, per-channel
with zero zero-points or per-tensor with any, a single QuantizeLinear reader), the operator runs as int8 × int8
with int32 accumulation on the matrix unit and is requantised on the way out,
exactly as ONNX Runtime's QLinearConv / QLinearMatMul define it:

    y = saturate(rint(float32(Σ (x - zx)·(w - zw) + round(b / (sx·sw))) · sx·sw / sy) + zy)

Depthwise convolutions become int8 DWCONVs on the vector unit, with the same
requantisation. A residual add between dequantised operands becomes QADD (ONNX
Runtime's QLinearAdd), and a max pool between a dequantise and a quantise with
the same parameters runs on the integers (exact). Everything else keeps the
model's own definition: DEQUANTIZE, the float operator, QUANTIZE.
"""

from __future__ import annotations

from math import prod

import numpy as np

from ..runtime_sim import Opcode
from .graph import Graph, Node

_INT_DTYPES = (np.dtype(np.int8), np.dtype(np.uint8))


def _single_reader(g: Graph, tid: int) -> Node | None:
    readers = [n for n in g.nodes if any(g.base(t) == g.base(tid) for t in n.inputs)]
    if len(readers) != 1 or tid in g.outputs:
        return None
    return readers[0]


def _weight_integers(g: Graph, node: Node):
    """(integer weight, per-output-channel scale, zero point) of a quantised weight.

    Per-channel weights need zero zero-points; a per-tensor weight may have any.
    """
    info = g.quantized.get(node.inputs[1])
    if info is None:
        return None
    q, scale, zero_point = info
    if q.dtype != np.int8 or (zero_point.size > 1 and np.any(zero_point != 0)):
        return None
    out_axis = 0 if node.kind == "conv2d" else q.ndim - 1
    if any(d != 1 for i, d in enumerate(scale.shape) if i != out_axis):
        return None
    channels = q.shape[out_axis]
    return q, np.broadcast_to(scale.reshape(-1), (channels,)).astype(np.float64), int(zero_point.reshape(-1)[0])


def _fuse_one(g: Graph, node: Node, producers: dict) -> bool:
    if node.kind not in ("conv2d", "matmul") or node.attrs["act"] not in (Opcode.NOP, Opcode.RELU):
        return False
    dequant = producers.get(node.inputs[0])
    quant = _single_reader(g, node.output)
    weight = _weight_integers(g, node)
    if dequant is None or dequant.kind != "DEQUANTIZE" or quant is None or quant.kind != "QUANTIZE" or weight is None:
        return False
    if g.tensors[node.inputs[0]].shape != g.tensors[dequant.inputs[0]].shape:
        return False
    w_q, w_scale, zp_w = weight
    depthwise = node.kind == "conv2d" and node.attrs["groups"] == g.tensors[node.inputs[0]].shape[1] > 1
    if zp_w and depthwise:  # DWCONV's int8 form takes symmetric weights only
        return False
    sx, zx = dequant.attrs["scale"], dequant.attrs["zero_point"]
    sy, zy = quant.attrs["scale"], quant.attrs["zero_point"]
    accumulator_scale = sx * w_scale  # float64: the bias scale ONNX Runtime's quantiser uses
    channels = w_scale.size
    if len(node.inputs) > 2:
        bias = g.tensors[g.base(node.inputs[2])].data.reshape(-1).astype(np.float64)
        bias = np.broadcast_to(bias, (channels,))
    else:
        bias = np.zeros(channels)
    bias_q = np.rint(bias / accumulator_scale).astype(np.int32)
    requant = (accumulator_scale / sy).astype(np.float32)
    shape = (-1, 1) if node.kind == "conv2d" else (-1,)
    node.kind = f"q{node.kind}"
    node.inputs = [dequant.inputs[0], g.constant(w_q), g.constant(bias_q.reshape(shape)),
                   g.constant(requant.reshape(shape))]
    node.attrs.update(zp_in=int(zx), zp_out=int(zy), zp_w=zp_w)
    node.output = quant.output
    node.layer = f"{node.layer}+quantize"
    g.nodes.remove(quant)
    return True


def _drop_dead(g: Graph) -> None:
    live = {g.base(t) for t in g.outputs}
    kept = []
    for node in reversed(g.nodes):
        if g.base(node.output) in live:
            kept.append(node)
            live.update(g.base(t) for t in node.inputs)
    g.nodes[:] = kept[::-1]


def _quantized_reader(g: Graph, tid: int):
    """(QUANTIZE node, activation) reading ``tid``, directly or through one RELU; else (None, None)."""
    reader = _single_reader(g, tid)
    if reader is not None and reader.kind == "RELU":
        after = _single_reader(g, reader.output)
        return (after, Opcode.RELU) if after is not None and after.kind == "QUANTIZE" else (None, None)
    return (reader, Opcode.NOP) if reader is not None and reader.kind == "QUANTIZE" else (None, None)


def _fuse_add(g: Graph, node: Node, producers: dict) -> bool:
    """DQ(a) + DQ(b) ─► [RELU ─►] Q becomes QADD(a, b): ONNX Runtime's QLinearAdd."""
    if node.kind != "ADD":
        return False
    dequants = [producers.get(t) for t in node.inputs]
    if any(d is None or d.kind != "DEQUANTIZE" for d in dequants):
        return False
    quant, act = _quantized_reader(g, node.output)
    if quant is None:
        return False
    (a, b), q = dequants, quant.attrs
    node.kind = "QADD"
    node.inputs = [a.inputs[0], b.inputs[0]]
    node.attrs = {"scale_a": a.attrs["scale"], "zp_a": a.attrs["zero_point"], "scale_b": b.attrs["scale"],
                  "zp_b": b.attrs["zero_point"], "scale_out": q["scale"], "zp_out": q["zero_point"], "act": act}
    node.output = quant.output
    node.layer = f"{node.layer}+quantize"
    g.nodes.remove(quant)  # a RELU in between now reads a tensor nobody writes: it is dropped as dead
    return True


_MOVES = ("MAXPOOL", "TRANSPOSE", "SLICE", "CONCAT", "broadcast")


def _fuse_maxpool(g: Graph, node: Node, producers: dict) -> bool:
    """DQ ─► MAXPOOL or a move (TRANSPOSE, SLICE, CONCAT, broadcast) ─► Q, every input dequantised with the
    scale and zero point of the Q, runs on the integers: max commutes with a monotonic dequantisation, and a
    move with any elementwise one, so it is exact. (The quantiser gives a rotary embedding's halves and a
    grouped cache's expansion such pairs: each costs two vector instructions on the path for none.)"""
    if node.kind not in _MOVES:
        return False
    quant = _single_reader(g, node.output)
    if quant is None or quant.kind != "QUANTIZE":
        return False
    dequants = [producers.get(t) for t in node.inputs]
    if any(d is None or d.kind != "DEQUANTIZE" or d.attrs != quant.attrs
           or g.tensors[d.inputs[0]].dtype != g.tensors[quant.output].dtype
           or g.tensors[d.inputs[0]].shape != g.tensors[t].shape for d, t in zip(dequants, node.inputs)):
        return False
    node.inputs = [d.inputs[0] for d in dequants]
    node.output = quant.output
    g.nodes.remove(quant)
    return True


def _share_dequantize(g: Graph) -> int:
    """One DEQUANTIZE of a tensor per scale and zero point: the quantiser gives each reader its own copy (a
    node unit owns its DQ), which here is the same vector instruction again. Returns how many went."""
    first, shared = {}, 0
    for node in list(g.nodes):
        if node.kind != "DEQUANTIZE" or node.output in g.outputs:
            continue
        key = (g.base(node.inputs[0]), g.tensors[node.inputs[0]].shape, tuple(sorted(node.attrs.items())))
        if key not in first:
            first[key] = node.output
            continue
        g.tensors[node.output].alias_of = first[key]
        g.nodes.remove(node)
        shared += 1
    return shared


def _drop_round_trip(g: Graph, node: Node, producers: dict) -> bool:
    """Q(DQ(x)) with the same scale, zero point and type, through reshapes at most, is x: the integers come
    back exactly (``|x - zp| ≤ 255``, so ``(x - zp)·s / s`` rounds back to ``x - zp``). The quantiser puts
    such pairs around every reshape."""
    if node.kind != "QUANTIZE":
        return False
    dequant = producers.get(g.base(node.inputs[0]))
    if dequant is None or dequant.kind != "DEQUANTIZE" or dequant.attrs != node.attrs \
            or g.tensors[dequant.inputs[0]].dtype != g.tensors[node.output].dtype or node.output in g.outputs:
        return False
    g.tensors[node.output].alias_of = dequant.inputs[0]
    g.nodes.remove(node)
    return True


def _fuse_activation_product(g: Graph, node: Node, producers: dict) -> bool:
    """DQ(a) @ DQ(b) ─► Q, both per-tensor (attention's scores and P·V): an int8 × int8 product of two
    activations, requantised by ``sa·sb / sy`` (ONNX Runtime's QLinearMatMul)."""
    if node.kind != "matmul" or node.attrs["act"] != Opcode.NOP or len(node.inputs) != 2:
        return False
    dequants = [producers.get(t) for t in node.inputs]
    quant = _single_reader(g, node.output)
    if any(d is None or d.kind != "DEQUANTIZE" or g.tensors[d.inputs[0]].shape != g.tensors[t].shape
           for d, t in zip(dequants, node.inputs)) or quant is None or quant.kind != "QUANTIZE":
        return False
    (a, b), n = dequants, g.tensors[node.output].shape[-1]
    requant = np.float32(np.float64(a.attrs["scale"]) * np.float64(b.attrs["scale"]) / np.float64(quant.attrs["scale"]))
    node.kind = "qmatmul"
    node.inputs = [a.inputs[0], b.inputs[0], g.constant(np.zeros(n, np.int32)), g.constant(np.full(n, requant))]
    node.attrs.update(zp_in=int(a.attrs["zero_point"]), zp_w=int(b.attrs["zero_point"]),
                      zp_out=int(quant.attrs["zero_point"]))
    node.output = quant.output
    node.layer = f"{node.layer}+quantize"
    g.nodes.remove(quant)
    return True


def _fold_into_dequantize(g: Graph, node: Node, producers: dict) -> bool:
    """``DQ(x) · c`` and ``DQ(x) / c`` for a constant number c are one DequantizeLinear of x with its scale
    times (or over) c: the erf's 1/√2 and GELU's ½ after a dequantise, the attention scores' 1/√d.
    The dequantise stays where something else reads it."""
    if node.kind not in ("MUL", "DIV") or len(node.inputs) != 2 or node.output in g.outputs:
        return False
    for x, c in ((0, 1), (1, 0)) if node.kind == "MUL" else ((0, 1),):
        dq = producers.get(node.inputs[x])
        constant = node.inputs[c]
        if dq is None or dq.kind != "DEQUANTIZE" or not g.is_constant(constant) \
                or prod(g.tensors[constant].shape) != 1 or g.tensors[dq.output].shape != g.tensors[node.output].shape:
            continue
        value = float(g.tensors[g.base(constant)].data.reshape(-1)[0])
        if value == 0.0 or not np.isfinite(value):
            return False
        scale = float(dq.attrs["scale"]) * value if node.kind == "MUL" else float(dq.attrs["scale"]) / value
        node.kind, node.inputs = "DEQUANTIZE", [dq.inputs[0]]
        node.attrs = {"scale": scale, "zero_point": dq.attrs["zero_point"]}
        node.layer = f"{dq.layer}+{node.layer.split('/', 1)[-1]}"
        producers[node.output] = node
        return True
    return False


def fuse_int8(g: Graph) -> int:
    """Turn every complete DQ ─► op ─► Q into an int8 operator (conv, matmul, add, max pool, transpose),
    and drop the quantiser's Q(DQ(x)) round trips; return how many."""
    producers = g.producer()  # DEQUANTIZE nodes, the ones looked up, are never rewritten
    fused = 0
    for node in list(g.nodes):
        if node in g.nodes:
            fused += _drop_round_trip(g, node, producers)
    for node in list(g.nodes):
        if node in g.nodes:
            fused += _fuse_one(g, node, producers) or _fuse_add(g, node, producers) \
                or _fuse_maxpool(g, node, producers) or _fuse_activation_product(g, node, producers)
    for node in g.nodes:
        fused += _fold_into_dequantize(g, node, producers)
    _drop_dead(g)
    fused += _share_dequantize(g)

    return fused


def convert_on_host(g: Graph) -> int:
    """The link carries integers, a quarter of fp32's bytes: an input read only by a QuantizeLinear is
    quantised on the host (:attr:`Graph.host_converted`), and an output that a DequantizeLinear makes and
    nothing else reads is stored as its integers and dequantised on the host (:attr:`Graph.widened`).
    Returns how many inputs and outputs."""
    moved = 0
    g.host_converted, g.widened = dict(g.host_converted), dict(g.widened)  # (a system's parts share them)
    for position, tid in enumerate(g.inputs):
        quant = _single_reader(g, tid)
        if quant is None or quant.kind != "QUANTIZE" or quant.inputs != [tid] or g.base(tid) in g.state \
                or quant.output in g.outputs or g.tensors[tid].dtype != np.float32:
            continue
        g.inputs[position] = quant.output
        g.host_converted[quant.output] = (float(quant.attrs["scale"]), int(quant.attrs["zero_point"]))
        g.nodes.remove(quant)
        moved += 1
    producers = g.producer()
    read = {g.base(t) for node in g.nodes for t in node.inputs}
    for position, tid in enumerate(g.outputs):
        dequant = producers.get(tid)
        if dequant is None or dequant.kind != "DEQUANTIZE" or tid in read or g.outputs.count(tid) > 1 \
                or dequant.inputs[0] in g.outputs or dequant.inputs[0] in g.inputs:
            continue
        g.outputs[position] = dequant.inputs[0]
        g.widened[dequant.inputs[0]] = (float(dequant.attrs["scale"]), int(dequant.attrs["zero_point"]))
        g.nodes.remove(dequant)
        moved += 1
    return moved

