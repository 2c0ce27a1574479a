"""precision: store the graph in the requested floating-point type (fp16, bf16, fp8).

Every fp32 tensor, weights included, is stored in the target type; the matrix
unit accumulates in fp32 and each instruction rounds once on the way out (the
simulator's semantics). The host keeps the model's own dtype: a CAST after each
LOAD and before each STORE sits at the boundary, on lpx. Resident state (a KV cache)
is stored in the target type too; its host signature stays fp32.
"""

from __future__ import annotations

import warnings

import numpy as np

from ..runtime_sim.isa import FLOAT_DTYPES
from ..runtime_sim.simulator import OverflowWarning
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
    readers = {g.base(t): n.layer for n in g.nodes for t in n.inputs}
    for tid, tensor in enumerate(g.tensors):
        if tensor.dtype == F32:
            tensor.dtype = target
            if tensor.data is not None:
                with np.errstate(over="ignore"):
                    stored = tensor.data.astype(target)
                if np.isinf(stored).any() and np.isfinite(tensor.data).all():
                    warnings.warn(f"lpx: a constant of layer {readers.get(tid, '?')!r} overflows {dtype} "
                                  f"(|x| up to {float(np.abs(tensor.data).max()):.3g}): it holds inf",
                                  OverflowWarning, stacklevel=5)
                tensor.data = stored
    casts_in = []
    for i, tid in enumerate(g.inputs):
        if g.base(tid) in g.state:  # resident state is kept in the storage type; the host writes it converted
            g.host_dtype[tid] = F32
            continue
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
