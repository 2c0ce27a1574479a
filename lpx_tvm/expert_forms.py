"""Mixtures of experts as exporters write them, rewritten into the form expert parallelism spreads.

:func:`dense_experts` reads a block whose router's top-k runs on the host (``torch.onnx``'s export of a Hugging
Face Mixtral, Qwen3-MoE or gpt-oss block, each choice's expert weights gathered by index; or experts of their own
gated by a ScatterElements and a Gather) and writes it as alike experts, each scaled by its gate column, the terms
summed, with the top-k as arithmetic on lpx (:mod:`lpx_tvm.app.models.moe` describes that form).
:func:`lpx_tvm.compile` applies it under ``parallel="expert"`` or ``"auto"`` on a system.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper


# 2**100: (max - p) · BIG reaches 1 for any two scores that differ by 1e-30 or more (fp32 tops out at
# 3.4e38, so a difference of up to 1e8 does not overflow)
_BIG = float(2 ** 100)


def dense_experts(model: onnx.ModelProto, check: bool = True) -> onnx.ModelProto:
    """A mixture of experts whose router's top-k runs on the host, rewritten so its experts can spread.

    Two forms are read. ``torch.onnx.export(dynamo=True)`` writes a Hugging Face Mixtral, Qwen3-MoE or
    gpt-oss block (transformers' ``batched_mm`` experts, the ones it can trace) as a router, a TopK, the
    top-k weights (renormalised, or a softmax of the top-k logits, where the model says so), then each
    (token, choice) pair's expert weights and biases gathered (GatherND) from stacked ``[experts, ...]``
    constants and applied in a batched product. No expert is a product of its own there, so nothing can put
    one on a chip; each expert becomes a copy of the per-pair computation on every token with its own slices
    of the constants, scaled by its gate. A block with experts of their own (``nn.ModuleList``) gated by a
    ScatterElements of the top-k into zeros and a Gather of each expert's column keeps its experts; its
    gates are made on lpx instead. Either way the result is the form
    :mod:`lpx_tvm.codegen.parallel.expert` spreads: alike experts, each scaled by its gate, the terms summed.

    The top-k runs on lpx as arithmetic (a row maximum k times, each step pushing the maximum below the
    row): a score is kept where it is at least the k-th largest, tested as
    ``relu(1 - relu((kth - s) · 2**100))``, so two scores closer than 1e-30 count as tied, and tied scores
    are all kept where TopK would keep one. Each expert takes its gate by a product with a one-hot column.
    A TopK whose values or indices the model also outputs (gpt-oss's router scores) stays on the host for
    that output.

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
    unsized = [f"{v.name}{[d.dim_value or d.dim_param or '?' for d in v.type.tensor_type.shape.dim]}"
               for v in model.graph.input if any(not d.dim_value for d in v.type.tensor_type.shape.dim)]
    if unsized:  # the experts are copied per token count and the top-k's weights shaped by it
        raise ValueError(f"dense_experts: needs static shapes; pin {', '.join(unsized)} (--input-shape)")
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
    if not topks:
        raise ValueError("dense_experts: a mixture of experts routes by a TopK; this model has none")
    topk = topks[-1]  # the one that picks the experts; any before it pick groups of them (DeepSeek-V3's)
    attrs = {a.name: helper.get_attribute_value(a) for a in topk.attribute}
    if topk.input[1] not in inits or attrs.get("largest", 1) != 1 or attrs.get("axis", -1) not in (-1, 1):
        raise ValueError("dense_experts: the TopK does not take the largest of each row with a constant k")
    k = int(numpy_helper.to_array(inits[topk.input[1]]).reshape(-1)[0])
    emit = _Emit(model)
    scatters = [n for n in readers.get(topk.output[1], []) if n.op_type == "ScatterElements"]
    if scatters:
        dropped = _scatter_form(g, topk, k, scatters, inits, shapes, producer, readers, emit)
    else:
        dropped = _gathered_form(g, topk, k, inits, shapes, producer, readers, emit)
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


def _gates(emit: _Emit, scores: str, k: int, form: str, weights: str | None = None, scale: float = 1.0) -> str:
    """The ``[tokens, experts]`` gates, 0 off the top-k of ``scores``, on lpx: of ``weights`` (default: the
    scores), ``form`` "softmax" (of the k kept), "renormalised" (the k kept over their sum) or "as is", times
    ``scale``."""
    kept, top = _top_k(emit, scores, k)
    if form == "softmax":  # exp of each less the row's maximum, over their sum
        shifted = emit.node("Mul", [emit.node("Exp", [emit.node("Sub", [scores, top], "shifted")], "exp"), kept],
                            "kept_exp")
        gates = emit.node("Div", [shifted, emit.row_sum(shifted, "kept_sum")], "gates")
    else:
        gates = emit.node("Mul", [weights or scores, kept], "kept_scores")
        if form == "renormalised":
            gates = emit.node("Div", [gates, emit.row_sum(gates, "kept_sum")], "gates")
    if scale != 1.0:
        gates = emit.node("Mul", [gates, emit.const("scale", scale)], "scaled_gates")
    return gates


def _column(emit: _Emit, gates: str, e: int, experts: int) -> str:
    """Expert ``e``'s gate, ``[tokens, 1]``: its column of the gates, as a product by a one-hot column."""
    return emit.node("MatMul", [gates, emit.const(f"{e}.select", np.eye(experts)[:, e:e + 1])], f"{e}.gate")


def _ungrouped(scores: str, producer: dict, inits: dict, shapes: dict) -> str:
    """The scores a TopK picks experts from, past a group-limited routing's mask where the mask keeps every
    group (DeepSeek-V3 with ``topk_group == n_group``: a Where that fills the experts of unchosen groups)."""
    where = producer.get(scores)
    if where is None or where.op_type != "Where":
        return scores
    pending, seen = [where.input[0]], set()
    while pending:  # the TopK that chose the groups, above the mask
        t = pending.pop()
        p = producer.get(t)
        if p is None or id(p) in seen:
            continue
        seen.add(id(p))
        if p.op_type == "TopK":
            k = int(numpy_helper.to_array(inits[p.input[1]]).reshape(-1)[0]) if p.input[1] in inits else None
            if k is not None and k == shapes.get(p.input[0], [None])[-1]:
                return where.input[2]
            raise ValueError(f"dense_experts: the routing is limited to {k} groups of experts of "
                             f"{shapes.get(p.input[0], ['?'])[-1]} (topk_group < n_group), which is not handled")
        pending += [x for x in p.input if x]
    raise ValueError("dense_experts: the top-k's scores pass a Where that no group choice makes")


def _downstream(g, sources) -> list:
    """The nodes of ``g`` that read, directly or not, one of the tensors ``sources`` (graph order)."""
    reached, out = set(sources), []
    for n in g.node:
        if any(t in reached for t in n.input):
            out.append(n)
            reached.update(n.output)
    return out


# what an expert may do to its token between its gathered weights and its output: ops that keep the token axis
# where it is (so that they run as well on the tokens as on the (token, choice) pairs)
_PER_PAIR_OPS = {"GatherND", "MatMul", "Unsqueeze", "Squeeze", "Split", "Slice", "Add", "Sub", "Mul", "Div",
                 "Sigmoid", "Tanh", "Relu", "Erf", "Clip"}


def _gathered_form(g, topk, k, inits, shapes, producer, readers, emit: _Emit) -> set:
    """Hugging Face's batched experts as exported (Mixtral, Qwen3-MoE, gpt-oss): each (token, choice) pair's
    expert weights (and biases) gathered by index from stacked ``[experts, ...]`` constants, the pair's token
    taken through them, the result scaled by the choice's weight, the choices summed.

    Each expert becomes a copy of that per-pair computation on every token with its own slices of the stacked
    constants (a batched product by a gathered matrix a plain product), its output scaled by its gate. Emits in
    ``emit``; returns the ids of the nodes whose outputs it makes.
    """
    scores = _ungrouped(topk.input[0], producer, inits, shapes)
    experts = shapes[scores][-1]
    # the choices' weights: the top-k values, or another score taken at the chosen indices (DeepSeek-V3 picks by
    # its scores plus a bias and weighs by the scores alone)
    taken = [n for n in readers.get(topk.output[1], []) if n.op_type == "GatherElements"]
    values = _downstream(g, [topk.output[0]] + [n.output[0] for n in taken])
    value_made = {t for n in values for t in n.output} | {topk.output[0]} | {n.output[0] for n in taken}
    pairs = [n for n in _downstream(g, [topk.output[1]]) if n.output[0] not in value_made]
    pair_made = {t for n in pairs for t in n.output}
    weighting = next((n for n in g.node if n.op_type == "Mul" and len(n.input) == 2
                      and {n.input[0] in value_made, n.input[1] in value_made} == {True, False}
                      and (n.input[0] in pair_made or n.input[1] in pair_made)), None)
    if weighting is None:
        raise ValueError("dense_experts: no product scales the experts' outputs by the top-k weights")
    out = next(t for t in weighting.input if t in pair_made)
    gathers = [n for n in pairs if n.op_type == "GatherND"]
    if not gathers or any(n.input[0] not in inits or shapes[n.input[0]][0] != experts for n in gathers):
        raise ValueError("dense_experts: the experts are not gathered by index (GatherND) from stacked "
                         f"[{experts}, ...] constants")
    router = producer.get(scores)
    while router is not None and router.op_type not in ("Gemm", "MatMul"):
        router = producer.get(router.input[0])
    if router is None:
        raise ValueError("dense_experts: the top-k's scores do not come from a product (the router)")
    x = router.input[0]
    tokens, hidden = shapes[x]
    combine = next((n for n in _downstream(g, weighting.output) if n.op_type == "ReduceSum"
                    and shapes.get(n.output[0]) == [tokens, hidden]), None)
    if combine is None:
        raise ValueError(f"dense_experts: no ReduceSum after the weighting makes the block's [{tokens}, {hidden}] "
                         "output")
    gathered = {n.output[0] for n in gathers}
    position = {id(n): i for i, n in enumerate(g.node)}
    expert = sorted(_per_pair(producer[out], producer, {id(n) for n in pairs}, gathered),
                    key=lambda n: position[id(n)])
    expert_ids = {id(n) for n in expert}
    # the tensors an expert reads from outside itself, besides constants and what it gathers: the repeated tokens
    outer = {t for n in expert if n.op_type != "GatherND" for t in n.input
             if t and t not in inits and id(producer.get(t)) not in expert_ids}
    repeated = outer - gathered
    odd = sorted({n.op_type for n in expert} - _PER_PAIR_OPS)
    if odd or len(repeated) != 1 or shapes.get(next(iter(repeated)), [None])[-1] != hidden:
        raise ValueError("dense_experts: the experts' per-pair computation "
                         + (f"has {', '.join(odd)}, which moves the token axis" if odd else
                            f"reads {sorted(repeated)} besides its gathered weights, not one repeated token"))
    (repeated,) = repeated
    chain = [n for n in values if any(t in value_made for t in n.output)
             and id(n) in {id(m) for m in _above(weighting, producer, value_made)}]
    odd = sorted({n.op_type for n in chain} - {"Softmax", "ReduceSum", "Div", "Mul", "Reshape", "Unsqueeze"})
    scale = 1.0
    for n in chain:
        if n.op_type == "Mul":  # a constant factor (DeepSeek-V3's routed_scaling_factor)
            factor = [t for t in n.input if t in inits and numpy_helper.to_array(inits[t]).size == 1]
            if not factor:
                odd.append("Mul by a tensor")
                continue
            scale *= float(numpy_helper.to_array(inits[factor[0]]).reshape(-1)[0])
    if odd or len(taken) > 1:
        raise ValueError(f"dense_experts: the top-k weights pass {', '.join(odd) or 'two GatherElements'}, not a "
                         "softmax, a renormalisation or a constant factor")
    form = ("softmax" if any(n.op_type == "Softmax" for n in chain) else
            "renormalised" if any(n.op_type == "Div" for n in chain) else "as is")
    weights = taken[0].input[0] if taken else None
    if form == "softmax" and weights is not None:
        raise ValueError("dense_experts: a softmax of weights taken apart from the picking scores is not handled")
    gates = _gates(emit, scores, k, form, weights, scale)
    acc, y = None, combine.output[0]
    for e in range(experts):
        made = _clone_expert(emit, expert, e, {repeated: x}, {n.output[0]: n.input[0] for n in gathers}, inits,
                             producer, shapes)
        term = emit.node("Mul", [made[out], _column(emit, gates, e, experts)], f"{e}.term")
        last = e == experts - 1
        acc = term if acc is None else emit.node("Add", [acc, term], y if last else f"{e}.sum", keep_name=last)
    return {id(combine)}  # (the rest goes with nothing to read it, unless the model outputs it)


def _per_pair(last, producer: dict, pairs: set, gathered: set) -> list:
    """The nodes that make ``last`` from the gathered weights and the repeated tokens (graph order of the
    search): up through the nodes ``pairs`` (ids) made after the top-k's indices, stopping at each GatherND,
    and through the Unsqueeze that lifts a row into a batched product by a gathered matrix."""
    seen, stack = {id(last): last}, [last]
    while stack:
        n = stack.pop()
        if n.op_type == "GatherND":
            continue
        for t in n.input:
            p = producer.get(t)
            lift = (p is not None and p.op_type == "Unsqueeze" and n.op_type == "MatMul"
                    and any(x in gathered for x in n.input))
            if p is not None and id(p) not in seen and (id(p) in pairs or lift):
                seen[id(p)] = p
                stack.append(p)
    return list(seen.values())


def _above(node, producer: dict, within: set) -> list:
    """The nodes making ``node``'s inputs whose outputs are in ``within`` (tensor names), transitively."""
    out, stack, seen = [], [node], set()
    while stack:
        for t in stack.pop().input:
            p = producer.get(t)
            if p is not None and t in within and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
                stack.append(p)
    return out


def _clone_expert(emit: _Emit, expert: list, e: int, renamed: dict, gathered: dict, inits, producer,
                  shapes) -> dict:
    """Expert ``e``'s copy of the per-pair nodes ``expert``: a gathered tensor its slice ``e`` of the stacked
    constant, ``Squeeze(MatMul(Unsqueeze(a), gathered))`` (and the matrix-first form) a product of ``a`` by
    that slice, a Clip with constant bounds written in Relu (the importer leaves a Clip with tensor bounds on
    the host). Returns the map from the originals' tensor names to the copy's."""
    names = dict(renamed)
    slices = {t: numpy_helper.to_array(inits[w])[e] for t, w in gathered.items()}
    by_output = {n.output[0]: n for n in expert}
    skip, products = set(), {}
    for n in expert:  # the batched products by a gathered matrix, and the Unsqueeze and Squeeze around them
        if n.op_type != "MatMul" or not any(t in slices for t in n.input):
            continue
        w_first = n.input[0] in slices
        w, a = (n.input[0], n.input[1]) if w_first else (n.input[1], n.input[0])
        lift = by_output.get(a)
        squeeze = [m for m in expert if n.output[0] in m.input]
        if lift is None or lift.op_type != "Unsqueeze" or len(squeeze) != 1 or squeeze[0].op_type != "Squeeze":
            raise ValueError("dense_experts: a gathered matrix is used other than in a batched product of one "
                             "token")
        skip.update({id(lift), id(squeeze[0])})
        products[id(n)] = (lift.input[0], squeeze[0].output[0], slices[w].T if w_first else slices[w])
    for n in expert:
        if id(n) in skip or n.op_type == "GatherND":
            continue

        def name(t):
            if t in names:
                return names[t]
            if t in slices:
                names[t] = emit.const(f"{e}.{t}", slices[t])
            return names.get(t, t)

        if id(n) in products:
            a, result, w = products[id(n)]
            names[result] = emit.node("MatMul", [name(a), emit.const(f"{e}.{result}.w", w)], f"{e}.{result}")
        elif n.op_type == "Clip":
            t = name(n.input[0])
            if len(n.input) > 1 and n.input[1]:
                low = name(n.input[1])  # max(t, low) = low + relu(t - low)
                t = emit.node("Add", [emit.node("Relu", [emit.node("Sub", [t, low], f"{e}.{n.output[0]}.lo")],
                                                f"{e}.{n.output[0]}.lor"), low], f"{e}.{n.output[0]}.l")
            if len(n.input) > 2 and n.input[2]:
                high = name(n.input[2])  # min(t, high) = high - relu(high - t)
                t = emit.node("Sub", [high, emit.node("Relu", [emit.node("Sub", [high, t], f"{e}.{n.output[0]}.hi")],
                                                      f"{e}.{n.output[0]}.hir")], f"{e}.{n.output[0]}.h")
            names[n.output[0]] = t
        else:
            copy = helper.make_node(n.op_type, [name(t) if t else "" for t in n.input],
                                    [f"moe.{e}.{t}" for t in n.output])
            copy.attribute.extend(n.attribute)
            emit.nodes.append(copy)
            names.update({t: f"moe.{e}.{t}" for t in n.output})
    return names


def _scatter_form(g, topk, k, scatters, inits, shapes, producer, readers, emit: _Emit) -> set:
    """Experts of their own, gated from a ScatterElements of the top-k weights into zeros and a Gather of each
    expert's column (a hand-written block, or one that loops over ``nn.ModuleList`` experts). Emits the gates
    on lpx and each expert's column by a product with a one-hot column; returns the ids of the nodes whose
    outputs it makes.
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

    gates = _gates(emit, scores, k, form)
    for n in selects:
        e = int(numpy_helper.to_array(inits[n.input[1]]).reshape(-1)[0]) % experts
        column = _column(emit, gates, e, experts)
        shape = emit.const(f"{e}.shape", np.array(shapes[n.output[0]]), np.int64)
        emit.node("Reshape", [column, shape], n.output[0], keep_name=True)
    return {id(n) for n in selects}  # (the TopK and the scatter go with nothing to read them)


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
        dtype = onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type)
        # (an integer input, token ids say, is fed zeros: any seeded floats would do for the rest)
        feeds[v.name] = (rng.standard_normal(dims) if dtype.kind == "f" else np.zeros(dims)).astype(dtype)
    run = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
           for m in (model, rewritten)]
    for a, b in zip(*run):
        if not np.allclose(a, b, rtol=1e-4, atol=1e-5):
            raise ValueError(f"dense_experts: the rewrite differs from the model by {np.abs(a - b).max():.3g} on a "
                             "seeded input, so its form was not read right")
