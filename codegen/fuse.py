"""fuse: fold per-channel scale, bias and activation into convolutions and matmuls.

The matrix unit's results stream through the vector unit on their way to SRAM,
so a following per-channel multiply (batch norm's scale), add (bias, batch
norm's shift) and activation cost nothing extra. Folding happens in numpy on the
constant weights (a product of two activations takes its scale in the EPILOGUE
instead: ``(acc + bias) · scale``); it applies only where the intermediate
result has no other reader.
"""

from __future__ import annotations

import numpy as np

from ..runtime_sim import Opcode
from ..runtime_sim.isa import EPILOGUE_OPS, OP_TABLE
from .graph import Graph, Node, NodeKind

_ACTIVATIONS = {op.name: op for op in EPILOGUE_OPS if op != Opcode.NOP}


def _act_args(act: Opcode, attrs: dict) -> tuple:
    """An activation node's attributes as an epilogue's two ``act_args``, in the op table's order."""
    values = [float(attrs[a.name]) for a in OP_TABLE[act].attrs]
    return tuple(values + [0.0] * (2 - len(values)))


def _channel_vector(value: np.ndarray, out_shape: tuple, axis: int) -> np.ndarray | None:
    """``value`` as one number per channel of ``axis`` of the output, or None."""
    rank = len(out_shape)
    if value.ndim > rank:
        return None
    shape = (1,) * (rank - value.ndim) + value.shape
    if any(d != 1 for i, d in enumerate(shape) if i != axis % rank):
        return None
    if shape[axis % rank] not in (1, out_shape[axis]):
        return None
    return np.broadcast_to(value.reshape(-1), (out_shape[axis],)).astype(np.float32)


def _try_fold(g: Graph, node: Node, consumer: Node) -> bool:
    out_shape = g.tensors[node.output].shape
    if g.tensors[consumer.output].shape != out_shape:
        return False
    if consumer.kind in _ACTIVATIONS and node.attrs["act"] == Opcode.NOP:
        node.attrs["act"] = _ACTIVATIONS[consumer.kind]
        node.attrs["act_args"] = _act_args(node.attrs["act"], consumer.attrs)
        return True
    if consumer.kind not in ("MUL", "ADD", "DIV") or node.attrs["act"] != Opcode.NOP \
            or (consumer.kind == "DIV" and consumer.inputs[0] != node.output):
        return False
    other = [t for t in consumer.inputs if t != node.output]
    if len(other) != 1 or not g.is_constant(other[0]):
        return False
    axis = 1 if node.kind == NodeKind.CONV2D else -1
    vec = _channel_vector(g.tensors[g.base(other[0])].data.reshape(g.tensors[other[0]].shape), out_shape, axis)
    if vec is None:
        return False
    if consumer.kind == "DIV":
        vec = (np.float32(1) / vec).astype(np.float32)
    if len(node.inputs) > 3:
        # the epilogue is (acc + bias) · scale already: a bias added after the scale would have to be divided
        # by it (a mask of float32's lowest over 1/√d overflows), so it stays an op of its own
        return False
    bias = (g.tensors[g.base(node.inputs[2])].data.reshape(-1) if len(node.inputs) > 2
            else np.zeros_like(vec))
    if consumer.kind != "ADD" and not g.is_constant(node.inputs[1]):
        # a product of two activations (attention's scores scaled by 1/√d): the epilogue's scale operand
        if node.kind != NodeKind.MATMUL:
            return False
        node.inputs[2:] = [g.constant(bias.astype(np.float32)), g.constant(vec)]
        return True
    if consumer.kind in ("MUL", "DIV"):
        weight_id = node.inputs[1]
        weight = g.tensors[g.base(weight_id)].data.reshape(g.tensors[weight_id].shape)
        scale = vec.reshape(-1, 1, 1, 1) if node.kind == NodeKind.CONV2D else vec
        node.inputs[1] = g.constant((weight * scale).astype(g.tensors[g.base(weight_id)].dtype))
        bias = bias * vec
    else:
        bias = bias + vec
    bshape = (-1, 1) if node.kind == NodeKind.CONV2D else (-1,)
    node.inputs[2:] = [g.constant(bias.astype(np.float32).reshape(bshape))]
    return True


def fuse_epilogues(g: Graph) -> Graph:
    """Fold single-reader MUL/DIV/ADD-by-constant and activations into conv2d/matmul nodes."""
    changed = True
    while changed:
        changed = False
        uses = g.uses()
        readers = {}
        for n in g.nodes:
            for t in n.inputs:
                readers.setdefault(g.base(t), []).append(n)
        for node in g.nodes:
            if node.kind not in (NodeKind.CONV2D, NodeKind.MATMUL) or uses.get(node.output, 0) != 1:
                continue
            consumer = readers.get(node.output, [None])[0]
            if consumer is None or node.output in g.outputs or not _try_fold(g, node, consumer):
                continue
            node.output = consumer.output
            node.layer = f"{node.layer}+{consumer.layer.split('/', 1)[-1]}"
            g.nodes.remove(consumer)
            changed = True
            break
    return g
