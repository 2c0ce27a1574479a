"""The LPX codegen: Relax composite ─► Program, as an ordered list of named stages.

    lower      Relax ops ─► LPX operator graph (no TVM types past this step)
    fuse       fold per-channel scale/bias and activations into conv/matmul
    precision  store tensors in the requested float type (fp16, bf16, fp8), casts at the boundary;
               qfuse instead for int8: DQ ─► conv/matmul ─► Q becomes an int8 operator
    tile       split each operator into instructions that fit the units
    alloc      place every tensor in SRAM (liveness-based, never over capacity)
    schedule   assign each instruction a unit and an issue cycle
    emit       build the Program (instructions + constants)

:func:`stages` returns them as ``(name, function)`` pairs; :func:`compile_graph`
runs them in order and, with ``dump_dir``, writes each one's result to
``<name>.<k>_<stage>.txt``.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from ..runtime_sim import ChipConfig, Program, disassemble, load_config
from ..runtime_sim.isa import STORAGE_DTYPES
from ..runtime_sim.program import SramPlan
from .alloc import CapacityError, allocate, resident_bytes
from .emit import emit, resolve
from .fuse import fuse_epilogues
from .graph import Graph
from .precision import lower_precision
from .qfuse import fuse_int8
from .schedule import schedule
from .tile import tile

DTYPES = STORAGE_DTYPES


@dataclass(frozen=True)
class CodegenOptions:
    """Options of the lpx codegen, validated on construction.

    Parameters
    ----------
    config : str
        Chip preset name (or path to a JSON preset).
    in_order : bool
        Use the in-order reference schedule instead of the list scheduler.
    dump_dir : str, optional
        Write each stage's result there.
    dtype : str
        Storage type on lpx: ``"fp32"`` (default), ``"fp16"``, ``"bf16"``, ``"fp8"`` or ``"int8"``.
    system : str, optional
        Compile for a system of ``config`` chips (a preset such as ``"tsp-node"``, or a JSON file).
    parallel : str
        How to map a model onto the system: ``"pipeline"``, ``"tensor"`` or ``"auto"``.
    chips : int, optional
        Use this many of the system's chips (default: all).
    """

    config: str = "tiny"
    in_order: bool = False
    dump_dir: str | None = None
    dtype: str = "fp32"
    system: str | None = None
    parallel: str = "pipeline"
    chips: int | None = None

    def __post_init__(self):
        chip = load_config(self.config)  # raises a clear error for an unknown preset
        if self.system is not None:
            from ..runtime_sim.system import load_system
            from .system import PARALLEL

            system = load_system(self.system)
            if not system.simulated:
                raise ValueError(f"system {system.name!r} is described, not listed link by link: plan for it with "
                                 "lpx-tvm plan; compile for a node or a rack")
            if system.chip.digest != chip.digest:
                raise ValueError(f"system {system.name!r} is made of {system.chip.name!r} chips, not {chip.name!r}")
            if self.parallel not in PARALLEL:
                raise ValueError(f"parallel must be one of {', '.join(PARALLEL)}, got {self.parallel!r}")
            if self.chips is not None and not 1 <= self.chips <= system.chips:
                raise ValueError(f"chips must be 1..{system.chips} on {system.name!r}, got {self.chips}")
        elif self.chips is not None or self.parallel != "pipeline":  # (else ignored: one chip, no system)
            given = f"chips={self.chips!r}" if self.chips is not None else f"parallel={self.parallel!r}"
            raise ValueError(f"{given} needs a system of chips to run on (system=...)")
        if not isinstance(self.in_order, bool):
            raise ValueError(f"in_order must be a bool, got {self.in_order!r}")
        if self.dump_dir is not None and not isinstance(self.dump_dir, (str, os.PathLike)):
            raise ValueError(f"dump_dir must be a folder's path, got {self.dump_dir!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        chip.check_dtype(self.dtype)

    @classmethod
    def from_dict(cls, options: dict | None) -> "CodegenOptions":
        options = dict(options or {})
        known = {"config", "in_order", "dump_dir", "dtype", "system", "parallel", "chips"}
        if set(options) - known:
            raise ValueError(f"unknown lpx codegen options {sorted(set(options) - known)}; "
                             f"known: {', '.join(sorted(known))}")
        return cls(**options)

    @property
    def chip(self) -> ChipConfig:
        return load_config(self.config)


@dataclass
class Compilation:
    """What the stages pass along: each stage reads the fields before it and fills its own."""

    name: str
    options: CodegenOptions
    source: object = None  # the Relax function (lower's input)
    graph: Graph | None = None
    ops: list = field(default_factory=list)
    addr: dict = field(default_factory=dict)
    instructions: list = field(default_factory=list)
    layers: tuple = ()
    makespan: int = 0
    program: Program | None = None
    # the model's SRAM plan: this program's resident-weight budget and range, and where activations start
    resident_budget: int | None = None
    const_base: int = 0
    activation_base: int | None = None
    plan: SramPlan = field(default_factory=SramPlan)
    state_args: frozenset = frozenset()  # the function's parameters that are resident state

    @property
    def chip(self) -> ChipConfig:
        return self.options.chip


class Int8CoverageWarning(UserWarning):
    """With dtype="int8", a conv/matmul outside a complete QDQ pattern runs in float on lpx."""


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
    left = [n.layer for n in c.graph.nodes if n.kind in ("conv2d", "matmul")]
    if left:
        warnings.warn(f"lpx int8: {len(left)} conv/matmul in {c.name} are not between DequantizeLinear and "
                      f"QuantizeLinear with integer weights and run in float (first: {left[0]})",
                      Int8CoverageWarning, stacklevel=4)


def _tile(c: Compilation) -> None:
    c.ops = tile(c.graph, c.chip, resident_budget=c.resident_budget)


def _alloc(c: Compilation) -> None:
    """Allocate; when activations do not fit beside the weights, stream more weights (re-tile) and retry.

    Within a model's SRAM plan (``activation_base`` set) the weights' ranges are
    fixed: a failure goes back to :func:`compile_model`, which re-plans.
    """
    if c.activation_base is not None:
        c.addr = allocate(c.graph, c.ops, c.chip, c.const_base, c.activation_base)
        return
    chip = c.chip
    first = c.resident_budget if c.resident_budget is not None else chip.sram_bytes // 2
    for budget in [None] + [min(first, chip.sram_bytes // 4 >> k) for k in range(3)] + [0]:
        if budget is not None:
            c.ops = tile(c.graph, chip, resident_budget=budget)
        try:
            c.addr = allocate(c.graph, c.ops, chip, c.const_base, c.activation_base)
            return
        except CapacityError:
            if budget == 0:  # every weight that can stream does: final
                raise


def _schedule(c: Compilation) -> None:
    instructions, c.layers, fixed = resolve(c.graph, c.ops, c.addr)
    c.instructions, c.makespan = schedule(instructions, c.chip, in_order=c.options.in_order, fixed_units=fixed)


def _emit(c: Compilation) -> None:
    c.program = emit(c.graph, c.addr, c.instructions, c.layers, c.makespan, c.chip, c.plan)


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


def stages(options: CodegenOptions) -> list:
    """The codegen stages for ``options``, in order: ``(name, run, describe)`` triples."""
    return [("lower", _lower, _describe_graph),
            ("fuse", _fuse, _describe_graph),
            ("qfuse" if options.dtype == "int8" else "precision", _precision, _describe_graph),
            ("tile", _tile, _describe_ops),
            ("alloc", _alloc, _describe_alloc),
            ("schedule", _schedule, _describe_schedule),
            ("emit", _emit, _describe_program)]


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


def _content_hash(func) -> int:
    import tvm_ffi  # only a Relax function gets here, so TVM is loaded already

    return tvm_ffi.structural_hash(func)


def compile_model(functions: dict, options: CodegenOptions | None = None, state_args: dict | None = None) -> dict:
    """Compile every lpx function of one model, with one SRAM plan for the chip they share.

    Each program's resident weights get a range of their own, one after the
    other; the activations of all of them go above. When the weights together
    exceed the budget (half of SRAM), each program's share of it is in
    proportion to its weights and the largest of its weights stream instead.

    Parameters
    ----------
    functions : dict
        Name (the global symbol) -> Relax function.
    state_args : dict, optional
        Name -> indexes of the function's parameters that stay resident from call to call (a KV cache).

    Returns
    -------
    dict
        Name -> Program.
    """
    options = options or CodegenOptions()
    state_args = state_args or {}
    if options.system is not None:
        return compile_for_system(functions, options, state_args)
    chip = options.chip
    comps = {name: Compilation(name, options, source=func, state_args=frozenset(state_args.get(name, ())))
             for name, func in functions.items()}
    for c in comps.values():
        run_stages(c, "lower", "precision" if options.dtype != "int8" else "qfuse")
    weights = {name: sum(t.nbytes for k, t in enumerate(c.graph.tensors) if c.graph.is_resident(k))
               for name, c in comps.items()}
    total = sum(weights.values())
    for budget in [chip.sram_bytes // 2 >> k for k in range(4)] + [0]:
        base = 0
        for name, c in comps.items():
            c.resident_budget = budget * weights[name] // total if total > budget else None
            c.activation_base = None
            run_stages(c, "tile", "tile")
            c.const_base = base
            base += resident_bytes(c.graph, c.ops)
        try:
            for c in comps.values():
                c.activation_base = base
                run_stages(c, "alloc", "alloc")
            break
        except CapacityError:  # the activations do not fit beside the weights: stream more of them
            if budget == 0:
                raise
    # the plan's id: what was compiled, and how (another model, or this one in another dtype, is another plan)
    model = hashlib.blake2b(repr((sorted((name, _content_hash(f)) for name, f in functions.items()),
                                  options.config, options.dtype, options.in_order,
                                  sorted((k, sorted(v)) for k, v in state_args.items()))).encode(),
                            digest_size=8).digest()
    plan = SramPlan(model, max(c.addr["high_water"] for c in comps.values()) if comps else 0, base)
    programs = {}
    for name, c in comps.items():
        c.plan = plan
        programs[name] = run_stages(c, "schedule", "emit")
    return programs


def compile_graph(g: Graph, options: CodegenOptions, name: str = "lpx") -> Program:
    """Run fuse ─► emit on a lowered graph."""
    return run_stages(Compilation(name, options, graph=g), start="fuse")


def compile_function(func, options: CodegenOptions | None = None, name: str = "lpx") -> Program:
    """Compile one offloaded Relax function to an LPX Program.

    Parameters
    ----------
    func : tvm.relax.Function
        A function partitioned for lpx.
    options : CodegenOptions
    name : str
        Used for layer names and dump files.
    """
    return run_stages(Compilation(name, options or CodegenOptions(), source=func))


__all__ = ["CodegenOptions", "CapacityError", "Compilation", "compile_function", "compile_graph", "compile_model",
           "stages", "run_stages", "DTYPES"]


def compile_for_system(functions: dict, options: CodegenOptions, state_args: dict | None = None) -> dict:
    """Every lpx function of a model as a system program over ``options.system`` (see :mod:`.system`).

    Returns
    -------
    dict
        Name -> SystemProgram; each one's ``notes`` say how it was mapped.
    """
    from ..runtime_sim.system import load_system
    from .system import compile_parallel

    system = load_system(options.system)
    out = {}
    for name, func in functions.items():
        c = Compilation(name, options, source=func, state_args=frozenset((state_args or {}).get(name, ())))
        run_stages(c, "lower", "precision" if options.dtype != "int8" else "qfuse")
        out[name] = compile_parallel(c.graph, options.chip, system, options.dtype, options.parallel,
                                     options.in_order, options.chips)
    return out
