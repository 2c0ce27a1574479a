"""Parallelism strategies: graph rewrites of one function into a part per chip, compiled by one runner.

    pipeline   consecutive layers on consecutive chips (:mod:`.pipeline`)
    tensor     products split over a group of chips, one schedule for all (:mod:`.tensor`)
    expert     a mixture of experts' experts over the chips, one all-reduce to combine (:mod:`.expert`)
    auto       expert for a mixture of experts; otherwise whichever of the others takes fewest cycles

A new strategy is a module that registers a ``split`` function with
:func:`~.base.strategy`, imported here, plus its tests; nothing else changes.
"""

from __future__ import annotations

from dataclasses import replace

# each registers its strategy; the order they are imported in is the order of the choices
from . import pipeline  # noqa: F401, I001
from . import tensor  # noqa: F401
from . import expert  # noqa: F401
from .base import STRATEGIES, Mapping, Part, SystemCompileError, strategy
from .runner import compile_mapping


def choices() -> tuple:
    """The names ``parallel=`` takes: every registered strategy, then ``auto``."""
    return tuple(STRATEGIES) + ("auto",)


def compile_system(name: str, g, options, system):
    """One function's operator graph (after the graph stages) as a system program, mapped as
    ``options.parallel`` says; ``auto``'s notes say what it chose and why."""
    chip = options.chip
    if options.parallel != "auto":
        chosen = STRATEGIES[options.parallel]
        return compile_mapping(name, _split(chosen, g, chip, system, options), options, system)
    candidates = [s for s in STRATEGIES.values() if s.applies(g)]
    if any(s.name == "expert" for s in candidates):  # a mixture of experts maps by its experts
        candidates = [STRATEGIES["expert"]]
    built, failed = {}, {}
    for s in candidates:
        try:
            built[s.name] = compile_mapping(name, _split(s, g, chip, system, options), options, system)
        except SystemCompileError as err:
            failed[s.name] = err
    if not built:
        raise SystemCompileError("; ".join(f"{k}: {v}" for k, v in failed.items()))
    best = min(built, key=lambda k: built[k].predicted_cycles)
    why = ", ".join([f"{k} {v.predicted_cycles} cycles" for k, v in built.items()]
                    + [f"{k}: {v}" for k, v in failed.items()])
    chosen = built[best]
    return replace(chosen, parallel=best, notes=f"auto chose {best} ({why}); {chosen.notes}")


def _split(s, g, chip, system, options) -> Mapping:
    """``s``'s mapping of ``g``, which must run on exactly the chips asked for: a strategy that would use fewer
    (a pipeline of fewer operators than stages) is refused with what it would do."""
    mapping = s.split(g, chip, system, options.dtype, options.chips)
    used = len({part.chip for part in mapping.parts})
    # (expert parallelism places a function without experts, a router's program, whole on one chip by design:
    # the model is refused when none of its functions has experts, and the report names each program's chips)
    if options.chips and used != options.chips and s.name != "expert":
        raise SystemCompileError(f"{s.name} parallel would run on {used} of the {options.chips} chips asked for "
                                 f"({mapping.notes}); ask for {used}, or another strategy")
    return mapping


__all__ = ["STRATEGIES", "Mapping", "Part", "SystemCompileError", "choices", "compile_mapping", "compile_system",
           "strategy"]
