"""pipeline: the graph's operators, in order, cut into one stage per chip.

The stages are balanced by their estimated cycles, each stage's weights under
its chip's budget. A tensor one stage makes and a later one reads goes chip to
chip (through the stages between, which pass it on) as a ``send`` node at its
maker's end and a ``recv`` node at the reader's; model inputs and outputs move
over each chip's own host link. The runner compiles the stages in order, each
RECV pinned at the cycle its SEND's data arrives.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from math import prod

import numpy as np

from ...runtime_sim import ChipConfig
from ...runtime_sim.system import SystemConfig
from ..alloc import current_held
from ..graph import WEIGHTED, Graph, Node, NodeKind, layer_label
from .base import Mapping, Part, SystemCompileError, chip_order, node_weights, strategy, weight_budget


@dataclass
class Stage:
    """One chip's part of a pipeline: its nodes, and where its tensors come from and go."""

    chip: int
    nodes: list
    inputs: list  # model inputs it loads (tensor ids)
    received: list  # (tensor id, from chip)
    outputs: list  # model outputs it stores (tensor ids)
    sent: list  # (tensor id, to chip)


# ---- cost and capacity estimates ------------------------------------------------------------------------
def node_cycles(g: Graph, node, chip: ChipConfig, dtype: str) -> float:
    """A rough cycle estimate of one operator, only to balance stages: matrix work at the planes' peak or its
    weights' installation over every plane, whichever is longer, the rest a vector per cycle; each plus its
    unit's latency (which is most of a one-token decode step)."""
    out = prod(g.tensors[node.output].shape)
    if node.kind in WEIGHTED:
        w = g.tensors[node.inputs[1]]
        k = prod(w.shape[1:]) if node.kind.endswith(NodeKind.CONV2D) else w.shape[-2] if len(w.shape) >= 2 else 1
        peak = chip.mxm_peak_macs_per_cycle(dtype if dtype in chip.mxm_passes else "fp32")
        install = w.nbytes / (chip.mxm_planes * chip.mxm_install_streams * chip.lanes)
        return max(out * k / peak, install) + chip.latency_cycles["MXM"]
    return out / chip.lanes + chip.latency_cycles["VXM"]


def crossing_bytes(g: Graph) -> list:
    """``out[i]``: bytes of the tensors a cut before node ``i`` would send on (made before it, read at or
    after it; model inputs and resident tensors do not travel, and a model output is stored by the stage that
    makes it, as :func:`plan_pipeline` does)."""
    made = {g.nodes[i].output: i for i in range(len(g.nodes))}
    last = {}
    for i, node in enumerate(g.nodes):
        for t in node.inputs:
            if g.base(t) in made:
                last[g.base(t)] = i
    delta = [0] * (len(g.nodes) + 2)
    for t, end in last.items():  # live across every cut in (made, end]
        delta[made[t] + 1] += g.tensors[t].nbytes
        delta[end + 1] -= g.tensors[t].nbytes
    out, live = [], 0
    for i in range(len(g.nodes) + 1):
        live += delta[i]
        out.append(live)
    return out


def split_stages(g: Graph, chip: ChipConfig, chips: int, dtype: str, budget: int, exact: bool = True,
                 pins=None) -> list:
    """Contiguous runs of node indexes, ``min(chips, nodes)`` of them (or, unless ``exact``, fewer where fewer
    do as well), each holding at most ``budget`` bytes of weights. First the smallest largest stage that can
    be had (a stage's estimated cycles and the send of what crosses its end); then, of the splits whose stages
    all stay within 10% of that, the one whose transfers cost least: every token waits for every transfer,
    while balance only sets the pipeline's rate. In a transformer that cuts at layer boundaries, where the
    hidden state alone crosses.

    ``pins[i]`` (where given and not -1): the stage node ``i`` must be in, ``chips`` stages exactly (the
    stages of another model over the same held weights, :func:`weight_pins`)."""
    costs = [node_cycles(g, n, chip, dtype) for n in g.nodes]
    weights = [node_weights(g, n) for n in g.nodes]
    n = len(g.nodes)
    for i, w in enumerate(weights):
        need = sum(g.tensors[t].nbytes for t in w)
        if need > budget:
            raise SystemCompileError(f"layer {layer_label(g.nodes[i].layer)} alone has {need} bytes of weights, more than a "
                                     f"chip's budget of {budget} ({chip.name}): it cannot be pipelined whole")
    crossing = crossing_bytes(g)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    reach = []  # reach[a]: the first node whose weights no longer fit beside those of the nodes from a on
    for start in range(n):
        held, size, e = set(), 0, start
        while e < n:
            new = weights[e] - held
            size += sum(g.tensors[t].nbytes for t in new)
            if size > budget:
                break
            held |= new
            e += 1
        reach.append(e)

    # every run [a, b) at once: rows a, columns b (b == n ends the model: nothing crosses it)
    starts, ends = np.arange(n + 1)[:, None], np.arange(n + 1)[None, :]
    after = np.where(ends < n, np.asarray(crossing, np.float64)[ends] / chip.c2c_bytes_per_cycle, 0.0)
    stage = np.asarray(prefix)[ends] - np.asarray(prefix)[starts] + after
    fits = (starts < ends) & (ends <= np.append(reach, n)[starts])

    stages = min(chips, n)
    balanced = _split(n, stages, fits, stage, np.maximum, pins=pins)
    if balanced is None and pins is not None:
        return None  # the held weights' stages cannot be kept: the caller splits afresh
    if balanced is None:
        total = sum(g.tensors[t].nbytes for t in set().union(*weights)) if weights else 0
        raise SystemCompileError(f"the model's {total} bytes of weights need more than {chips} chips at "
                                 f"{budget} bytes a chip")
    limit = 1.1 * balanced[0]
    send = chip.latency_cycles["C2C"]  # and a hop or more: a stage fewer is a transfer fewer
    transfer = np.broadcast_to(np.where(ends < n, after + send, 0.0), stage.shape)
    lean = _split(n, stages, fits & (stage <= limit), transfer, np.add, fewer=not exact and pins is None, pins=pins)
    return (lean or balanced)[1]


def weight_pins(g: Graph, order: list):
    """``(stages, pins)``: where a model compiled before over the same held weights (see
    :func:`~lpx_tvm.codegen.alloc.held_weights_first`) put them, each node that reads one pinned to the stage
    on that chip (``order``: the chips stages go on), -1 where free; None where nothing is held there, or a
    weight's chip is not among ``order``."""
    held = current_held()
    if held is None or not held.homes:
        return None
    pins = np.full(len(g.nodes), -1)
    for i, node in enumerate(g.nodes):
        for t in node_weights(g, node):
            where = held.place(g.tensors[t].data) if g.tensors[t].data is not None else ()
            home = held.homes.get(where[0]) if where else None
            if home is None:
                continue
            if home not in order or pins[i] not in (-1, order.index(home)):
                return None
            pins[i] = order.index(home)
    return (int(pins.max()) + 1, pins) if (pins >= 0).any() else None


def _split(n: int, stages: int, allowed: np.ndarray, cost: np.ndarray, combine, fewer: bool = False, pins=None):
    """``(value, runs)``: ``stages`` contiguous runs (or, with ``fewer``, as many up to that as is best)
    covering nodes ``[0, n)``, each ``[a, b)`` ``allowed[a, b]``, that minimise the runs' ``cost[a, b]`` folded
    by ``combine`` (``np.maximum`` or ``np.add``); None when there are none. Of equal values the earliest
    start wins. One pass of numpy over every (start, end) per run added: a Python loop over the pairs took
    most of a rack's compile. ``pins[i]`` (not -1): node ``i`` must be in run ``pins[i]``."""
    cost = np.where(allowed, cost, np.inf)
    value = np.full(n + 1, np.inf)
    value[0] = 0.0  # value[e]: the best k runs covering [0, e)
    best, starts = [], []
    for k in range(1, stages + 1):
        run_cost = cost
        if pins is not None:  # run k - 1 may hold no node pinned elsewhere
            elsewhere = np.concatenate([[0], np.cumsum((pins >= 0) & (pins != k - 1))])
            run_cost = np.where(elsewhere[None, :] == elsewhere[:, None], cost, np.inf)
        options = combine(value[:, None], run_cost)  # [start, end]
        start = options.argmin(axis=0)
        value = options[start, np.arange(n + 1)]
        last = n + 1 if fewer else n - (stages - k) + 1
        value[:k] = np.inf
        value[last:] = np.inf
        best.append(value[n])
        starts.append(start)
    done = [k for k in range(1, stages + 1) if np.isfinite(best[k - 1])] if fewer else \
        [stages] * bool(np.isfinite(best[stages - 1]))
    if not done:
        return None
    used = min(done, key=lambda k: (best[k - 1], k))
    runs, e = [], n
    for k in range(used, 0, -1):
        a = int(starts[k - 1][e])
        runs.append(list(range(a, e)))
        e = a
    return float(best[used - 1]), runs[::-1]


def plan_pipeline(g: Graph, runs: list, chips: list) -> list:
    """Stages for ``runs`` of nodes on ``chips`` (in order): what each loads, receives, stores and sends."""
    stage_of = {}
    for s, run in enumerate(runs):
        for i in run:
            stage_of[g.nodes[i].output] = s
    last_use = {}
    for s, run in enumerate(runs):
        for i in run:
            for t in g.nodes[i].inputs:
                last_use[g.base(t)] = max(last_use.get(g.base(t), -1), s)
    stages = [Stage(chips[s], list(run), [], [], [], []) for s, run in enumerate(runs)]
    for s, stage in enumerate(stages):
        reads = {g.base(t) for i in stage.nodes for t in g.nodes[i].inputs}
        stage.inputs = [t for t in g.inputs if g.base(t) in reads]
        stage.outputs = [t for t in g.outputs if stage_of.get(g.base(t)) == s]
    for t, last in last_use.items():  # a tensor travels stage to stage from its maker to its last reader
        made = stage_of.get(t)
        if made is None:  # a model input or a resident tensor: each stage loads or holds its own
            continue
        for s in range(made, last):
            stages[s].sent.append((t, stages[s + 1].chip))
            stages[s + 1].received.append((t, stages[s].chip))
    return stages


def stage_graph(g: Graph, stage: Stage, system: SystemConfig, tags: dict) -> Graph:
    """The stage's part of ``g``: a ``recv`` node for each tensor it receives, its nodes, a ``send`` node for
    each tensor it passes on; the model's inputs it loads and outputs it stores."""
    part = copy.copy(g)
    recvs = [Node(NodeKind.RECV, [], t, {"peer": peer, "tag": tags[(t, peer, stage.chip)],
                                   "port": system.route(peer, stage.chip)[-1][3]}, NodeKind.RECV)
             for t, peer in stage.received]
    # a send makes nothing: its output names the tensor it sends
    sends = [Node(NodeKind.SEND, [t], t, {"peer": peer, "tag": tags[(t, stage.chip, peer)],
                                    "port": system.route(stage.chip, peer)[0][1]}, NodeKind.SEND)
             for t, peer in stage.sent]
    part.nodes = recvs + [g.nodes[i] for i in stage.nodes] + sends
    part.inputs, part.outputs = list(stage.inputs), list(stage.outputs)
    part.streamed = []
    return part


@strategy("pipeline", "consecutive layers on consecutive chips; a stage passes what later stages read")
def split_pipeline(g: Graph, chip: ChipConfig, system: SystemConfig, dtype: str, chips: int | None) -> Mapping:
    """``g`` as a pipeline over ``chips`` chips of ``system`` (default: as many of them as shorten its longest
    stage, :func:`split_stages`), each a neighbour of the one before where the topology allows."""
    n = min(chips or system.chips, system.chips, max(len(g.nodes), 1))
    budget = weight_budget(g, chip)
    pinned = weight_pins(g, chip_order(system, system.chips))
    runs = None
    # as few stages as keep the held weights on their chips, or one or two more (after the last weight, the
    # first model may have had a stage of unheld weights: a tied head's transposed table)
    for count in range(pinned[0], min(pinned[0] + 3, n + 1)) if pinned else ():
        runs = split_stages(g, chip, count, dtype, budget, pins=pinned[1])
        if runs is not None:
            break
    if runs is None:
        runs = split_stages(g, chip, n, dtype, budget, exact=chips is not None)
    stages = plan_pipeline(g, runs, chip_order(system, len(runs)))
    tags = {}
    for stage in stages:
        for t, peer in stage.sent:
            tags[(t, stage.chip, peer)] = len(tags)
    parts = [Part(stage.chip, stage_graph(g, stage, system, tags), budget) for stage in stages]
    inputs = tuple(tuple((st.chip, st.inputs.index(t)) for st in stages if t in st.inputs) for t in g.inputs)
    outputs = tuple(next((st.chip, st.outputs.index(t)) for st in stages if t in st.outputs) for t in g.outputs)
    return Mapping("pipeline", parts, inputs, outputs, f"{len(stages)} stages on chips {[st.chip for st in stages]}")
