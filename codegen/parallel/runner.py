"""runner: every part of a :class:`~.base.Mapping` through the codegen's own stages, into one system program.

The same :func:`~..stages.run_stages` as a single chip (tile, alloc, schedule,
emit), with its one capacity policy and its one dump policy. The parts of a
pipeline are compiled in order, so that each RECV is pinned where the SEND
before it lands. The ranks of an SPMD mapping are tiled each (their constants
and peers are their own), checked alike op for op, and scheduled once, with
every rank's dependences; each rank then takes that schedule.
"""

from __future__ import annotations

from ...runtime_sim.system import SystemConfig
from ...runtime_sim.system_sim import SystemProgram
from ..alloc import CapacityError
from ..stages import Compilation, LinkError, run_stages
from .base import Mapping, SystemCompileError


def compile_mapping(name: str, mapping: Mapping, options, system: SystemConfig) -> SystemProgram:
    """Compile every part of ``mapping`` (one function of a model, named ``name``) for ``system``.

    Raises
    ------
    SystemCompileError
        A part that does not fit its chip (after streaming every weight that can stream), or transfers that
        cannot be scheduled; it names the chip and, where the strategy knows, what to try.
    """
    arrivals = {}
    comps = [Compilation(f"{name}.chip{part.chip}", options, graph=part.graph, resident_budget=part.resident_budget,
                         chip_id=part.chip, system=system, arrivals=arrivals, stored=part.stored)
             for part in mapping.parts]
    if mapping.spmd:
        leader, ranks = comps[0], comps[1:]
        leader.alike = ranks
        _run(leader, mapping, "tile", "alloc")
        for c in ranks:
            c.leader, c.resident_budget = leader, leader.resident_budget
            _run(c, mapping, "tile", "alloc")
        for c in comps:
            _run(c, mapping, "schedule", "emit")
    else:
        for c in comps:
            _run(c, mapping, "tile", "emit")
    programs = tuple(c.program for c in comps)
    return SystemProgram(system.name, system.digest, tuple(p.chip for p in mapping.parts), programs,
                         mapping.inputs, mapping.outputs, max(p.predicted_cycles for p in programs),
                         mapping.parallel, mapping.notes)


def _run(c: Compilation, mapping: Mapping, start: str, stop: str) -> None:
    try:
        run_stages(c, start, stop)
    except CapacityError as err:
        raise SystemCompileError(f"{mapping.parallel} parallel does not fit chip {c.chip_id}: {err}"
                                 + (f"; {mapping.hint}" if mapping.hint else "")) from None
    except LinkError as err:
        raise SystemCompileError(f"{mapping.parallel} parallel: {err}") from None

