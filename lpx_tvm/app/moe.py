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

:func:`dense_experts` rewrites a block as ``torch.onnx`` exports it from Hugging Face (Mixtral, Qwen3-MoE:
each choice's expert weights gathered by index) into this dense form, its top-k on lpx too.
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


# the ops between a TopK and the combine in a block torch.onnx exports from transformers' batched experts
# (``experts_implementation="batched_mm"``, the one its exporter can trace): the tokens repeated top_k times,
# each pair's weights gathered by expert index, a batched SwiGLU, the pairs weighted and summed
_DISPATCH_OPS = {"Reshape", "Unsqueeze", "Squeeze", "Expand", "GatherND", "MatMul", "Split", "Sigmoid", "Mul",
                 "ReduceSum", "Div"}
# 2**100: (max - p) · BIG reaches 1 for any two scores that differ by 1e-30 or more (fp32 tops out at
# 3.4e38, so a difference of up to 1e8 does not overflow)
_BIG = float(2 ** 100)


def dense_experts(model: onnx.ModelProto, check: bool = True) -> onnx.ModelProto:
    """A mixture of experts exported with its experts' weights gathered by index, rewritten densely.

    ``torch.onnx.export(dynamo=True)`` writes a Hugging Face Mixtral or Qwen3-MoE block as a router
    (a product and a softmax), a TopK, the top-k weights renormalised (where the model does), then each
    (token, choice) pair's expert weights gathered (GatherND) from the stacked ``[experts, ...]`` tensors
    and applied in a batched SwiGLU. No expert is a product of its own there, so nothing can put one on a
    chip. This rewrites the part after the router into the form :mod:`lpx_tvm.codegen.parallel.expert`
    spreads: every expert a SwiGLU by its own weights on every token, scaled by its gate, the terms summed.

    The top-k runs on lpx as arithmetic (a row maximum k times, each step removing the maximum): a
    probability is kept where it is at least the k-th largest, tested as
    ``relu(1 - relu((kth - p) · 2**100))``, so two probabilities closer than 1e-30 count as tied, and tied
    probabilities are all kept where TopK would keep one. The gates are the kept probabilities (divided by
    their sum where the model renormalises); each expert takes its own by a product with a one-hot column.

    Parameters
    ----------
    model : onnx.ModelProto
        The exported model, with static shapes.
    check : bool
        Run the model and the rewrite under ONNX Runtime on a seeded input and refuse a rewrite whose
        outputs differ (a form that looks alike and computes something else).

    Returns
    -------
    onnx.ModelProto
        The rewritten model, the same inputs and outputs.

    Raises
    ------
    ValueError
        No TopK, or a block in a form this does not know (it names the op or the shape that differs).
    """
    model = onnx.shape_inference.infer_shapes(model)
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
              for v in list(g.value_info) + list(g.input) + list(g.output)}
    shapes.update({name: list(t.dims) for name, t in inits.items()})
    producer = {o: n for n in g.node for o in n.output}
    readers = {}
    for n in g.node:
        for t in n.input:
            readers.setdefault(t, []).append(n)
    topks = [n for n in g.node if n.op_type == "TopK"]
    if len(topks) != 1:
        raise ValueError(f"dense_experts: a mixture of experts routes by one TopK; this model has {len(topks)}")
    (topk,) = topks
    attrs = {a.name: helper.get_attribute_value(a) for a in topk.attribute}
    if topk.input[1] not in inits or attrs.get("largest", 1) != 1 or attrs.get("axis", -1) not in (-1, 1):
        raise ValueError("dense_experts: the TopK does not take the largest of each row with a constant k")
    k = int(numpy_helper.to_array(inits[topk.input[1]]).reshape(-1)[0])
    emit = _Emit(model)
    scatters = [n for n in readers.get(topk.output[1], []) if n.op_type == "ScatterElements"]
    if scatters:
        dropped = _scatter_form(g, topk, k, scatters, inits, shapes, producer, readers, emit)
    else:
        dropped = _gathered_form(g, topk, k, inits, shapes, producer, emit)
    at = next(i for i, n in enumerate(g.node) if id(n) in dropped)
    kept = [n for n in g.node if id(n) not in dropped]
    nodes = kept[:at] + emit.nodes + kept[at:]
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    out.graph.node.extend(_live(nodes, [o.name for o in g.output]))
    used = {t for n in out.graph.node for t in n.input}
    del out.graph.initializer[:]
    out.graph.initializer.extend([t for t in g.initializer if t.name in used]
                                 + [t for t in emit.inits if t.name in used])
    del out.graph.value_info[:]
    if check:
        _same_outputs(model, out)
    return out


class _Emit:
    """The nodes and constants a rewrite adds (named ``moe.*``, or a name the model's readers know)."""

    def __init__(self, model):
        self.nodes, self.inits = [], []
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
        self.inits.append(numpy_helper.from_array(np.array([-1], np.int64), "moe.axes"))

    def const(self, name, array, dtype=np.float32):
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(array, dtype), f"moe.{name}"))
        return f"moe.{name}"

    def node(self, op, inputs, output, keep_name=False, **kw):
        self.nodes.append(helper.make_node(op, inputs, [output if keep_name else f"moe.{output}"], **kw))
        return self.nodes[-1].output[0]

    def row_max(self, x, name):
        if self.opset >= 18:  # (ReduceMax takes its axes as an input from opset 18)
            return self.node("ReduceMax", [x, "moe.axes"], name, keepdims=1)
        return self.node("ReduceMax", [x], name, axes=[-1], keepdims=1)

    def row_sum(self, x, name):
        return self.node("ReduceSum", [x, "moe.axes"], name, keepdims=1)


def _top_k(emit: _Emit, scores: str, k: int) -> tuple:
    """1 where a score is among its row's ``k`` largest, else 0, in ops that run on lpx; and the row maximum.

    Each of the first k - 1 steps pushes the row's maximum below the row's minimum (by the row's span plus
    one); the k-th maximum left is the threshold, and relu(1 - relu(d · 2**100)) is 1 at d = 0 and 0 from
    d = 2**-100 on. Relu and Sub, not Clip or Min: the importer leaves a Clip with tensor bounds, and a Min,
    to the host.
    """
    one, big = emit.const("one", 1.0), emit.const("big", _BIG)

    def at_least(threshold, x, name):
        gap = emit.node("Relu", [emit.node("Mul", [emit.node("Sub", [threshold, x], f"{name}.gap"), big],
                                           f"{name}.scaled")], f"{name}.pos")
        return emit.node("Relu", [emit.node("Sub", [one, gap], f"{name}.near")], name)

    top = emit.row_max(scores, "max0")
    if k > 1:
        low = emit.node("Neg", [emit.row_max(emit.node("Neg", [scores], "neg"), "negmax")], "min")
        span = emit.node("Add", [emit.node("Sub", [top, low], "range"), one], "span")
    work, kth = scores, top
    for i in range(1, k):
        hit = at_least(kth, work, f"hit{i}")
        work = emit.node("Sub", [work, emit.node("Mul", [hit, span], f"drop{i}")], f"work{i}")
        kth = emit.row_max(work, f"max{i}")
    return at_least(kth, scores, "kept"), top


def _gathered_form(g, topk, k, inits, shapes, producer, emit: _Emit) -> set:
    """Hugging Face's batched experts as exported: TopK of a softmax, each choice's weights gathered by index.
    Emits the dense block in ``emit``; returns the ids of the nodes it replaces."""
    probs = topk.input[0]
    softmax = producer.get(probs)
    if softmax is None or softmax.op_type != "Softmax":
        raise ValueError("dense_experts: the TopK does not take a Softmax's probabilities, and no ScatterElements "
                         "makes gates of its choices")
    router = producer.get(softmax.input[0])
    if router is None or router.op_type not in ("Gemm", "MatMul"):
        raise ValueError("dense_experts: the router's Softmax does not read a product (Gemm or MatMul)")
    x = router.input[0]
    tokens, hidden = shapes[x]
    experts = shapes[probs][-1]

    # the nodes after the TopK that make the combine: downstream of the TopK, up to the ReduceSum over choices
    after, order = set(topk.output), []
    for n in g.node:
        if n is topk or any(t in after for t in n.input):
            order.append(n)
            after.update(n.output)
    gathers = [n for n in order if n.op_type == "GatherND"]
    if len(gathers) != 2 or any(n.input[0] not in inits for n in gathers):
        raise ValueError(f"dense_experts: expected the experts' two stacked weights gathered by index (gate_up "
                         f"and down, GatherND of a constant); found {len(gathers)} GatherND after the TopK")
    up_w, down_w = (numpy_helper.to_array(inits[n.input[0]]) for n in gathers)
    if up_w.ndim != 3 or down_w.ndim != 3 or up_w.shape[0] != experts or down_w.shape[0] != experts \
            or up_w.shape[2] != hidden or down_w.shape[1] != hidden or up_w.shape[1] != 2 * down_w.shape[2]:
        raise ValueError(f"dense_experts: stacked weights {up_w.shape} and {down_w.shape} are not {experts} "
                         f"experts' gate_up [2·ffn, {hidden}] and down [{hidden}, ffn] (a transposed or biased "
                         "layout, such as gpt-oss's, is not handled)")
    ffn = down_w.shape[2]
    combine = next((n for n in order if n.op_type == "ReduceSum" and shapes.get(n.output[0]) == [tokens, hidden]
                    and any(producer.get(t) is not None for t in n.input)), None)
    if combine is None:
        raise ValueError(f"dense_experts: no ReduceSum after the TopK makes the block's [{tokens}, {hidden}] output")
    region = _ancestors_within(combine, producer, {id(n) for n in order})
    odd = sorted({n.op_type for n in region} - _DISPATCH_OPS - {"TopK"})
    if odd:
        raise ValueError(f"dense_experts: {', '.join(odd)} between the TopK and the combine is not a SwiGLU "
                         "expert of the form Mixtral and Qwen3-MoE export")
    normalise = any(n.op_type == "Div" and n.input[0] == topk.output[0] for n in region)
    y = combine.output[0]

    kept, _ = _top_k(emit, probs, k)
    gates = emit.node("Mul", [probs, kept], "kept_probs")
    if normalise:
        gates = emit.node("Div", [gates, emit.row_sum(gates, "kept_sum")], "gates")
    acc = None
    for e in range(experts):
        gate = emit.node("MatMul", [gates, emit.const(f"{e}.select", np.eye(experts)[:, e:e + 1])], f"{e}.gate")
        h1 = emit.node("MatMul", [x, emit.const(f"{e}.w1", up_w[e, :ffn].T)], f"{e}.h1")
        silu = emit.node("Mul", [h1, emit.node("Sigmoid", [h1], f"{e}.sig")], f"{e}.silu")
        h3 = emit.node("MatMul", [x, emit.const(f"{e}.w3", up_w[e, ffn:].T)], f"{e}.h3")
        act = emit.node("Mul", [silu, h3], f"{e}.act")
        down = emit.node("MatMul", [act, emit.const(f"{e}.w2", down_w[e].T)], f"{e}.down")
        term = emit.node("Mul", [down, gate], f"{e}.term")
        last = e == experts - 1
        acc = term if acc is None else emit.node("Add", [acc, term], y if last else f"{e}.sum", keep_name=last)
    return {id(n) for n in region}


def _scatter_form(g, topk, k, scatters, inits, shapes, producer, readers, emit: _Emit) -> set:
    """Experts of their own, gated from a ScatterElements of the top-k weights into zeros and a Gather of each
    expert's column (a hand-written block, or one that loops over ``nn.ModuleList`` experts). Emits the gates
    on lpx and each expert's column by a product with a one-hot column; returns the ids of the nodes replaced.
    """
    (scatter,) = scatters
    attrs = {a.name: helper.get_attribute_value(a) for a in scatter.attribute}
    zeros = scatter.input[0]
    if zeros not in inits or np.any(numpy_helper.to_array(inits[zeros])) or attrs.get("axis", 0) not in (-1, 1) \
            or attrs.get("reduction", b"none") not in (b"none", "none"):
        raise ValueError("dense_experts: the ScatterElements does not write the top-k weights into zeros along "
                         "the experts' axis")
    scores, values = topk.input[0], scatter.input[2]
    experts = shapes[scores][-1]
    made = producer.get(values)
    if values == topk.output[0]:
        form, replaced = "as is", []
    elif made is not None and made.op_type == "Softmax" and made.input[0] == topk.output[0]:
        form, replaced = "softmax", [made]
    elif made is not None and made.op_type == "Div" and made.input[0] == topk.output[0] \
            and producer.get(made.input[1]) is not None and producer[made.input[1]].op_type == "ReduceSum" \
            and producer[made.input[1]].input[0] == topk.output[0]:
        form, replaced = "renormalised", [made, producer[made.input[1]]]
    else:
        raise ValueError("dense_experts: the scattered gate weights are not the top-k values as they are, their "
                         "softmax, or the values over their sum")
    selects = readers.get(scatter.output[0], [])
    for n in selects:
        index = n.input[1] if n.op_type == "Gather" else None
        axis = {a.name: helper.get_attribute_value(a) for a in n.attribute}.get("axis", 0)
        if index not in inits or axis not in (-1, len(shapes[scores]) - 1) \
                or numpy_helper.to_array(inits[index]).size != 1:
            raise ValueError(f"dense_experts: the gates are read by a {n.op_type} that is not a Gather of one "
                             "expert's column")
    inside = {id(n) for n in [scatter, *replaced]}
    outside = [n for t in [*topk.output, values] for n in readers.get(t, []) if id(n) not in inside]
    if outside:
        raise ValueError(f"dense_experts: the top-k is read outside the gates too (by a {outside[0].op_type})")

    kept, top = _top_k(emit, scores, k)
    if form == "softmax":  # the softmax of the k largest: exp of each less the row's maximum, over their sum
        shifted = emit.node("Mul", [emit.node("Exp", [emit.node("Sub", [scores, top], "shifted")], "exp"), kept],
                            "kept_exp")
        gates = emit.node("Div", [shifted, emit.row_sum(shifted, "kept_sum")], "gates")
    else:
        gates = emit.node("Mul", [scores, kept], "kept_scores")
        if form == "renormalised":
            gates = emit.node("Div", [gates, emit.row_sum(gates, "kept_sum")], "gates")
    for n in selects:
        e = int(numpy_helper.to_array(inits[n.input[1]]).reshape(-1)[0]) % experts
        column = emit.node("MatMul", [gates, emit.const(f"{e}.select", np.eye(experts)[:, e:e + 1])], f"{e}.gate")
        shape = emit.const(f"{e}.shape", np.array(shapes[n.output[0]]), np.int64)
        emit.node("Reshape", [column, shape], n.output[0], keep_name=True)
    return {id(n) for n in [topk, scatter, *replaced, *selects]}


def _ancestors_within(last, producer: dict, within: set) -> list:
    """``last`` and the nodes of ``within`` (ids) it is computed from."""
    seen, stack = {id(last): last}, [last]
    while stack:
        for t in stack.pop().input:
            p = producer.get(t)
            if p is not None and id(p) in within and id(p) not in seen:
                seen[id(p)] = p
                stack.append(p)
    return list(seen.values())


def _live(nodes: list, outputs: list) -> list:
    """``nodes`` less those whose outputs nothing reads (the repeated tokens the gathers took, say)."""
    needed = set(outputs)
    live = []
    for n in reversed(nodes):
        if any(o in needed for o in n.output):
            live.append(n)
            needed.update(t for t in n.input if t)
    return live[::-1]


def _same_outputs(model: onnx.ModelProto, rewritten: onnx.ModelProto) -> None:
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    feeds = {}
    for v in model.graph.input:
        dims = [d.dim_value for d in v.type.tensor_type.shape.dim]
        feeds[v.name] = rng.standard_normal(dims).astype(np.float32)
    run = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
           for m in (model, rewritten)]
    for a, b in zip(*run):
        if not np.allclose(a, b, rtol=1e-4, atol=1e-5):
            raise ValueError(f"dense_experts: the rewrite differs from the model by {np.abs(a - b).max():.3g} on a "
                             "seeded input, so its form was not read right")
