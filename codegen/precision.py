"""precision: store the graph in the requested floating-point type (fp16, bf16, fp8).

Every fp32 tensor, weights included, is stored in the target type; the matrix
unit accumulates in fp32 and each instruction rounds once on the way out (the
simulator's semantics). fp8 (e4m3: 3 mantissa bits, 2^-6 to 448) is the
products' type, as fp8 inference runs it: their weights are stored scaled per
output channel to fp8's range (the EPILOGUE multiplies the scale back into the
fp32 sums) and their activations are CAST to fp8 just before them; everything
the vector unit makes (norms, softmax, residuals, the outputs) is fp16, where
3 mantissa bits would lose a probability of 0.001 altogether. The caller keeps the model's own dtype: the host
rounds each fp32 input to the storage type before it crosses the link and widens each output after (half the
link's bytes, no CAST pass on the chip). Resident state (a KV cache) is stored in the target type too; its
host signature stays fp32.
"""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np

from ..runtime_sim.isa import FLOAT_DTYPES
from ..runtime_sim.errors import LpxUserError
from ..runtime_sim.simulator import OverflowWarning
from .graph import Graph, Node, NodeKind, layer_label

STORAGE = {d.short: d.np for d in FLOAT_DTYPES}
F32 = np.dtype(np.float32)


def lower_precision(g: Graph, dtype: str) -> None:
    """Retype ``g`` in place to store ``dtype`` (``"fp32"`` changes nothing)."""
    if dtype not in STORAGE:
        raise LpxUserError(f"precision {dtype!r} is not a float storage type ({', '.join(STORAGE)})")
    target = STORAGE[dtype]
    if target == F32:
        for tensor in g.tensors:  # fp16 weights the model widens (Graph.constant): stored widened
            if tensor.data is not None and tensor.data.dtype != tensor.dtype:
                tensor.data = tensor.data.astype(tensor.dtype)
        return
    keep, one_byte = set(), set()
    if dtype == "fp8":  # products in fp8, everything else in fp16 (see the module docstring)
        products = fp8_products(g)
        keep = scale_weights(g, products, float(ml_dtypes.finfo(target).max))
        one_byte = {g.base(n.inputs[1]) for n in products}
        _cast_product_inputs(g, products, target)
        target = STORAGE["fp16"]
    # an epilogue's scale (a product of two activations scaled by 1/√d) stays fp32, as the ISA takes it
    keep |= {g.base(n.inputs[3]) for n in g.nodes if n.kind == NodeKind.MATMUL and len(n.inputs) > 3}
    readers = {g.base(t): n.layer for n in g.nodes for t in n.inputs}
    for tid, tensor in enumerate(g.tensors):
        if tensor.dtype == F32 and tid not in keep:
            tensor.dtype = STORAGE["fp8"] if tid in one_byte else target
            if tensor.data is not None and tensor.data.dtype != tensor.dtype:  # (fp16 data is stored as it is)
                with np.errstate(over="ignore", invalid="ignore"):
                    stored = tensor.data.astype(tensor.dtype)
                finite = np.isfinite(tensor.data)
                if (finite & ~np.isfinite(stored.astype(np.float32))).any():
                    # saturated, not inf: an attention mask of float32's lowest (-3.4e38, as Hugging Face
                    # writes it) must stay a large negative number, or 0 · -inf makes NaN
                    top = float(ml_dtypes.finfo(tensor.dtype).max)
                    warnings.warn(f"lpx: a constant of layer {layer_label(readers.get(tid, '?'))} overflows {dtype} "
                                  f"(|x| up to {float(np.abs(tensor.data[finite]).max()):.3g}): it saturates to "
                                  f"±{top:g}", OverflowWarning, stacklevel=5)
                    stored = np.where(finite, np.clip(tensor.data, -top, top), tensor.data).astype(tensor.dtype)
                tensor.data = stored
    # the host rounds an fp32 input to the storage type before the link, and widens an output after it:
    # half the bytes cross, and no CAST pass runs on the chip (the rounding is the one a CAST would do)
    for tid in g.inputs:
        if g.base(tid) in g.state:  # resident state is kept in the storage type; the host writes it converted
            g.host_dtype[tid] = F32
        elif g.tensors[tid].dtype == target:
            g.host_converted[tid] = (1.0, 0)
    g.widened.update({tid: (1.0, 0) for tid in g.outputs if g.tensors[g.base(tid)].dtype == target})


def fp8_products(g: Graph) -> list:
    """The products that run in fp8: matrix products and ungrouped convolutions with constant weights, but
    not the first or the last (the input's and the output's layers stay fp16, as fp8 inference keeps them:
    the logits are what a softmax magnifies). Depthwise convolutions run on the vector unit, in fp16."""
    products = [n for n in g.nodes if (n.kind == NodeKind.MATMUL or (n.kind == NodeKind.CONV2D and n.attrs["groups"] == 1))
                and g.is_constant(g.base(n.inputs[1])) and not g.is_constant(g.base(n.inputs[0]))]
    return products[1:-1]


def _cast_product_inputs(g: Graph, products: list, fp8) -> None:
    """A product with fp8 weights takes fp8 activations: a CAST before it (one per activation tensor)."""
    casts, nodes, chosen = {}, [], {id(n) for n in products}
    for node in g.nodes:
        if id(node) in chosen:
            x = node.inputs[0]
            if x not in casts:
                casts[x] = g.add_tensor(g.tensors[x].shape, fp8)
                nodes.append(Node("CAST", [x], casts[x], {}, node.layer + "+cast_fp8"))
            node.inputs[0] = casts[x]
        nodes.append(node)
    g.nodes[:] = nodes


def scale_weights(g: Graph, products: list, top: float) -> set:
    """fp8's range is narrow (e4m3: 2^-6 to 448, 3 mantissa bits): a weight of 0.01 is a subnormal with a
    few percent of error. Each product's weights are stored scaled per output channel to reach ``top``; the
    EPILOGUE multiplies the scale back into the fp32 sums (``act((acc + bias / s) · s)``). The bias and the
    scales stay fp32. Returns the tensors kept fp32."""
    keep = set()
    for node in products:
        w_id = g.base(node.inputs[1])
        weight = g.tensors[w_id].data.astype(np.float32).reshape(g.tensors[node.inputs[1]].shape)
        if weight.ndim < 2 or len(node.inputs) > 3:
            continue
        axis = 0 if node.kind == NodeKind.CONV2D else weight.ndim - 1  # the output channel (column)
        count = weight.shape[axis]
        bias = node.inputs[2] if len(node.inputs) > 2 else None
        if bias is not None and (not g.is_constant(g.base(bias)) or int(np.prod(g.tensors[bias].shape)) != count):
            continue
        reduce = tuple(a for a in range(weight.ndim) if a != axis)
        peak = np.abs(weight).max(axis=reduce)
        scale = np.where(peak > 1e-30, peak / top, 1.0).astype(np.float32)  # a (near) zero channel: as it is
        shaped = scale.reshape([-1 if a == axis else 1 for a in range(weight.ndim)])
        if sum(len(n.inputs) > 1 and n.inputs[1] == node.inputs[1] for n in g.nodes) > 1:  # shared: a copy
            w_id = g.constant(weight)
            node.inputs[1] = w_id
        g.tensors[w_id].data = (weight / shaped).astype(np.float32).reshape(g.tensors[w_id].data.shape)
        bias_data = (np.zeros(count, np.float32) if bias is None
                     else g.tensors[g.base(bias)].data.astype(np.float32).reshape(-1))
        bias_shape = (count,) if bias is None else g.tensors[bias].shape
        new_bias = g.add_tensor(bias_shape, F32, data=(bias_data / scale).reshape(bias_shape))
        new_scale = g.add_tensor(bias_shape, F32, data=scale.reshape(bias_shape))
        node.inputs[2:] = [new_bias, new_scale]
        keep |= {new_bias, new_scale}
    return keep
