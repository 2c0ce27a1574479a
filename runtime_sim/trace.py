"""Chrome / Perfetto trace-event files: one track per unit instance."""

from __future__ import annotations

import json

from .isa import Unit


def trace_events(simulator, pid: int = 0, name: str = "lpx") -> list:
    """Trace events (``ph: "X"``, timestamps in microseconds) of a loaded program."""
    program, config = simulator.program, simulator.config
    us_per_cycle = 1e6 / config.clock_hz
    tids = {}
    for unit in Unit:
        for i in range(config.unit_count(unit.name)):
            tids[(unit, i)] = len(tids)
    events = [{"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}]
    events += [{"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": f"{u.name}{i}"}}
               for (u, i), tid in tids.items()]
    for index, (ins, occ) in enumerate(zip(program.instructions, simulator.costs)):
        layer = program.layer_names[ins.layer] if ins.layer < len(program.layer_names) else str(ins.layer)
        events.append({"ph": "X", "pid": pid, "tid": tids[(ins.unit, ins.unit_index)], "name": ins.opcode.name,
                       "cat": ins.unit.name, "ts": ins.cycle * us_per_cycle, "dur": max(occ.busy, 1) * us_per_cycle,
                       "args": {"index": index, "layer": layer, "cycle": ins.cycle, "busy": occ.busy,
                                "latency": occ.latency, "bound": occ.bound, "macs": occ.macs, "flops": occ.flops,
                                "sram_bytes": occ.sram_bytes, "host_bytes": occ.host_bytes, "streams": occ.streams}})
    return events


def write_trace(path, simulators) -> None:
    """Write a trace-event JSON file for one or more loaded programs (one process each)."""
    events = []
    for pid, (name, sim) in enumerate(simulators):
        events += trace_events(sim, pid, name)
    with open(path, "w") as fh:
        json.dump({"traceEvents": events, "displayTimeUnit": "ns"}, fh)
