"""A program's figures: cycles, each unit's busy time, work done, and a row per layer.

Summed as arrays over :class:`.columns.ProgramColumns`, not instruction by
instruction: a sweep measures thousands of programs.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .columns import ProgramColumns
from .critical import CriticalPaths, bound_of
from .isa import Opcode, Unit


class Timed:
    """Seconds and microseconds of ``cycles`` at ``clock_hz``."""

    @property
    def seconds(self) -> float:
        return self.cycles / self.clock_hz

    @property
    def microseconds(self) -> float:
        return 1e6 * self.seconds


@dataclass
class RunStats(Timed):
    """Cycle-level figures of a program (identical on every call: the schedule is static)."""

    cycles: int
    predicted_cycles: int
    clock_hz: int
    unit_busy: dict
    unit_instances: dict
    plane_busy: list
    macs: int
    peak_macs_cycles: float  # Σ over MATMULs of their array-cycles at full rate: the MAC-utilisation numerator
    sram_high_water: int
    sram_bytes_moved: int
    host_bytes: int
    flops: int
    instruction_cycles_sum: int
    explain: object = None  # () -> (layer rows, program's critical path): worked out when first read (it costs)
    planes: int = 1
    array_macs: int = 1

    @cached_property
    def _explained(self) -> tuple:
        explained = self.explain() if self.explain else ([], {})
        self.explain = None  # (it holds the program's columns)
        return explained

    @property
    def layers(self) -> list:
        """A row per layer: its span (``start``, ``end``, ``cycles``), work, busy cycles per unit, and what
        bound it (``bound``, with the cycles of its critical path by cause in ``critical``)."""
        return self._explained[0]

    @property
    def critical(self) -> dict:
        """The program's cycles by cause along its critical path (:mod:`.critical`): they sum to ``cycles``."""
        return self._explained[1]

    @property
    def utilisation(self) -> dict:
        """Busy fraction of each unit kind over the makespan (all its instances together)."""
        return {u: busy / (self.cycles * self.unit_instances[u]) if self.cycles else 0.0
                for u, busy in self.unit_busy.items()}

    @property
    def mac_utilisation(self) -> float:
        """Useful MACs ÷ (peak MACs per cycle × cycles), each MATMUL at its own dtype's peak."""
        return self.peak_macs_cycles / (self.planes * self.array_macs * self.cycles) if self.cycles else 0.0

    def to_dict(self) -> dict:
        return {"predicted_cycles": self.predicted_cycles, "simulated_cycles": self.cycles,
                "seconds": self.seconds, "microseconds": self.microseconds, "sram_high_water": self.sram_high_water,
                "sram_bytes_moved": self.sram_bytes_moved, "host_bytes": self.host_bytes, "flops": self.flops,
                "macs": self.macs, "mac_utilisation": self.mac_utilisation,
                "plane_busy": self.plane_busy, "instruction_cycles_sum": self.instruction_cycles_sum,
                "units": {u: {"busy_cycles": b, "instances": self.unit_instances[u],
                              "utilisation": self.utilisation[u]} for u, b in self.unit_busy.items()},
                "layers": self.layers}


def _sum_by(index, values, n: int) -> np.ndarray:
    """Exact sums of ``values`` by ``index`` (0 <= index < n): in int64 (``bincount`` sums in float64), or in
    Python integers where a sum could pass int64's range (validation bounds each value, not their sum)."""
    if len(values) and int(values.max()) >= (1 << 62) // len(values):
        out = np.zeros(n, object)
        for k, value in zip(index.tolist(), values.tolist()):
            out[k] += value
        return out
    out = np.zeros(n, np.int64)
    np.add.at(out, index, values)
    return out


def _total(values) -> int:
    return int(_sum_by(np.zeros(len(values), np.int64), values, 1)[0])


def run_stats(columns: ProgramColumns, timeline, sram_size: int) -> RunStats:
    """The figures of a program's measured timeline, summed as arrays (each instruction's occupancy is its
    kind's, but for the busy time of a chain's members, stretched to its pace)."""
    program, chip = columns.program, columns.chip
    kinds = columns.kind_instructions
    kind_occ = columns.kind_occupancy
    sig = columns.kind
    units = [u.name for u in Unit]
    unit = np.array([units.index(k.unit.name) for k in kinds], np.int64)[sig]
    busy = timeline.busy
    finish = busy + columns.latency  # (stretching a chained consumer keeps its latency)

    def per_kind(values):
        return np.array(values, np.int64)[sig]
    flops, macs = per_kind([o.flops for o in kind_occ]), per_kind([o.macs for o in kind_occ])
    matmul = per_kind([k.opcode == Opcode.MATMUL for k in kinds]).astype(bool)
    passes = per_kind([chip.mxm_passes.get(k.srcs[0].dtype.matrix_class, 0) if k.opcode == Opcode.MATMUL else 0
                       for k in kinds])
    plane = per_kind([k.unit_index for k in kinds])
    moved = per_kind([o.sram_bytes for o in kind_occ])
    host = per_kind([o.host_bytes for o in kind_occ])
    unit_busy = _sum_by(unit, busy, len(units))
    return RunStats(timeline.makespan, program.predicted_cycles, chip.clock_hz,
                    {u: int(unit_busy[k]) for k, u in enumerate(units)}, {u: chip.unit_count(u) for u in units},
                    _sum_by(plane[matmul], busy[matmul], chip.mxm_planes).tolist(),
                    _total(macs[matmul]), float((macs * passes)[matmul].sum()), sram_size, _total(moved),
                    _total(host), _total(flops), _total(busy),
                    lambda: _explained(columns, timeline, unit, units, busy, finish, flops, macs, moved + host),
                    chip.mxm_planes, chip.mxm_rows * chip.mxm_cols)


def _explained(columns, timeline, unit, units, busy, finish, flops, macs, moved) -> tuple:
    """``(layer rows, the program's critical path by cause)``."""
    paths = CriticalPaths(columns, timeline.occupancies, busy)
    everything = np.arange(len(busy))
    whole = paths.walk(everything, 0, timeline.makespan, np.zeros(len(busy), np.int64)) if len(busy) else {}
    return _layer_rows(columns, paths, unit, units, busy, finish, flops, macs, moved), whole


def _layer_rows(columns, paths, unit, units, busy, finish, flops, macs, moved) -> list:
    """Per layer (in order of first appearance): its span, work, and what bounds it."""
    program = columns.program
    instructions = program.instructions
    layer = columns.layer
    names = program.layer_names
    layers, first_of_layer = np.unique(layer, return_index=True)
    row_of_name, row_of_layer = {}, []
    for number in layers.tolist():
        name = names[number] if number < len(names) else str(number)
        row_of_layer.append(name)
    for k in np.argsort(first_of_layer).tolist():  # rows in order of each name's first instruction
        row_of_name.setdefault(row_of_layer[k], len(row_of_name))
    row = np.array([row_of_name[name] for name in row_of_layer], np.int64)[np.searchsorted(layers, layer)]
    n_rows, n_units = len(row_of_name), len(units)
    cell = row * n_units + unit
    present = np.full(n_rows * n_units, len(instructions))
    np.minimum.at(present, cell, np.arange(len(instructions)))  # first instruction of each unit in each layer
    unit_busy = _sum_by(cell, busy, n_rows * n_units).reshape(n_rows, n_units)
    # per resource instance (a plane's array or its install port, a vector queue, a DMA engine): what each
    # instruction holds first, its own unit instance
    held = [f"{name}{index}" for name, index in (o.exclusive[0] for o in columns.kind_occupancy)]
    instances = sorted(set(held))
    instance = np.array([instances.index(h) for h in held], np.int64)[columns.kind]
    instance_busy = _sum_by(row * len(instances) + instance, busy, n_rows * len(instances))
    instance_busy = instance_busy.reshape(n_rows, len(instances))
    present = present.reshape(n_rows, n_units)
    start = np.full(n_rows, np.iinfo(np.int64).max)
    np.minimum.at(start, row, columns.cycle)
    end = np.zeros(n_rows, np.int64)
    np.maximum.at(end, row, columns.cycle + finish)
    sums = [_sum_by(row, w, n_rows) for w in (flops, macs, moved)]
    by_row = np.argsort(row, kind="stable")
    members = np.split(by_row, np.searchsorted(row[by_row], np.arange(1, n_rows)))
    out = []
    for name, r in row_of_name.items():
        seen = [k for k in np.argsort(present[r], kind="stable").tolist() if present[r, k] < len(instructions)]
        row_busy = {units[k]: int(unit_busy[r, k]) for k in seen}
        span = max(int(end[r] - start[r]), 1)
        causes = paths.walk(members[r], int(start[r]), int(end[r]), row)
        out.append({"name": name, "cycles": span, "start": int(start[r]), "end": int(end[r]),
                    "flops": int(sums[0][r]), "macs": int(sums[1][r]), "bytes": int(sums[2][r]),
                    "units": sorted(row_busy), "bound": bound_of(causes), "critical": causes, "busy": row_busy,
                    "busy_by_instance": {resource: int(b) for resource, b in zip(instances, instance_busy[r].tolist()) if b}})
    return out
