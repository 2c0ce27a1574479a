"""The codegen's stages and the one runner that runs them, for a single chip and for every part of a system.

    lower      Relax ops ─► LPX operator graph (no TVM types past this step)
    fuse       fold per-channel scale/bias and activations into conv/matmul
    precision  store tensors in the requested float type (fp16, bf16, fp8), casts at the boundary;
               qfuse instead for int8: DQ ─► conv/matmul ─► Q becomes an int8 operator
    tile       split each operator into instructions that fit the units
    alloc      place every tensor in SRAM (liveness-based, never over capacity); when the activations do
               not fit beside the weights, stream more weights (one capacity policy, everywhere)
    schedule   assign each instruction a unit and an issue cycle; a RECV is pinned where its SEND's data
               arrives, and the ranks of a collective share one schedule
    emit       build the Program (instructions + constants)

:func:`stages` returns them as ``(name, run, describe)`` triples; :func:`run_stages`
runs a range of them and, with ``dump_dir``, writes each one's result to
``<name>.<k>_<stage>.txt`` (a system's parts are named ``<function>.chip<N>``).
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..runtime_sim import ChipConfig, Opcode, Program, disassemble
from ..runtime_sim.errors import LpxInternalError
from ..runtime_sim.program import SramPlan
from ..runtime_sim.timing import makespan as schedule_makespan
from .alloc import CapacityError, activation_peak, allocate
from .emit import emit, resolve
from .fuse import fuse_epilogues
from .graph import Graph, NodeKind
from .precision import lower_precision
from .qfuse import fuse_int8, convert_on_host
from .schedule import restamp, schedule
from .tile import tile


@dataclass
class Compilation:
    """What the stages pass along: each stage reads the fields before it and fills its own."""

    name: str
    options: object  # Target
    source: object = None  # the Relax function (lower's input)
    graph: Graph | None = None
    ops: list = field(default_factory=list)
    addr: dict = field(default_factory=dict)
    instructions: list = field(default_factory=list)
    order: list = field(default_factory=list)  # each scheduled instruction's index in program order
    layers: tuple = ()
    makespan: int = 0
    program: Program | None = None
    # the model's SRAM plan: this program's resident-weight budget and range, and where activations start
    resident_budget: int | None = None
    const_base: int = 0
    activation_base: int | None = None
    plan: SramPlan = field(default_factory=SramPlan)
    state_args: frozenset = frozenset()  # the function's parameters that are resident state
    # a part of a system (:mod:`.parallel`): its chip, the system, every SEND scheduled so far
    # ((from chip, to chip, tag) ─► the cycle its data arrives), the rank whose schedule it takes (an SPMD
    # collective's), the ranks that take its schedule, and the outputs it stores (None: all)
    chip_id: int = 0
    system: object = None
    arrivals: dict = field(default_factory=dict)
    leader: "Compilation | None" = None
    alike: list = field(default_factory=list)
    stored: tuple | None = None

    @property
    def chip(self) -> ChipConfig:
        return self.options.chip


class Int8CoverageWarning(UserWarning):
    """With dtype="int8", a conv/matmul outside a complete QDQ pattern runs in float on lpx."""


class LinkError(LpxInternalError, ValueError):
    """A part's transfers cannot be scheduled (a RECV whose SEND is nowhere before it)."""


def _lower(c: Compilation) -> None:
    from .lower import lower  # TVM is imported only when a Relax function is compiled

    c.graph = lower(c.source, c.name)
    c.graph.state = {c.graph.base(c.graph.inputs[i]) for i in c.state_args}


def _fuse(c: Compilation) -> None:
    fuse_epilogues(c.graph)


def _precision(c: Compilation) -> None:
    if c.options.dtype != "int8":
        lower_precision(c.graph, c.options.dtype)
        return
    fuse_int8(c.graph)
    left = [n.layer for n in c.graph.nodes if n.kind in (NodeKind.CONV2D, NodeKind.MATMUL)]
    if left:
        warnings.warn(f"lpx int8: {len(left)} conv/matmul in {c.name} are not between DequantizeLinear and "
                      f"QuantizeLinear with integer weights and run in float (first: {left[0]})",
                      Int8CoverageWarning, stacklevel=4)


def _tile(c: Compilation) -> None:
    if c.options.dtype == "int8":  # per part: a system's strategies have cut the graph by now
        convert_on_host(c.graph)
    c.ops = tile(c.graph, c.chip, resident_budget=c.resident_budget)


def budgets(sram_bytes: int, peak: int) -> list:
    """Resident-weight budgets to try, the most resident first: every byte the activations' peak leaves free
    (and twice the peak, for what the allocator cannot pack), then halves of SRAM, down to streaming every
    weight that can stream (0)."""
    tries = [sram_bytes - peak, sram_bytes - 2 * peak] + [sram_bytes // 2 >> k for k in range(4)] + [0]
    return sorted({max(b, 0) for b in tries}, reverse=True)


def _alloc(c: Compilation) -> None:
    """Allocate; when the activations do not fit beside the weights, stream more weights (re-tile) and retry,
    from what the activations need down (:func:`budgets`).

    Within a model's SRAM plan (``activation_base`` set) the weights' ranges are
    fixed: a failure goes back to :func:`compile_model`, which re-plans. An SPMD
    rank takes its leader's addresses, its tiles being the leader's.
    """
    if c.leader is not None:
        _check_alike(c.leader, c)
        c.addr = c.leader.addr
        return
    if c.activation_base is not None:
        c.addr = allocate(c.graph, c.ops, c.chip, c.const_base, c.activation_base)
        return
    chip, tiled = c.chip, c.resident_budget
    lower = [b for b in budgets(chip.sram_bytes, activation_peak(c.graph, c.ops)) if tiled is None or b < tiled]
    for budget in [tiled] + lower:
        if budget != tiled:
            c.resident_budget = budget
            c.ops = tile(c.graph, chip, resident_budget=budget)
        try:
            c.addr = allocate(c.graph, c.ops, chip, c.const_base, c.activation_base)
            return
        except CapacityError:
            if budget == (lower or [tiled])[-1]:  # every weight that can stream does: final
                raise


def _check_alike(leader: Compilation, c: Compilation) -> None:
    """An SPMD rank's tiles must be its leader's, op for op: the same opcodes, tensors and shapes (addresses
    within a tensor may differ: each rank holds its own block of a gathered tensor), and its C2C ports one to
    one with the leader's (each chip reaches its ring neighbours through ports of its own)."""
    if len(leader.ops) != len(c.ops):
        raise LinkError(f"{c.name}: {len(c.ops)} instructions where its leader {leader.name} has "
                        f"{len(leader.ops)}; the ranks cannot share one schedule")
    ports, theirs = {}, {}
    for k, (a, b) in enumerate(zip(leader.ops, c.ops)):
        link = a.opcode in (Opcode.SEND, Opcode.RECV)
        operands = [(x.tensor, tuple(x.shape)) for x in a.srcs + a.dsts], [(y.tensor, tuple(y.shape))
                                                                           for y in b.srcs + b.dsts]
        same = a.opcode == b.opcode and (link or a.unit_index == b.unit_index) and \
            len(a.srcs) == len(b.srcs) and operands[0] == operands[1]
        if same and link:
            same = ports.setdefault(a.unit_index, b.unit_index) == b.unit_index and \
                theirs.setdefault(b.unit_index, a.unit_index) == a.unit_index
        if not same:
            raise LinkError(f"{c.name}: instruction {k} ({b.opcode.name}, layer {b.layer!r}) differs from its "
                            f"leader's ({a.opcode.name}); the ranks cannot share one schedule")


def _links(c: Compilation, instructions: list) -> tuple:
    """``(pinned, pairs)`` for :func:`schedule`: a RECV whose SEND an earlier part scheduled issues when its data
    arrives; one whose tag this part sends itself is a ring step of a collective every rank runs alike."""
    sends = {ins.attrs["tag"]: k for k, ins in enumerate(instructions) if ins.opcode == Opcode.SEND}
    pinned, pairs = {}, {}
    for k, ins in enumerate(instructions):
        if ins.opcode != Opcode.RECV:
            continue
        tag, peer = ins.attrs["tag"], ins.attrs["peer"]
        if (peer, c.chip_id, tag) in c.arrivals:
            pinned[k] = c.arrivals[(peer, c.chip_id, tag)]
        elif tag in sends:
            pairs[k] = sends[tag]
        else:
            raise LinkError(f"{c.name}: transfer {tag} from chip {peer} is received but sent nowhere before it")
    return pinned, pairs


def _schedule(c: Compilation) -> None:
    instructions, c.layers, fixed = resolve(c.graph, c.ops, c.addr)
    if c.leader is not None:
        c.instructions = restamp(instructions, c.leader.instructions, c.leader.order, keep_units=("C2C",))
        c.order, c.makespan = c.leader.order, c.leader.makespan
    else:
        pinned, pairs = _links(c, instructions)
        alike = tuple(resolve(o.graph, o.ops, c.addr)[0] for o in c.alike)
        c.instructions, c.makespan, c.order = schedule(instructions, c.chip, in_order=c.options.in_order,
                                                       fixed_units=fixed, pinned=pinned, pairs=pairs, alike=alike)
    if c.system is not None:
        for ins in c.instructions:
            if ins.opcode == Opcode.SEND:
                peer = ins.attrs["peer"]
                hops = len(c.system.route(c.chip_id, peer))
                c.arrivals[(c.chip_id, peer, ins.attrs["tag"])] = ins.cycle + hops * c.system.hop_cycles


def _emit(c: Compilation) -> None:
    g, instructions, makespan = c.graph, c.instructions, c.makespan
    if c.stored is not None:  # an SPMD rank stores only its own outputs: the others' STOREs go
        index = {k: n for n, k in enumerate(c.stored)}
        instructions = [ins if ins.opcode != Opcode.STORE else
                        replace(ins, attrs={**ins.attrs, "index": index[ins.attrs["index"]]})
                        for ins in instructions
                        if ins.opcode != Opcode.STORE or ins.attrs["index"] in index]
        g = copy.copy(g)
        g.outputs = [g.outputs[k] for k in c.stored]
        makespan = schedule_makespan(instructions, c.chip)
    c.program = emit(g, c.addr, instructions, c.layers, makespan, c.chip, c.plan)


def _describe_graph(c: Compilation) -> str:
    g = c.graph
    lines = [f"inputs {g.inputs} outputs {g.outputs}"]
    for n in g.nodes:
        shapes = [g.tensors[t].shape for t in n.inputs]
        lines.append(f"t{n.output} {g.tensors[n.output].shape} = {n.kind}({n.inputs} {shapes}) {n.attrs}  ; {n.layer}")
    return "\n".join(lines)


def _describe_ops(c: Compilation) -> str:
    return "\n".join(f"{o.opcode.name} {o.dsts} <- {o.srcs} {o.attrs} ; {o.layer}" for o in c.ops)


def _describe_alloc(c: Compilation) -> str:
    return "\n".join(f"t{t} @ {a:#x} {c.graph.tensors[t].shape}" for t, a in c.addr.items() if t != "high_water")


def _describe_schedule(c: Compilation) -> str:
    return "\n".join(f"@{i.cycle} {i.unit.name}{i.unit_index} {i.opcode.name} ; {c.layers[i.layer]}"
                     for i in c.instructions) + f"\nmakespan {c.makespan}"


def _describe_program(c: Compilation) -> str:
    return disassemble(c.program)


def stages(options) -> list:
    """The codegen stages for ``options``, in order: ``(name, run, describe)`` triples."""
    return [("lower", _lower, _describe_graph),
            ("fuse", _fuse, _describe_graph),
            (graph_stage(options), _precision, _describe_graph),
            ("tile", _tile, _describe_ops),
            ("alloc", _alloc, _describe_alloc),
            ("schedule", _schedule, _describe_schedule),
            ("emit", _emit, _describe_program)]


def graph_stage(options) -> str:
    """The name of the last stage on the whole graph (before tiling): ``precision`` or, for int8, ``qfuse``."""
    return "qfuse" if options.dtype == "int8" else "precision"


def run_stages(c: Compilation, start: str = "lower", stop: str = "emit") -> Program | None:
    """Run the stages from ``start`` to ``stop`` (both included), dumping each result when asked."""
    dump = Path(c.options.dump_dir) if c.options.dump_dir else None
    if dump:
        dump.mkdir(parents=True, exist_ok=True)
    table = stages(c.options)
    names = [name for name, _, _ in table]
    first, last = names.index(start), names.index(stop)
    for k, (name, run, describe) in enumerate(table[first:last + 1], first + 1):
        run(c)
        if dump:
            (dump / f"{c.name}.{k}_{name}.txt").write_text(describe(c))
    return c.program
