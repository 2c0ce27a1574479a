"""expert: a mixture of experts with its experts spread over the chips, one all-reduce to combine them.

A mixture of experts, as the operator graph holds it: a tree of ADDs (the
combine) with two or more leaves that are experts, each the output of a cone of
operators of its own (nothing outside reads into it) with a product by a
constant weight in it, every cone alike (the same operators, shapes and shared
inputs: the token's hidden state, the router's gates). Capacity-free: at a
batch of one every chip runs each of its experts on every row, and a gate of
zero (top-k left the expert out) zeroes its term, as the dense combine does.

Each chip runs what is not an expert (the router, the gating, what follows the
combine: it is small beside the experts' products), ``ceil(E / P)`` experts of
its own, sums their terms, and an all-reduce (:mod:`.collectives`) adds the chips'
sums. Where the experts do not divide the chips, the last chips' extra slots hold
a copy of an expert with zero weights, so that every chip's graph is alike and
the ranks share one schedule. A graph with no experts runs whole on one chip
(the router before a top-k on the host, say); a model with none at all is refused
(:func:`refuse_without_experts`), as are more chips than experts, so that a run never
takes fewer chips than asked without saying so. A block as exporters write it (its
top-k on the host, its experts gathered by index) is rewritten into this form by
:func:`lpx_tvm.expert_forms.dense_experts`, which :func:`lpx_tvm.compile` applies.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from math import ceil

import numpy as np

from ...runtime_sim import ChipConfig
from ...runtime_sim.system import SystemConfig
from ..graph import WEIGHTED, Graph, Node, NodeKind
from .base import Mapping, Part, SystemCompileError, strategy
from .collectives import CollectiveError, choose



@dataclass
class Experts:
    """A combine found in a graph: its ADD nodes (the root last), the experts' cones (node indexes in program
    order, one list per expert) and their output tensors, and the combine's other leaves (a residual)."""

    adds: list
    cones: list
    terms: list
    others: list

    @property
    def root(self) -> int:
        return self.adds[-1]


def find_experts(g: Graph) -> Experts | None:
    """The first mixture of experts in ``g`` (see the module docstring), or None."""
    producer = {node.output: i for i, node in enumerate(g.nodes)}
    readers = {}
    for i, node in enumerate(g.nodes):
        for t in node.inputs:
            readers.setdefault(g.base(t), []).append(i)
    outputs = {g.base(t) for t in g.outputs}
    for root in reversed(range(len(g.nodes))):
        if g.nodes[root].kind != "ADD" or _inside_add(g, root, readers, outputs):
            continue
        adds, leaves = _add_tree(g, root, producer, readers, outputs)
        shape = g.tensors[g.nodes[root].output].shape
        cones, terms, others = [], [], []
        for t in leaves:
            cone = _private_cone(g, t, producer, readers, outputs) if g.tensors[t].shape == shape else None
            if cone and any(g.nodes[i].kind in WEIGHTED and g.is_constant(g.base(g.nodes[i].inputs[1]))
                            for i in cone):
                cones.append(cone)
                terms.append(t)
            else:
                others.append(t)
        if len(cones) >= 2 and len({_signature(g, cone) for cone in cones}) == 1:
            ranked = sorted(zip(cones, terms))  # the experts in the order the model makes them
            return Experts(adds, [c for c, _ in ranked], [t for _, t in ranked], others)
    return None


def _inside_add(g: Graph, i: int, readers: dict, outputs: set) -> bool:
    """Whether node ``i``'s output feeds only another ADD (so it is inside a larger combine, not its root)."""
    t = g.nodes[i].output
    users = readers.get(t, [])
    # (a reader that takes a reshape of t is a leaf of its tree, not a parent: _add_tree follows t itself only,
    # so a combine reshaped before it is added to a shared expert is a root of its own)
    return t not in outputs and len(users) == 1 and g.nodes[users[0]].kind == "ADD" \
        and t in g.nodes[users[0]].inputs


def _add_tree(g: Graph, root: int, producer: dict, readers: dict, outputs: set) -> tuple:
    """The ADD nodes under ``root`` (program order) whose outputs only it reads, and the tree's leaf tensors."""
    adds, leaves, stack = [], [], [root]
    while stack:
        i = stack.pop()
        adds.append(i)
        for t in g.nodes[i].inputs:
            p = producer.get(g.base(t)) if g.base(t) == t else None
            if p is not None and g.nodes[p].kind == "ADD" and readers.get(t) == [i] and t not in outputs:
                stack.append(p)
            else:
                leaves.append(t)
    return sorted(adds), leaves


def _private_cone(g: Graph, t: int, producer: dict, readers: dict, outputs: set) -> list | None:
    """The nodes that make ``t`` and whose outputs nothing but those nodes reads (program order)."""
    start = producer.get(g.base(t))
    if start is None:
        return None
    cone, frontier = {start}, [start]
    while frontier:
        i = frontier.pop()
        for x in g.nodes[i].inputs:
            p = producer.get(g.base(x))
            if p is None or p in cone or g.base(x) in outputs:
                continue
            if all(r in cone for r in readers.get(g.base(x), [])):
                cone.add(p)
                frontier.append(p)
    # a node added before all its readers were in may have readers outside: drop those, to a fixpoint
    changed = True
    while changed:
        changed = False
        for i in sorted(cone):
            if i != start and not all(r in cone for r in readers.get(g.nodes[i].output, [])):
                cone.discard(i)
                changed = True
    return sorted(cone)


def _signature(g: Graph, cone: list) -> tuple:
    """What makes two experts' cones alike: each node's kind, attributes, shapes, and where each input comes
    from (a tensor made earlier in the cone, by position; a shared tensor, by id; a constant, by shape)."""
    made = {g.nodes[i].output: k for k, i in enumerate(cone)}
    rows = []
    for i in cone:
        node = g.nodes[i]
        ins = []
        for x in node.inputs:
            b = g.base(x)
            src = ("made", made[b]) if b in made else ("const",) if g.is_constant(b) else ("shared", b)
            ins.append(src + (g.tensors[x].shape, str(g.tensors[x].dtype)))
        rows.append((node.kind, repr(sorted(node.attrs.items())), tuple(ins), g.tensors[node.output].shape))
    return tuple(rows)


def _clone_cone(part: Graph, g: Graph, cone: list, zero: bool) -> tuple:
    """Copies of a cone's nodes into ``part`` over new tensors (constants copied, or zeros); returns the nodes
    and the tensor the clone's last node makes."""
    new, made = {}, {g.nodes[i].output for i in cone}

    def clone(t: int) -> int:
        b = g.base(t)
        if t in new:
            return new[t]
        if t != b:  # a reshape of a tensor: cloned with its base where that is the cone's own
            if clone(b) == b:
                return t
            new[t] = part.add_tensor(g.tensors[t].shape, g.tensors[t].dtype, alias_of=clone(b))
        elif b in made or g.is_constant(b):
            data = g.tensors[b].data
            if data is not None:
                new[t] = part.constant(np.zeros_like(data) if zero else data)
                if b in g.quantized:
                    q, scale, zp = g.quantized[b]
                    part.quantized[new[t]] = (np.broadcast_to(zp, q.shape).astype(q.dtype) if zero else q, scale, zp)
            else:
                new[t] = part.add_tensor(g.tensors[t].shape, g.tensors[t].dtype)
        else:
            return t  # shared: every expert reads the same tensor
        return new[t]

    nodes = [Node(g.nodes[i].kind, [clone(x) for x in g.nodes[i].inputs], clone(g.nodes[i].output),
                  dict(g.nodes[i].attrs), g.nodes[i].layer) for i in cone]
    return nodes, nodes[-1].output


def expert_graph(g: Graph, found: Experts, experts: list, rank: int, ranks: int, attrs: dict) -> Graph:
    """Chip ``rank``'s graph: what is not an expert, the experts ``experts`` (-1: a slot with zero weights),
    their terms summed, the chips' sums added by an all-reduce, then the rest of the combine."""
    part = copy.copy(g)
    part.tensors, part.quantized = list(g.tensors), dict(g.quantized)
    part.streamed = []
    in_cones = {i for cone in found.cones for i in cone}
    skipped = in_cones | set(found.adds)
    root = g.nodes[found.root]
    shape, dtype = g.tensors[root.output].shape, g.tensors[root.output].dtype
    section, local = [], None
    for e in experts:
        nodes, term = _clone_cone(part, g, found.cones[max(e, 0)], zero=e < 0)
        section += nodes
        if local is None:
            local = term
        else:
            total = part.add_tensor(shape, dtype)
            section.append(Node("ADD", [local, term], total, {}, root.layer + "+experts"))
            local = total
    summed = part.add_tensor(shape, dtype) if found.others else root.output
    section.append(Node(NodeKind.ALLREDUCE, [local], summed, {"rank": rank, "ranks": ranks, "tag": 0, "rotated": False,
                                                        **attrs}, root.layer + "+allreduce"))
    for k, t in enumerate(found.others):  # the residual (or whatever else the combine adds), once, after
        out = root.output if k == len(found.others) - 1 else part.add_tensor(shape, dtype)
        section.append(Node("ADD", [summed, t], out, {}, root.layer))
        summed = out
    part.nodes = []
    for i, node in enumerate(g.nodes):
        if i == found.root:
            part.nodes += section
        elif i not in skipped:
            part.nodes.append(node)
    return part


def refuse_without_experts(programs: dict, system: SystemConfig, chips: int | None) -> None:
    """Raise where ``parallel="expert"`` found no mixture of experts in any of a model's functions.

    A function with no experts runs whole on one chip (the router before a host top-k, say), which is right
    beside a function whose experts spread; a model with none at all would run on one chip of the several
    asked for, and say nothing.

    Parameters
    ----------
    programs : dict
        Function name ─► its :class:`~lpx_tvm.runtime_sim.system_sim.SystemProgram`.
    system : SystemConfig
    chips : int or None
        The chips asked for (None: all of ``system``'s).

    Raises
    ------
    SystemCompileError
        When more than one chip was asked for and every program runs on one.
    """
    asked = chips or system.chips
    if asked > 1 and programs and all(len(p.chips) == 1 for p in programs.values()):
        raise SystemCompileError(
            f"expert parallel: no mixture of experts in the model's {len(programs)} lpx function(s), so it "
            f"would run on 1 chip of the {asked} asked for. Experts are found as two or more alike cones, each "
            "with a product by a constant weight, summed by a tree of adds. A block whose router's top-k runs on "
            "the host (TopK, then ScatterElements into gates, or GatherND of the experts' stacked weights, as "
            "torch.onnx exports Hugging Face's) parts its experts or gathers them by index: lpx_tvm.compile "
            "rewrites the forms lpx_tvm.expert_forms.dense_experts reads; choose another --parallel for others")


def _has_experts(g: Graph) -> bool:
    return find_experts(g) is not None


@strategy("expert", "a mixture of experts' experts spread over the chips, the rest on every chip, one all-reduce "
          "to combine", applies=_has_experts)
def split_experts(g: Graph, chip: ChipConfig, system: SystemConfig, dtype: str, chips: int | None) -> Mapping:
    """``g``'s experts over ``chips`` chips of ``system`` (default: all, at most one an expert)."""
    found = find_experts(g)
    everywhere = tuple(((0, k),) for k in range(len(g.inputs)))
    if found is None:
        return Mapping("expert", [Part(0, g)], everywhere, tuple((0, k) for k in range(len(g.outputs))),
                       "no mixture of experts: whole on chip 0")
    count = len(found.cones)
    if chips is not None and chips > count:
        # taking fewer chips than asked would be silent; a chip with no expert of its own would only idle
        raise SystemCompileError(f"expert parallel: {count} experts do not spread over {chips} chips (each chip "
                                 f"runs at least one expert); ask for {count} chips or fewer")
    ranks = min(chips or system.chips, system.chips, count)
    width = g.tensors[g.nodes[found.root].output].shape[-1]
    if width % ranks:
        raise SystemCompileError(f"expert parallel: the experts' output ({width} wide) does not split into "
                                 f"{ranks} blocks for the all-reduce; try chips that divide {width}")
    per_chip = ceil(count / ranks)
    if count % ranks and any(g.base(n.inputs[1]) in g.quantized for c in found.cones for n in
                             (g.nodes[i] for i in c) if len(n.inputs) > 1):
        raise SystemCompileError(f"expert parallel: {count} int8 experts do not divide over {ranks} chips")
    try:
        group = choose(system, ranks)
    except CollectiveError as err:
        raise SystemCompileError(str(err)) from None
    order = list(group.chips)
    parts = []
    for rank, chip_id in enumerate(order):
        mine = [e if e < count else -1 for e in range(rank * per_chip, (rank + 1) * per_chip)]
        part = expert_graph(g, found, mine, rank, ranks, {"group": group})
        parts.append(Part(chip_id, part, stored=None if rank == 0 else ()))
    inputs = tuple(tuple((c, k) for c in order) for k in range(len(g.inputs)))
    outputs = tuple(((order[0], k),) for k in range(len(g.outputs)))
    padded = ranks * per_chip - count
    notes = (f"{count} experts over {ranks} chips {order}, {per_chip} a chip"
             + (f" ({padded} slots of zero weights)" if padded else "") + ", 1 all-reduce")
    return Mapping("expert", parts, inputs, outputs, notes, spmd=True)
