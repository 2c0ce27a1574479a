"""``lpx-tvm profile``: where a compiled model's cycles go, layer by layer and unit by unit."""

from __future__ import annotations

import re

from ...codegen.graph import onnx_tensor
from ...runtime_sim.critical import LEGEND
from ...runtime_sim.system_sim import SystemSimulator
from ..output import Report, Table

_PREFIX = re.compile(r"^lpx\d+_[0-9a-f]+/")
_INDEX = re.compile(r"_\d+")
_TENSOR = re.compile(r"@[^+]*")


def short_name(layer: str) -> str:
    """``lpx0_5bdf9cf1f149/conv2d_4+add_7@c+quantize`` ─► ``conv2d_4+add+quantize``: the op kinds and the
    first op's index, without the function's hash or the ONNX tensors."""
    body = _TENSOR.sub("", _PREFIX.sub("", layer))
    head, _, tail = body.partition("+")
    return head + ("+" + _INDEX.sub("", tail) if tail else "")


def short_program(name: str) -> str:
    """``lpx0_5bdf9cf1f149@chip1`` ─► ``lpx0@chip1``: the function's number and the chip, without its hash."""
    head, at, chip = name.partition("@")
    return head.split("_")[0] + at + chip


def exclusive_cycles(program, costs) -> tuple:
    """Each layer's exclusive share of a program's cycles, and the cycles in which nothing ran.

    Layers overlap (row bands, chains), so their spans add up to more than the program; here every cycle goes
    to the layers busy in it, split evenly among them, so the shares and the idle cycles sum to the program's
    cycles. Returns ``({layer name: cycles (a float)}, idle cycles)``.
    """
    events = []
    for ins, occ in zip(program.instructions, costs):
        name = program.layer_names[ins.layer] if ins.layer < len(program.layer_names) else str(ins.layer)
        if occ.finish:
            events.append((ins.cycle, 1, name))
            events.append((ins.cycle + occ.finish, -1, name))
    events.sort(key=lambda e: (e[0], e[1]))
    active, shares, idle, previous = {}, {}, 0.0, 0
    for cycle, step, name in events:
        if cycle > previous:
            if active:
                part = (cycle - previous) / len(active)
                for layer in active:
                    shares[layer] = shares.get(layer, 0.0) + part
            else:
                idle += cycle - previous
            previous = cycle
        active[name] = active.get(name, 0) + step
        if not active[name]:
            del active[name]
    return shares, idle


def profile(compiled) -> dict:
    """The profile of a compiled model as a dict (what ``--json`` writes).

    Per program and in total: predicted and simulated cycles, latency in µs at
    the preset's clock, useful-MAC utilisation (MACs ÷ peak MACs per cycle ×
    cycles, each MATMUL at its dtype's peak), each unit's busy share and each
    plane's; per layer its span, MACs, what it kept busy and what bound it.
    """
    sims, systems = {}, {}
    for name, sim in compiled.simulators.items():
        if isinstance(sim, SystemSimulator):  # it reports its system: the chips' makespan, each link
            systems[name] = sim
        # each chip's program is profiled as a program of its own
        sims.update({f"{name}@chip{chip}" if name in systems else name: chip_sim for chip, chip_sim in sim.chips})
    report = {"dtype": compiled.dtype, "predicted_cycles": 0, "simulated_cycles": 0, "microseconds": 0.0,
              "units": {}, "layers": [], "programs": {}}
    for name, sim in sims.items():
        stats, chip = sim.stats, sim.config
        report["config"] = chip.name
        peak_dtype = compiled.dtype if compiled.dtype in chip.mxm_passes else "fp32"
        report["chip"] = {"name": chip.name, "peak_flops": chip.peak_ops_per_s(peak_dtype),
                          "sram_bytes_per_s": chip.sram_bytes_per_cycle * chip.clock_hz,
                          "vector_ops_per_s": chip.vxm_alus * chip.clock_hz,
                          "host_bytes_per_s": chip.host_bytes_per_s}
        report["programs"][name] = stats.to_dict()
        report["host_converted_inputs"] = report.get("host_converted_inputs", 0) + len(sim.program.host_converted)
        report.setdefault("streamed", []).extend(streamed_weights(name, sim.program, chip))
        shares, idle = exclusive_cycles(sim.program, sim.costs)
        report["programs"][name]["idle_cycles"] = idle
        for layer in stats.layers:
            peak = chip.mxm_peak_macs_per_cycle(compiled.dtype if compiled.dtype in chip.mxm_passes else "fp32")
            report["layers"].append({
                "layer": onnx_tensor(layer["name"]) or short_name(layer["name"]), "ops": short_name(layer["name"]),
                "relax_name": layer["name"], "program": name,
                "start": layer["start"], "end": layer["end"], "cycles": layer["cycles"],
                "exclusive_cycles": shares.get(layer["name"], 0.0),
                "microseconds": 1e6 * layer["cycles"] / chip.clock_hz, "seconds": layer["cycles"] / chip.clock_hz, "macs": layer["macs"], "flops": layer["flops"],
                "bytes": layer["bytes"], "mac_utilisation": layer["macs"] / (peak * layer["cycles"]) if layer["cycles"]
                else 0.0, "busy": layer["busy"], "busy_by_instance": layer["busy_by_instance"], "bound": layer["bound"],
                "critical": layer["critical"]})
    # the model's figures: a system program's time is its chips' makespan, not their sum (one writer of them)
    stats = compiled.stats
    report.update(predicted_cycles=stats.predicted_cycles, simulated_cycles=stats.cycles,
                  microseconds=stats.microseconds, mac_utilisation=stats.mac_utilisation)
    report["units"] = {unit: {"busy_cycles": busy, "capacity": stats.unit_capacity[unit],
                              "utilisation": stats.utilisation[unit]} for unit, busy in stats.unit_busy.items()}
    if systems:
        report["systems"] = {name: {"system": sim.system.name, "parallel": sim.program.parallel,
                                    "notes": sim.program.notes, **sim.stats.to_dict()} for name, sim in systems.items()}
    report["layers"].sort(key=lambda r: -r["cycles"])
    return report


def streamed_weights(name: str, program, chip) -> list:
    """Each layer whose weights stream from host memory: its bytes, and what forced it (the program's
    resident weights and activations beside the bytes that stream, against the chip's SRAM)."""
    from ...runtime_sim import Opcode

    by_layer = {}
    for ins in program.instructions:
        if ins.opcode == Opcode.STREAM:
            layer = short_name(program.layer_names[ins.layer])
            by_layer[layer] = by_layer.get(layer, 0) + program.streamed[ins.attrs["index"]].host.nbytes
    if not by_layer:
        return []
    resident = sum(c.ref.nbytes for c in program.constants)
    activations = program.plan.sram_bytes - program.plan.activation_base if program.plan.activation_base else 0
    unique = sum(w.host.nbytes for w in program.streamed)
    why = (f"resident weights {resident} B + activations {activations} B + streamed {unique} B exceed the "
           f"{chip.sram_bytes} B of SRAM")
    return [{"program": name, "layer": layer, "bytes": nbytes, "why": why} for layer, nbytes in by_layer.items()]


def stream(model, copies: int, config: str | None = "tsp", input_shapes: dict | None = None,
           dtype: str = "fp32") -> dict:
    """``copies`` back-to-back inferences as one static schedule (:func:`lpx_tvm.compiler.compile_stream`).

    Returns
    -------
    dict
        ``copies``, ``cycles`` (the whole stream), ``cycles_per_inference``, ``inferences_per_s`` at the
        preset's clock, and ``first_output_cycle`` (when the first inference's last result is stored).
    """
    from ...compiler import compile_stream
    from ...runtime_sim import Opcode, Simulator

    program = compile_stream(model, copies, config, input_shapes, dtype)
    sim = Simulator(program, timing_only=True)
    per_copy = len(program.outputs) // copies
    occupancies = sim.timeline.occupancies
    first = max(ins.cycle + occupancies[i].finish for i, ins in enumerate(program.instructions)
                if ins.opcode == Opcode.STORE and ins.attrs["index"] < per_copy)
    cycles = sim.stats.cycles
    return {"copies": copies, "cycles": cycles, "cycles_per_inference": cycles / copies,
            "inferences_per_s": copies * sim.config.clock_hz / cycles, "first_output_cycle": first}


def table(report: dict, top: int | None = None) -> Report:
    """The profile's :class:`~lpx_tvm.app.output.Report`: the slowest ``top`` layers first (all where None or 0),
    each system's chips and links, the weights streamed from the host, then the totals."""
    layers = report["layers"][:top] if top else report["layers"]
    programs = len({r["program"] for r in report["layers"]}) > 1  # (several programs, or chips: say whose row)
    rows = [([short_program(r["program"])] if programs else [])
            + [r["layer"][:40], r["ops"][:40] if r["ops"] != r["layer"] else "", r["start"], r["cycles"], f"{r['exclusive_cycles']:.0f}", f"{r['microseconds']:.2f}",
               r["macs"], f"{100 * r['mac_utilisation']:.1f}" if r["macs"] else "", r["bound"],
               " ".join(f"{u}:{b}" for u, b in sorted(r["busy"].items()))] for r in layers]
    headers = ["layer (ONNX tensor)", "ops", "start", "span", "exclusive", "µs (span)", "MACs", "% MAC peak", "bound",
               "busy cycles by unit (all instances)"]
    legend = ("(span: its first issue to its last result; layers overlap, so spans add up to more than the "
              "program. exclusive: each cycle split evenly among the layers busy in it; these add up to the "
              "program's cycles, less the cycles nothing ran. " + LEGEND + ")")
    if top and len(report["layers"]) > top:
        legend += f"\n({len(report['layers']) - top} more layers; --top 0 shows all)"
    blocks = [Table((["program"] if programs else []) + headers, rows, name="layers", below=legend)]
    for name, info in report.get("systems", {}).items():
        chips = [[c, v["cycles"], f"{100 * v['mac_utilisation']:.1f}"] for c, v in info["chips"].items()]
        links = [[f"{l['from']} ─► {l['peer']}", l["port"], l["transfers"], l["bytes"], l["busy_cycles"],
                  f"{100 * l['busy_cycles'] / max(info['cycles'], 1):.1f}"] for l in info["links"]]
        blocks.append(Table(["chip", "cycles", "% MAC peak"], chips, name=f"{info['system']}: chips",
                            above=f"{info['system']}: {info['notes']}"))
        blocks.append(Table(["link", "port", "transfers", "bytes", "busy cycles", "% of the run"], links,
                            name=f"{info['system']}: links") if links else "(no chip-to-chip transfers)")
    if report.get("streamed"):
        blocks.append("weights streamed from host memory each call (" + report["streamed"][0]["why"] + "):\n"
                      + "\n".join(f"  {r['layer']}: {r['bytes']} B" for r in report["streamed"]))
    units = ", ".join(f"{u} {i['utilisation']:.1%}" for u, i in report["units"].items() if i["busy_cycles"])
    blocks.append(f"total ({report['dtype']} on {report.get('config', '?')}): "
                  f"{report['simulated_cycles']} cycles (predicted {report['predicted_cycles']}) = "
                  f"{report['microseconds']:.1f} µs; useful-MAC utilisation {report['mac_utilisation']:.1%}; "
                  f"busy: {units}" + (f"; {report['host_converted_inputs']} input(s) narrowed on the host before "
                                      "the link" if report.get("host_converted_inputs") else ""))
    return Report(f"Profile ({report['dtype']} on {report.get('config', '?')})", blocks, report)
