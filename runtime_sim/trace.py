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


def link_events(system_sim, pid: int) -> list:
    """A system's transfers: one process, a track per link direction, a span per transfer on it."""
    system = system_sim.system
    us_per_cycle = 1e6 / system.chip.clock_hz
    hop = system.hop_cycles
    events = [{"ph": "M", "pid": pid, "name": "process_name", "args": {"name": f"{system.name} links"}}]
    tids = {}
    for chip, sim in zip(system_sim.program.chips, system_sim.sims):
        for index, (ins, occ) in enumerate(zip(sim.program.instructions, sim.costs)):
            if ins.opcode.name != "SEND":
                continue
            for k, (u, port, v, _) in enumerate(system.route(chip, ins.attrs["peer"])):
                if (u, port) not in tids:
                    tids[(u, port)] = len(tids)
                    events.append({"ph": "M", "pid": pid, "tid": tids[(u, port)], "name": "thread_name",
                                   "args": {"name": f"chip {u} ─► chip {v} (port {port})"}})
                events.append({"ph": "X", "pid": pid, "tid": tids[(u, port)], "name": f"{chip}─►{ins.attrs['peer']}",
                               "cat": "link", "ts": (ins.cycle + k * hop) * us_per_cycle,
                               "dur": max(occ.busy, 1) * us_per_cycle,
                               "args": {"tag": ins.attrs["tag"], "bytes": ins.srcs[0].nbytes, "from_chip": chip,
                                        "instruction": index}})
    return events


def write_trace(path, simulators) -> None:
    """Write a trace-event JSON file for loaded programs: a process per program, for a system program a
    process per chip and one with a track per link."""
    events, pid = [], 0
    for name, sim in simulators:
        chips = sim.chips
        for chip, chip_sim in chips:
            events += trace_events(chip_sim, pid, f"{name} chip {chip}" if len(chips) > 1 or sim.links else name)
            pid += 1
        if sim.links:
            events += link_events(sim, pid)
            pid += 1
    with open(path, "w") as fh:
        json.dump({"traceEvents": events, "displayTimeUnit": "ns"}, fh)
