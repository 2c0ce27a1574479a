"""The LPX codegen: Relax composite ─► Program, as an ordered list of named stages (:mod:`.stages`).

A model's functions compile with one SRAM plan for the chip they share
(:func:`compile_model`); on a system of chips, a strategy of :mod:`.parallel`
rewrites each function's graph into a part per chip and the same stages compile
every part.
"""

from __future__ import annotations

import gc
import hashlib
from contextlib import contextmanager

from ..runtime_sim import Program
from ..runtime_sim.program import SramPlan
from .alloc import CapacityError, activation_peak, current_held, resident_bytes
from .graph import Graph
from .target import DEFAULT_CONFIG, DTYPES, Target
from .parallel import SystemCompileError, compile_system
from .stages import Compilation, Int8CoverageWarning, budgets, graph_stage, run_stages, stages


def _content_hash(func) -> int:
    import tvm_ffi  # only a Relax function gets here, so TVM is loaded already

    return tvm_ffi.structural_hash(func)


@contextmanager
def _older_objects_unscanned():
    """Python's full collections skip what existed before (TVM's objects, the model, earlier programs) while
    the codegen runs, and scan only what it makes; afterwards everything is collected as usual.

    The codegen makes many small objects (instructions, refs, their dicts), which sets off full collections;
    each scanned the whole heap, almost all of it older than the codegen and alive (0.15 s a collection, one
    or two of them in a ResNet-50 compile of 2.1-2.3 s). Cycles the codegen leaves are still collected while
    it runs. Where the process holds frozen objects already (a server that froze its own before forking), they
    stay as they are: unfreezing would thaw the caller's too.
    """
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def compile_model(functions: dict, options: Target | None = None, state_args: dict | None = None) -> dict:
    """Compile every lpx function of one model, with one SRAM plan for the chip they share.

    Each program's resident weights get a range of their own, one after the
    other; the activations of all of them go above. Every weight stays resident
    that fits beside the activations' peak; when the weights together exceed
    that, each program's share of what is left is in proportion to its weights
    and the largest of its weights stream instead.

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
    options = options or Target.parse()
    options.check_compilable()
    with _older_objects_unscanned():
        return _compile_model(functions, options, state_args or {})


def _compile_model(functions: dict, options: Target, state_args: dict) -> dict:
    if options.system is not None:
        return compile_for_system(functions, options, state_args)
    chip = options.chip
    comps = {name: Compilation(name, options, source=func, state_args=frozenset(state_args.get(name, ())))
             for name, func in functions.items()}
    for c in comps.values():
        run_stages(c, "lower", graph_stage(options))
    weights = {name: sum(t.nbytes for k, t in enumerate(c.graph.tensors) if c.graph.is_resident(k))
               for name, c in comps.items()}
    total = sum(weights.values())
    for c in comps.values():  # every weight resident first: what do the activations need beside them?
        run_stages(c, "tile", "tile")
    # the programs' activations share one region above every program's weights: the largest peak sets it
    peak = max((activation_peak(c.graph, c.ops) for c in comps.values()), default=0)
    for budget in budgets(chip.sram_bytes, peak):
        base = 0
        for name, c in comps.items():
            share = budget * weights[name] // total if total > budget else None
            if c.resident_budget != share:
                c.resident_budget = share
                run_stages(c, "tile", "tile")
            c.activation_base = None
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
    for c in comps.values():
        run_stages(c, "schedule", "schedule")
    # the plan's id: what was compiled, and how (another model, or this one in another dtype, is another plan)
    # (and over which held weights: its programs name them, another compile's name another set). Programs of
    # one id share a chip at run time, so the id must cover everything their bytes hold: the structural hash
    # leaves out spans, which name the layers (two graphs alike but for their ONNX node names are two plans)
    held = current_held()
    model = hashlib.blake2b(repr((sorted((name, _content_hash(f), tuple(comps[name].layers))
                                         for name, f in functions.items()),
                                  options.key(),
                                  sorted((k, sorted(v)) for k, v in state_args.items()),
                                  held.id if held is not None else b"")).encode(),
                            digest_size=8).digest()
    plan = SramPlan(model, max(c.addr["high_water"] for c in comps.values()) if comps else 0, base)
    programs = {}
    for name, c in comps.items():
        c.plan = plan
        programs[name] = run_stages(c, "emit", "emit")
    return programs


def compile_graph(g: Graph, options: Target, name: str = "lpx") -> Program:
    """Run fuse ─► emit on a lowered graph."""
    return run_stages(Compilation(name, options, graph=g), start="fuse")


def compile_function(func, options: Target | None = None, name: str = "lpx") -> Program:
    """Compile one offloaded Relax function to an LPX Program.

    Parameters
    ----------
    func : tvm.relax.Function
        A function partitioned for lpx.
    options : Target
    name : str
        Used for layer names and dump files.
    """
    return run_stages(Compilation(name, options or Target.parse(), source=func))


def compile_for_system(functions: dict, options: Target, state_args: dict | None = None) -> dict:
    """Every lpx function of a model as a system program over ``options.system`` (see :mod:`.system`).

    Returns
    -------
    dict
        Name -> SystemProgram; each one's ``notes`` say how it was mapped.
    """
    system = options.system
    out = {}
    for name, func in functions.items():
        c = Compilation(name, options, source=func, state_args=frozenset((state_args or {}).get(name, ())))
        run_stages(c, "lower", graph_stage(options))
        out[name] = compile_system(name, c.graph, options, system)
    if options.parallel == "expert":
        from .parallel.expert import refuse_without_experts

        refuse_without_experts(out, system, options.chips)
    return out


__all__ = ["CapacityError", "Target", "Compilation", "DEFAULT_CONFIG", "DTYPES", "Int8CoverageWarning",
           "SystemCompileError", "compile_function", "compile_graph", "compile_model", "stages", "run_stages"]
