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

A decoder quantised at its products (``lpx_tvm.quantize``: only MatMul operands
quantised) reads their results as float: such a product runs on int8 and its
EPILOGUE dequantises the int32 sums; a QuantizeLinear of its result (through
transposes) requantises there instead, a residual added to it of one row is its
bias, and a constant number multiplying a QuantizeLinear's input goes into its
scale. Each agrees with ONNX Runtime to float rounding.
"""

from __future__ import annotations

from math import prod

import numpy as np

from ..runtime_sim import Opcode
from .graph import Graph, Node, NodeKind

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
    out_axis = 0 if node.kind == NodeKind.CONV2D else q.ndim - 1
    if any(d != 1 for i, d in enumerate(scale.shape) if i != out_axis):
        return None
    channels = q.shape[out_axis]
    return q, np.broadcast_to(scale.reshape(-1), (channels,)).astype(np.float64), int(zero_point.reshape(-1)[0])


def _fuse_one(g: Graph, node: Node, producers: dict) -> bool:
    if node.kind not in (NodeKind.CONV2D, NodeKind.MATMUL) or node.attrs["act"] not in (Opcode.NOP, Opcode.RELU):
        return False
    dequant = producers.get(node.inputs[0])
    quant = _single_reader(g, node.output)
    weight = _weight_integers(g, node)
    if dequant is None or dequant.kind != "DEQUANTIZE" or quant is None or quant.kind != "QUANTIZE" or weight is None:
        return False
    if g.tensors[node.inputs[0]].shape != g.tensors[dequant.inputs[0]].shape:
        return False
    w_q, w_scale, zp_w = weight
    depthwise = node.kind == NodeKind.CONV2D and node.attrs["groups"] == g.tensors[node.inputs[0]].shape[1] > 1
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
    shape = (-1, 1) if node.kind == NodeKind.CONV2D else (-1,)
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


_MOVES = ("MAXPOOL", "TRANSPOSE", "SLICE", "CONCAT", NodeKind.BROADCAST)


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
    if node.kind != NodeKind.MATMUL or node.attrs["act"] != Opcode.NOP or len(node.inputs) != 2:
        return False
    dequants = [producers.get(t) for t in node.inputs]
    quant = _single_reader(g, node.output)
    if any(d is None or d.kind != "DEQUANTIZE" or g.tensors[d.inputs[0]].shape != g.tensors[t].shape
           for d, t in zip(dequants, node.inputs)) or quant is None or quant.kind != "QUANTIZE":
        return False
    (a, b), n = dequants, g.tensors[node.output].shape[-1]
    requant = np.float32(np.float64(a.attrs["scale"]) * np.float64(b.attrs["scale"]) / np.float64(quant.attrs["scale"]))
    node.kind = NodeKind.QMATMUL
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


def _float_product(g: Graph, node: Node, producers: dict) -> bool:
    """DQ(x) @ W (integer weights) or DQ(a) @ DQ(b), its result read as float (no QuantizeLinear after it: a
    decoder quantised at its products): an int8 product whose EPILOGUE dequantises the int32 sums,
    ``(acc + b / S) · S``, S the accumulator's scale per column (ONNX Runtime's MatMulIntegerToFloat). A bias
    and a scale the float product had folded (``(x @ w + b) · v``) go into b and S."""
    if node.kind != NodeKind.MATMUL or node.attrs["act"] not in (Opcode.NOP, Opcode.RELU):
        return False
    dequant = producers.get(node.inputs[0])
    if dequant is None or dequant.kind != "DEQUANTIZE" or g.tensors[node.inputs[0]].shape != \
            g.tensors[dequant.inputs[0]].shape or any(not g.is_constant(t) for t in node.inputs[2:]):
        return False
    n = g.tensors[node.output].shape[-1]
    sx = np.float64(dequant.attrs["scale"])
    weight = _weight_integers(g, node)
    if weight is not None:
        w_q, w_scale, zp_w = weight
        b_in, accumulator_scale = g.constant(w_q), sx * w_scale
    else:
        other = producers.get(node.inputs[1])
        if other is None or other.kind != "DEQUANTIZE" or g.is_constant(other.inputs[0]) \
                or g.tensors[node.inputs[1]].shape != g.tensors[other.inputs[0]].shape:
            return False
        b_in, zp_w = other.inputs[0], int(other.attrs["zero_point"])
        accumulator_scale = np.full(n, sx * np.float64(other.attrs["scale"]))
    extras = [np.broadcast_to(g.tensors[g.base(t)].data.reshape(-1).astype(np.float64), (n,)) for t in node.inputs[2:]]
    bias = extras[0] if extras else np.zeros(n)
    after = extras[1] if len(extras) > 1 else np.ones(n)
    node.kind = NodeKind.QMATMUL
    node.inputs = [dequant.inputs[0], b_in, g.constant((bias / accumulator_scale).astype(np.float32)),
                   g.constant((accumulator_scale * after).astype(np.float32))]
    node.attrs.update(zp_in=int(dequant.attrs["zero_point"]), zp_w=zp_w, zp_out=0)
    return True


_SINGLE_MOVES = ("TRANSPOSE",)


def _quantize_in_epilogue(g: Graph, quant: Node, producers: dict) -> bool:
    """Q of a dequantising int8 product's result (through transposes and reshapes, each read once): the
    product's EPILOGUE requantises instead, ``rint((acc + rint(b / S)) · S / sy) + zy``, and the moves run on
    the integers (a quantise commutes with a move). P·V's result, transposed into the output projection."""
    if quant.kind != "QUANTIZE" or quant.output in g.outputs:
        return False
    moves, t = [], quant.inputs[0]
    while True:
        source = producers.get(g.base(t))
        if source is None or _single_reader(g, source.output) is not (moves[-1] if moves else quant):
            return False
        if source.kind in _SINGLE_MOVES:
            moves.append(source)
            t = source.inputs[0]
            continue
        if source.kind != NodeKind.QMATMUL or g.tensors[source.output].dtype.kind != "f" or source.output in g.outputs \
                or not all(g.is_constant(x) for x in source.inputs[2:4]):  # (a residual bias is no integer)
            return False
        break
    bias, scale = (g.tensors[g.base(x)].data.astype(np.float64) for x in source.inputs[2:4])
    sy = np.float64(quant.attrs["scale"])
    source.inputs[2:4] = [g.constant(np.rint(bias).astype(np.int32)), g.constant((scale / sy).astype(np.float32))]
    source.attrs["zp_out"] = int(quant.attrs["zero_point"])
    source.layer = f"{source.layer}+quantize"
    integer = g.tensors[quant.output].dtype
    retyped = {source.output} | {m.output for m in moves}
    for tid in range(len(g.tensors)):
        if g.tensors[tid].data is None and g.base(tid) in retyped:
            g.tensors[tid].dtype = integer
    g.tensors[quant.output].alias_of = quant.inputs[0]
    g.nodes.remove(quant)
    return True


def _scale_into_quantize(g: Graph, quant: Node, producers: dict) -> bool:
    """Q(x · c) and Q(x / c), c a positive constant number, read once: Q(x) with the scale over (times) c (the
    attention scores' 1/√d on q and k before their product)."""
    if quant.kind != "QUANTIZE":
        return False
    node = producers.get(quant.inputs[0])
    if node is None or node.kind not in ("MUL", "DIV") or len(node.inputs) != 2 or _single_reader(g, node.output) is not quant:
        return False
    for x, c in ((0, 1), (1, 0)) if node.kind == "MUL" else ((0, 1),):
        constant = node.inputs[c]
        if not g.is_constant(constant) or prod(g.tensors[constant].shape) != 1 \
                or g.tensors[node.inputs[x]].shape != g.tensors[node.output].shape or g.is_constant(node.inputs[x]):
            continue
        value = float(g.tensors[g.base(constant)].data.reshape(-1)[0])
        if not (value > 0.0 and np.isfinite(value)):
            return False
        scale = float(quant.attrs["scale"])
        quant.attrs["scale"] = scale / value if node.kind == "MUL" else scale * value
        quant.inputs = [node.inputs[x]]
        quant.layer = f"{node.layer}+{quant.layer.split('/', 1)[-1]}"
        g.nodes.remove(node)
        return True
    return False


def _residual_into_epilogue(g: Graph, add: Node, producers: dict) -> bool:
    """r + (a dequantising int8 product of one row, no bias): the product's EPILOGUE adds r as its bias,
    ``(acc + r / S) · S`` (the residual stream of a decode step); r / S is made off the path, while the
    product runs."""
    if add.kind != "ADD" or len(add.inputs) != 2:
        return False
    for k in (0, 1):
        product, r = producers.get(add.inputs[k]), add.inputs[1 - k]
        if product is None or product.kind != NodeKind.QMATMUL or g.tensors[product.output].dtype.kind != "f" \
                or _single_reader(g, product.output) is not add or product.output in g.outputs:
            continue
        shape = g.tensors[product.output].shape
        if prod(shape[:-1]) != 1 or g.tensors[r].shape != shape or g.is_constant(r) \
                or g.tensors[add.output].shape != shape or g.tensors[r].dtype != g.tensors[add.output].dtype \
                or np.any(g.tensors[g.base(product.inputs[2])].data != 0):
            continue
        scale = g.tensors[g.base(product.inputs[3])].data.astype(np.float64).reshape(-1)
        scaled = g.add_tensor(shape, g.tensors[r].dtype)
        place = g.nodes.index(add)
        g.nodes.insert(place, Node("MUL", [r, g.constant((1.0 / scale).astype(np.float32))], scaled, {},
                                   f"{add.layer}+scale"))
        g.nodes.remove(product)
        g.nodes.insert(g.nodes.index(add), product)
        product.inputs[2] = scaled
        product.output = add.output
        product.layer = f"{product.layer}+{add.layer.split('/', 1)[-1]}"
        producers[product.output] = product
        g.nodes.remove(add)
        return True
    return False


def _late_scale_last(g: Graph, node: Node, producers: dict) -> bool:
    """w · (x · s), w a constant vector and s a row's number made late (a norm's 1/√(mean + eps)): (x · w) · s,
    so that x · w runs while s is made and one multiply is left on the path."""
    if node.kind != "MUL" or len(node.inputs) != 2:
        return False
    for c in (0, 1):
        inner = producers.get(node.inputs[1 - c])
        if not g.is_constant(node.inputs[c]) or inner is None or inner.kind != "MUL" or len(inner.inputs) != 2 \
                or _single_reader(g, inner.output) is not node or any(g.is_constant(t) for t in inner.inputs):
            continue
        x, s = sorted(inner.inputs, key=lambda t: -prod(g.tensors[t].shape))
        shape = g.tensors[inner.output].shape
        if g.tensors[x].shape != shape or prod(g.tensors[s].shape) * 4 > prod(shape) \
                or g.tensors[node.output].shape != shape:
            continue
        inner.inputs = [x, node.inputs[c]]
        node.inputs = [inner.output, s]
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
    # a decoder quantised at its products: products whose results are read as float
    for node in list(g.nodes):
        if node in g.nodes:
            fused += _float_product(g, node, producers)
    producers = g.producer()
    for node in list(g.nodes):
        if node in g.nodes:
            fused += _scale_into_quantize(g, node, producers) or _quantize_in_epilogue(g, node, producers) \
                or _residual_into_epilogue(g, node, producers) or _late_scale_last(g, node, producers)
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

