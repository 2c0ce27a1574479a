"""system: compile one model's operator graph for a system of chips, every transfer scheduled at both ends.

Pipeline parallel: the graph's operators, in order, are cut into one stage per
chip, balanced by their estimated cycles with each stage's weights under its
chip's budget. A tensor one stage makes and a later one reads goes chip to
chip (through the stages between, which pass it on); model inputs and outputs
move over each chip's own host link. The stages are compiled one after the
other: a stage's RECVs are pinned at the cycles its predecessor's SENDs arrive.
Tensor parallel is :mod:`.tensor`'s.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from math import prod

from ..runtime_sim import ChipConfig, Opcode
from ..runtime_sim.system import SystemConfig
from ..runtime_sim.system_sim import SystemProgram
from .alloc import allocate
from .emit import emit, resolve
from .graph import Graph
from .schedule import schedule
from .tile import TileOp, tile
from .views import whole

PARALLEL = ("pipeline", "tensor", "auto")


class SystemCompileError(ValueError):
    """A model that cannot be mapped onto a system (it does not fit, or the system cannot carry it)."""


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
    if node.kind in ("conv2d", "qconv2d", "matmul", "qmatmul"):
        w = g.tensors[node.inputs[1]]
        k = prod(w.shape[1:]) if node.kind.endswith("conv2d") else w.shape[-2] if len(w.shape) >= 2 else 1
        peak = chip.mxm_peak_macs_per_cycle(dtype if dtype in chip.mxm_passes else "fp32")
        install = w.nbytes / (chip.mxm_planes * chip.mxm_install_streams * chip.lanes)
        return max(out * k / peak, install) + chip.latency_cycles["MXM"]
    return out / chip.lanes + chip.latency_cycles["VXM"]


def node_weights(g: Graph, node) -> set:
    """The resident tensors (weights, and state such as a KV cache) an operator reads."""
    return {g.base(t) for t in node.inputs if g.is_resident(t)}


def weight_budget(g: Graph, chip: ChipConfig) -> int:
    """Bytes of resident weights a chip may take: its SRAM less room for the activations (the four largest
    tensors the graph computes, which bounds what one stage holds live), and at least half of it."""
    activations = sorted((t.nbytes for k, t in enumerate(g.tensors) if not g.is_resident(k)), reverse=True)
    return max(chip.sram_bytes // 2, chip.sram_bytes - 2 * sum(activations[:4]) - (4 << 20))


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


def split_stages(g: Graph, chip: ChipConfig, chips: int, dtype: str, budget: int, exact: bool = True) -> list:
    """Contiguous runs of node indexes, ``min(chips, nodes)`` of them (or, unless ``exact``, fewer where fewer
    do as well), each holding at most ``budget`` bytes of weights. First the smallest largest stage that can
    be had (a stage's estimated cycles and the send of what crosses its end); then, of the splits whose stages
    all stay within 10% of that, the one whose transfers cost least: every token waits for every transfer,
    while balance only sets the pipeline's rate. In a transformer that cuts at layer boundaries, where the
    hidden state alone crosses."""
    costs = [node_cycles(g, n, chip, dtype) for n in g.nodes]
    weights = [node_weights(g, n) for n in g.nodes]
    n = len(g.nodes)
    for i, w in enumerate(weights):
        need = sum(g.tensors[t].nbytes for t in w)
        if need > budget:
            raise SystemCompileError(f"layer {g.nodes[i].layer!r} alone has {need} bytes of weights, more than a "
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

    def stage(a: int, b: int) -> float:
        return prefix[b] - prefix[a] + (crossing[b] / chip.c2c_bytes_per_cycle if b < n else 0.0)

    stages = min(chips, n)
    balanced = _split(n, stages, lambda a, b: b <= reach[a], stage, max)
    if balanced is None:
        total = sum(g.tensors[t].nbytes for t in set().union(*weights)) if weights else 0
        raise SystemCompileError(f"the model's {total} bytes of weights need more than {chips} chips at "
                                 f"{budget} bytes a chip")
    limit = 1.1 * balanced[0]
    send = chip.latency_cycles["C2C"]  # and a hop or more: a stage fewer is a transfer fewer
    lean = _split(n, stages, lambda a, b: b <= reach[a] and stage(a, b) <= limit,
                  lambda a, b: crossing[b] / chip.c2c_bytes_per_cycle + send if b < n else 0.0,
                  lambda x, y: x + y, fewer=not exact)
    return (lean or balanced)[1]


def _split(n: int, stages: int, allowed, cost, combine, fewer: bool = False):
    """``(value, runs)``: ``stages`` contiguous runs (or, with ``fewer``, as many up to that as is best)
    covering nodes ``[0, n)``, each ``[a, b)`` ``allowed``, that minimise the runs' costs folded by
    ``combine`` (``max`` or a sum); None when there are none."""
    best = [{0: (0.0, None)}]  # best[k][e]: the value of k runs covering [0, e), and where the last starts
    for k in range(1, stages + 1):
        row = {}
        for e in range(k, n + 1 if fewer else n - (stages - k) + 1):
            options = [(combine(value, cost(a, e)), a) for a, (value, _) in best[k - 1].items()
                       if a < e and allowed(a, e)]
            if options:
                row[e] = min(options)
        best.append(row)
    done = [k for k in range(1, stages + 1) if n in best[k]] if fewer else [stages] * (n in best[stages])
    if not done:
        return None
    used = min(done, key=lambda k: (best[k][n][0], k))
    runs, e = [], n
    for k in range(used, 0, -1):
        a = best[k][e][1]
        runs.append(list(range(a, e)))
        e = a
    return best[used][n][0], runs[::-1]


# ---- pipeline ---------------------------------------------------------------------------------------------
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


def _stage_graph(g: Graph, stage: Stage) -> Graph:
    """The stage's part of ``g``: its nodes; inputs (model, then received); outputs (model, then sent)."""
    part = copy.copy(g)
    part.nodes = [g.nodes[i] for i in stage.nodes]
    part.inputs = list(stage.inputs) + [t for t, _ in stage.received]
    part.outputs = list(stage.outputs) + [t for t, _ in stage.sent]
    part.streamed = []
    return part


def link_ops(g: Graph, ops: list, system: SystemConfig, stage: Stage, tags: dict) -> list:
    """Replace the LOADs of received tensors by one RECV each, and the STOREs of sent ones by SENDs."""
    n_in, n_out, chip = len(stage.inputs), len(stage.outputs), stage.chip
    out, done = [], set()
    for op in ops:
        if op.opcode == Opcode.LOAD and op.attrs["index"] >= n_in:
            t, peer = stage.received[op.attrs["index"] - n_in]
            if t in done:
                continue
            done.add(t)
            port = system.route(peer, chip)[-1][3]
            out.append(TileOp(Opcode.RECV, [], [whole(g, t)], {"peer": peer, "tag": tags[(t, peer, chip)]},
                              "recv", port))
        elif op.opcode == Opcode.STORE and op.attrs["index"] >= n_out:
            t, peer = stage.sent[op.attrs["index"] - n_out]
            port = system.route(chip, peer)[0][1]
            out.append(TileOp(Opcode.SEND, [whole(g, t)], [], {"peer": peer, "tag": tags[(t, chip, peer)]},
                              "send", port))
        else:
            out.append(op)
    return out


def compile_pipeline(g: Graph, chip: ChipConfig, system: SystemConfig, dtype: str, in_order: bool = False,
                     chips: int | None = None) -> tuple:
    """Compile ``g`` as a pipeline over ``chips`` chips of ``system`` (default: as many of them as shorten its
    longest stage, :func:`split_stages`), each a neighbour of the one before where the topology allows.

    Returns
    -------
    (SystemProgram, dict)
        The chip programs bundled, and a report: each stage's chip, layers, cycles, weights, SRAM and the
        bytes it passes on.
    """
    n = min(chips or system.chips, system.chips, max(len(g.nodes), 1))
    budget = weight_budget(g, chip)
    runs = split_stages(g, chip, n, dtype, budget, exact=chips is not None)
    stages = plan_pipeline(g, runs, chip_order(system, len(runs)))
    tags = {}
    for stage in stages:
        for t, peer in stage.sent:
            tags[(t, stage.chip, peer)] = len(tags)
    arrivals = {}  # (tag) -> the cycle its first byte reaches the receiving chip
    programs, report = [], []
    for stage in stages:
        part = _stage_graph(g, stage)
        ops = tile(part, chip, resident_budget=budget)
        addr = allocate(part, ops, chip)
        ops = link_ops(part, ops, system, stage, tags)
        instructions, layers, fixed = resolve(part, ops, addr)
        pinned = {k: arrivals[op.attrs["tag"]] for k, op in enumerate(ops) if op.opcode == Opcode.RECV}
        scheduled, makespan = schedule(instructions, chip, in_order=in_order, fixed_units=fixed, pinned=pinned)
        for ins in scheduled:
            if ins.opcode == Opcode.SEND:
                hops = len(system.route(stage.chip, ins.attrs["peer"]))
                arrivals[ins.attrs["tag"]] = ins.cycle + hops * system.hop_cycles
        host = copy.copy(part)
        host.inputs, host.outputs = list(stage.inputs), list(stage.outputs)
        programs.append(emit(host, addr, scheduled, layers, makespan, chip))
        weights = set().union(*[node_weights(g, g.nodes[i]) for i in stage.nodes])
        report.append({"chip": stage.chip, "layers": len(stage.nodes), "first_layer": g.nodes[stage.nodes[0]].layer,
                       "cycles": makespan, "weight_bytes": sum(g.tensors[t].nbytes for t in weights),
                       "sram_high_water": addr["high_water"],
                       "sent_bytes": sum(g.tensors[t].nbytes for t, _ in stage.sent)})
    inputs = tuple(tuple((st.chip, st.inputs.index(t)) for st in stages if t in st.inputs) for t in g.inputs)
    outputs = tuple(next((st.chip, st.outputs.index(t)) for st in stages if t in st.outputs) for t in g.outputs)
    bundle = SystemProgram(system.name, system.digest, tuple(st.chip for st in stages), tuple(programs), inputs,
                           outputs, max(p.predicted_cycles for p in programs), "pipeline",
                           f"{len(stages)} stages on chips {[st.chip for st in stages]}")
    return bundle, {"parallel": "pipeline", "stages": report}


def chip_order(system: SystemConfig, count: int) -> list:
    """``count`` chips each a neighbour of the one before where the topology allows (a walk from chip 0)."""
    if not system.links:
        return list(range(count))
    order, seen = [0], {0}
    while len(order) < count:
        here = order[-1]
        nxt = next((c for c in system.neighbours(here) if c not in seen), None)
        if nxt is None:
            nxt = next(c for c in range(system.chips) if c not in seen)
        order.append(nxt)
        seen.add(nxt)
    return order


def compile_parallel(g: Graph, chip: ChipConfig, system: SystemConfig, dtype: str, parallel: str,
                     in_order: bool = False, chips: int | None = None):
    """The graph as a system program, ``parallel`` being ``pipeline``, ``tensor`` or ``auto`` (both compiled,
    the one with fewer predicted cycles kept; its notes say which and why)."""
    if parallel == "pipeline":
        return compile_pipeline(g, chip, system, dtype, in_order, chips)[0]
    from .tensor import compile_tensor  # (it builds on this module)

    if parallel == "tensor":
        return compile_tensor(g, chip, system, dtype, in_order, chips)[0]
    candidates = {}
    for kind, fn in (("pipeline", compile_pipeline), ("tensor", compile_tensor)):
        try:
            candidates[kind] = fn(g, chip, system, dtype, in_order, chips)[0]
        except SystemCompileError as err:
            candidates[kind] = err
    built = {k: v for k, v in candidates.items() if not isinstance(v, Exception)}
    if not built:
        raise SystemCompileError("; ".join(f"{k}: {v}" for k, v in candidates.items()))
    best = min(built, key=lambda k: built[k].predicted_cycles)
    why = ", ".join(f"{k} {v.predicted_cycles} cycles" if not isinstance(v, Exception) else f"{k}: {v}"
                    for k, v in candidates.items())
    chosen = built[best]
    return replace(chosen, parallel=best, notes=f"auto chose {best} ({why}); {chosen.notes}")
