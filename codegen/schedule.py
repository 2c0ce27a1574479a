"""schedule: give every instruction a unit instance and an exact issue cycle.

A list scheduler over the instructions in program order. Each one issues at the
earliest cycle at which (1) everything it reads has been written, (2) nothing
still reads or writes what it overwrites (the SRAM hazard rules of
:mod:`lpx_tvm.runtime_sim.hazards`), and (3) an instance of its unit is free.
Independent work on different units (DMA, matrix planes, vector, switch)
overlaps. Costs come from the shared cost model, so the makespan computed here
is the cycle count the simulator measures.
"""

from __future__ import annotations

from ..runtime_sim import ChipConfig, Instruction
from ..runtime_sim.cost import instruction_cost
from ..runtime_sim.hazards import AccessLog


def schedule(instructions: list, config: ChipConfig, in_order: bool = False) -> tuple:
    """Assign issue cycles and unit instances.

    Parameters
    ----------
    instructions : list of Instruction
        In program order; their ``cycle`` and ``unit_index`` are ignored.
    config : ChipConfig
    in_order : bool
        Issue each instruction only after the previous one finished (no
        overlap): the reference schedule that scheduling must not change the
        results of.

    Returns
    -------
    (list of Instruction, int)
        The scheduled instructions (sorted by issue cycle) and the makespan.
    """
    free = {}
    log = AccessLog(sum(len(i.srcs) + len(i.dsts) for i in instructions))
    makespan = 0
    scheduled = []
    for ins in instructions:
        cycles = instruction_cost(ins, config).cycles
        instances = free.setdefault(ins.unit, [0] * config.unit_count(ins.unit.name))
        unit_index = min(range(len(instances)), key=instances.__getitem__)
        start = max(log.ready(ins.srcs, ins.dsts), instances[unit_index])
        if in_order:
            start = max(start, makespan)
        finish = start + cycles
        instances[unit_index] = finish
        log.record(ins.srcs, ins.dsts, finish)
        makespan = max(makespan, finish)
        scheduled.append(Instruction(ins.opcode, unit_index, start, ins.srcs, ins.dsts, ins.attrs, ins.layer))
    scheduled.sort(key=lambda i: i.cycle)
    return scheduled, makespan
