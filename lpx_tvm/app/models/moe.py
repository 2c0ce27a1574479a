"""A Mixtral-style mixture-of-experts block built with onnx.helper and seeded weights.

``y = x + sum_e gate_e(x) * down_e(silu(gate_proj_e(x)) * up_proj_e(x))`` over ``experts`` SwiGLU experts.
The router is a product and a softmax; top-k keeps the ``top_k`` largest probabilities of each row and
renormalises them (Mixtral's routing), written densely: a probability at or above the row's k-th largest
keeps its value, the others become 0, and the kept ones are divided by their sum. Each expert's gate is its
column of the gates, taken by a product with a one-hot column (a product runs on the matrix unit, a slice
would not). Capacity-free: every expert runs on every row, and a gate of 0 zeroes its term, which is what
the sparse dispatch computes.

The top-k selection (TopK, ReduceMin, GreaterOrEqual, Cast, ReduceSum) runs on the host; the router's
product and softmax, the gating and the experts run on lpx. Under ``parallel="expert"`` the experts spread
over the chips (:mod:`lpx_tvm.codegen.parallel.expert`).

:func:`lpx_tvm.expert_forms.dense_experts` rewrites a block as ``torch.onnx`` exports it from Hugging Face
(Mixtral, Qwen3-MoE, gpt-oss: each choice's expert weights gathered by index) into this dense form, its top-k on
lpx too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


@dataclass(frozen=True)
class MoeConfig:
    hidden: int = 64
    ffn: int = 128
    experts: int = 8
    top_k: int = 2
    tokens: int = 1


def build_moe_block(config: MoeConfig = MoeConfig(), seed: int = 0) -> onnx.ModelProto:
    """The block as an ONNX model: input ``x`` ``[tokens, hidden]``, output ``y`` of the same shape."""
    c = config
    if not 1 <= c.top_k <= c.experts:
        raise ValueError(f"top_k must be 1..{c.experts}, got {c.top_k}")
    rng = np.random.default_rng(seed)
    inits, nodes = [], []

    def weight(name, shape, scale):
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name))
        return name

    def node(op, inputs, output, **attrs):
        nodes.append(helper.make_node(op, inputs, [output], **attrs))
        return output

    router = weight("router.weight", (c.hidden, c.experts), 1.0 / np.sqrt(c.hidden))
    probs = node("Softmax", [node("MatMul", ["x", router], "router_logits")], "probs", axis=-1)
    inits.append(numpy_helper.from_array(np.array([c.top_k], np.int64), "k"))
    nodes.append(helper.make_node("TopK", [probs, "k"], ["top_values", "top_indices"], axis=-1))
    kth = node("ReduceMin", ["top_values"], "kth", axes=[1], keepdims=1)
    kept = node("Cast", [node("GreaterOrEqual", [probs, kth], "kept_bool")], "kept", to=TensorProto.FLOAT)
    total = node("ReduceSum", ["top_values", "axes1"], "top_sum", keepdims=1)
    inits.append(numpy_helper.from_array(np.array([1], np.int64), "axes1"))
    gates = node("Div", [node("Mul", [probs, kept], "kept_probs"), total], "gates")
    acc = None
    for e in range(c.experts):
        p = f"experts.{e}"
        onehot = np.zeros((c.experts, 1), np.float32)
        onehot[e] = 1
        inits.append(numpy_helper.from_array(onehot, f"{p}.select"))
        gate = node("MatMul", [gates, f"{p}.select"], f"{p}.gate")
        h1 = node("MatMul", ["x", weight(f"{p}.w1", (c.hidden, c.ffn), 1.0 / np.sqrt(c.hidden))], f"{p}.h1")
        silu = node("Mul", [h1, node("Sigmoid", [h1], f"{p}.sig")], f"{p}.silu")
        h3 = node("MatMul", ["x", weight(f"{p}.w3", (c.hidden, c.ffn), 1.0 / np.sqrt(c.hidden))], f"{p}.h3")
        down = node("MatMul", [node("Mul", [silu, h3], f"{p}.act"),
                               weight(f"{p}.w2", (c.ffn, c.hidden), 1.0 / np.sqrt(c.ffn))], f"{p}.down")
        term = node("Mul", [down, gate], f"{p}.term")
        acc = term if acc is None else node("Add", [acc, term], f"{p}.sum")
    node("Add", ["x", acc], "y")
    shape = [c.tokens, c.hidden]
    graph = helper.make_graph(nodes, "moe_block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])

