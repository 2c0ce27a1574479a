"""Chrome / Perfetto trace-event files: a track per resource that serialises its work.

A track is what an instruction holds alone (its occupancy's first exclusive resource): each plane's array
and its install port, each vector queue, each DMA engine, each link port's send and receive side. Slices on
a track never overlap. Times are whole nanoseconds from the start of the model's timeline (written in µs, the
format's unit, with three decimals), so a slice that ends at the cycle where the next one starts ends at the
same number. The programs of a model are placed one after another in the order given; the host's work
between them is not timed, so it is not drawn.
"""

from __future__ import annotations

import json


def _ns(cycle: int, clock_hz: int) -> int:
    return round(cycle * 1_000_000_000 / clock_hz)


def _us(ns: int) -> float:
    return ns / 1000


def _track_name(resource: tuple) -> str:
    name, index = resource
    return {"MXM.load": f"MXM{index} install", "C2C.tx": f"C2C{index} send", "C2C.rx": f"C2C{index} receive",
            "HOST": "host link"}.get(name, f"{name}{index}")


def trace_events(simulator, pid: int = 0, name: str = "lpx", start_cycle: int = 0) -> list:
    """Trace events (``ph: "X"``) of a loaded program whose cycle 0 is ``start_cycle`` of the timeline."""
    program, clock = simulator.program, simulator.config.clock_hz
    events = [{"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}},
              {"ph": "M", "pid": pid, "name": "process_sort_index", "args": {"sort_index": pid}}]
    tids = {}
    for index, (ins, occ) in enumerate(zip(program.instructions, simulator.costs)):
        resource = occ.exclusive[0] if occ.exclusive else (ins.unit.name, ins.unit_index)
        if resource not in tids:
            tids[resource] = len(tids)
            events.append({"ph": "M", "pid": pid, "tid": tids[resource], "name": "thread_name",
                           "args": {"name": _track_name(resource)}})
        layer = program.layer_names[ins.layer] if ins.layer < len(program.layer_names) else str(ins.layer)
        begin = _ns(start_cycle + ins.cycle, clock)
        end = _ns(start_cycle + ins.cycle + occ.busy, clock)
        events.append({"ph": "X", "pid": pid, "tid": tids[resource], "name": ins.opcode.name,
                       "cat": ins.unit.name, "ts": _us(begin), "dur": _us(end - begin),
                       "args": {"index": index, "layer": layer, "cycle": ins.cycle, "busy": occ.busy,
                                "latency": occ.latency, "bound": occ.bound, "macs": occ.macs, "flops": occ.flops,
                                "sram_bytes": occ.sram_bytes, "host_bytes": occ.host_bytes, "streams": occ.streams}})
    return events


def link_events(system_sim, pid: int, start_cycle: int = 0) -> list:
    """A system's transfers: one process, a track per link direction, a span per transfer on each hop."""
    system = system_sim.system
    clock, hop = system.chip.clock_hz, system.hop_cycles
    events = [{"ph": "M", "pid": pid, "name": "process_name", "args": {"name": f"{system.name} links"}},
              {"ph": "M", "pid": pid, "name": "process_sort_index", "args": {"sort_index": pid}}]
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
                begin = _ns(start_cycle + ins.cycle + k * hop, clock)
                end = _ns(start_cycle + ins.cycle + k * hop + occ.busy, clock)
                events.append({"ph": "X", "pid": pid, "tid": tids[(u, port)], "name": f"{chip}─►{ins.attrs['peer']}",
                               "cat": "link", "ts": _us(begin), "dur": _us(end - begin),
                               "args": {"tag": ins.attrs["tag"], "bytes": ins.srcs[0].nbytes, "from_chip": chip,
                                        "instruction": index}})
    return events


def write_trace(path, simulators) -> None:
    """Write a trace-event JSON file for loaded programs, placed one after another in the order given: a
    process per program, for a system program a process per chip and one with a track per link."""
    events, pid, start = [], 0, 0
    count = len(simulators)
    for k, (name, sim) in enumerate(simulators):
        label = f"program {k + 1} of {count} ({name})" if count > 1 else name
        chips = sim.chips
        for chip, chip_sim in chips:
            events += trace_events(chip_sim, pid, f"{label}, chip {chip}" if len(chips) > 1 or sim.links else label,
                                   start)
            pid += 1
        if sim.links:
            events += link_events(sim, pid, start)
            pid += 1
        start += max(chip_sim.stats.cycles for _, chip_sim in chips)
    with open(path, "w") as fh:
        json.dump({"traceEvents": events, "displayTimeUnit": "ns"}, fh)
