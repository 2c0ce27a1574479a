"""precision: store the graph in the requested floating-point type (fp16, bf16).

Every fp32 tensor, weights included, is stored in the target type; the matrix
unit accumulates in fp32 and each instruction rounds once on the way out (the
simulator's semantics). The host keeps the model's own dtype: a CAST after each
LOAD and before each STORE sits at the boundary, on lpx.
"""

from __future__ import annotations

import numpy as np

from ..runtime_sim.isa import FLOAT_DTYPES
from .graph import Graph, Node

STORAGE = {d.short: d.np for d in FLOAT_DTYPES}
F32 = np.dtype(np.float32)


def lower_precision(g: Graph, dtype: str) -> None:
    """Retype ``g`` in place to store ``dtype`` (``"fp32"`` changes nothing)."""
    if dtype not in STORAGE:
        raise ValueError(f"precision {dtype!r} is not a float storage type ({', '.join(STORAGE)})")
    target = STORAGE[dtype]
    if target == F32:
        return
    for tensor in g.tensors:
        if tensor.dtype == F32:
            tensor.dtype = target
            if tensor.data is not None:
                tensor.data = tensor.data.astype(target)
    casts_in = []
    for i, tid in enumerate(g.inputs):
        if g.tensors[tid].dtype == target:
            host = g.add_tensor(g.tensors[tid].shape, F32)
            casts_in.append(Node("CAST", [host], tid, {}, "cast_in"))
            g.inputs[i] = host
    g.nodes[:0] = casts_in
    for i, tid in enumerate(g.outputs):
        if g.tensors[tid].dtype == target:
            host = g.add_tensor(g.tensors[tid].shape, F32)
            g.nodes.append(Node("CAST", [tid], host, {}, "cast_out"))
            g.outputs[i] = host
