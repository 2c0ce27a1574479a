"""What a partition offloads: FLOPs on lpx vs on the host, and which ops stay on the host."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from math import prod

import tvm
from tvm import relax

_FREE_OPS = {"relax.reshape", "relax.flatten", "relax.squeeze", "relax.expand_dims", "relax.call_dps_packed",
             "relax.call_tir", "relax.shape_of"}


def op_flops(call) -> int | None:
    """FLOPs of one Relax call (2 per MAC; 1 per output element for other ops); None when shapes are symbolic."""
    name = call.op.name
    ty = call.ty
    if name in _FREE_OPS or not isinstance(ty, relax.TensorType):
        return 0
    if ty.shape is None or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    try:
        out = prod(int(d) for d in ty.shape.values)
    except TypeError:
        return None
    if name in ("relax.nn.conv1d", "relax.nn.conv2d", "relax.nn.conv3d"):  # 2 × output × the taps of one
        return 2 * out * prod(int(d) for d in call.args[1].ty.shape.values[1:])
    if name == "relax.matmul":
        return 2 * out * int(call.args[0].ty.shape.values[-1])
    return out


def _walk_calls(expr, visit):
    relax.analysis.post_order_visit(expr, lambda e: visit(e) if isinstance(e, relax.Call)
                                    and isinstance(e.op, tvm.ir.Op) else None)


@dataclass
class OffloadReport:
    """FLOPs on lpx and on the host, lpx function count, and the ops left on the host.

    ``dynamic_host_ops`` counts host ops whose shapes are symbolic: their FLOPs are
    unknown at compile time and are not in ``flops_host``.
    """

    lpx_functions: int = 0
    flops_offloaded: int = 0
    flops_host: int = 0
    host_ops: Counter = field(default_factory=Counter)
    dynamic_host_ops: int = 0

    @property
    def flops_total(self) -> int:
        return self.flops_offloaded + self.flops_host

    @property
    def offloaded_pct(self) -> float:
        return 100.0 * self.flops_offloaded / self.flops_total if self.flops_total else 0.0

    def summary(self) -> str:
        host = ", ".join(f"{op.removeprefix('relax.')}×{n}" for op, n in sorted(self.host_ops.items())) or "none"
        dynamic = (f"; {self.dynamic_host_ops} host op(s) have dynamic shapes, FLOPs unknown"
                   if self.dynamic_host_ops else "")
        return (f"{self.lpx_functions} lpx subgraph(s), {self.offloaded_pct:.2f}% of "
                f"{self.flops_total / 1e9:.3f} GFLOP on lpx; host ops: {host}{dynamic}")

    def to_dict(self) -> dict:
        return {"lpx_functions": self.lpx_functions, "flops_offloaded": self.flops_offloaded,
                "flops_host": self.flops_host, "offloaded_pct": self.offloaded_pct,
                "host_ops": dict(sorted(self.host_ops.items())), "dynamic_host_ops": self.dynamic_host_ops}


def offload_report(mod) -> OffloadReport:
    """Count FLOPs in lpx functions and in host code of a partitioned module."""
    report = OffloadReport()
    for _, func in mod.functions.items():
        if not isinstance(func, relax.Function) or (func.attrs and func.attrs.get("Composite")):
            continue
        on_lpx = bool(func.attrs and func.attrs.get("Codegen") == "lpx")
        report.lpx_functions += on_lpx

        def visit(call, on_lpx=on_lpx):
            flops = op_flops(call)
            if on_lpx:
                report.flops_offloaded += flops
                return
            if flops is None:
                report.dynamic_host_ops += 1
            else:
                report.flops_host += flops
            if call.op.name not in _FREE_OPS:
                report.host_ops[call.op.name] += 1
        _walk_calls(func, visit)
    return report


@dataclass(frozen=True)
class ProgramFigures:
    """One lpx program's figures: a system program's are its chips' makespan, each chip's utilisation weighed."""

    name: str
    cycles: int
    predicted_cycles: int
    chips: tuple  # the system chips it ran on; (0,) on one chip
    mac_utilisation: float


@dataclass(frozen=True)
class ModelStats:
    """A compiled model's figures on lpx, its programs one after another (the host runs between them).

    Every unit's busy cycles and capacity, and the MAC work and capacity, are summed over every chip of every
    program, so a utilisation is the whole model's.
    """

    programs: tuple
    clock_hz: int
    unit_busy: dict
    unit_capacity: dict
    peak_macs_cycles: float
    mac_capacity: float

    @property
    def cycles(self) -> int:
        return sum(p.cycles for p in self.programs)

    @property
    def predicted_cycles(self) -> int:
        return sum(p.predicted_cycles for p in self.programs)

    @property
    def microseconds(self) -> float:
        return 1e6 * self.cycles / self.clock_hz if self.clock_hz else 0.0

    @property
    def mac_utilisation(self) -> float:
        """Useful MACs ÷ (peak MACs per cycle × cycles) over every chip, each MATMUL at its dtype's peak."""
        return self.peak_macs_cycles / self.mac_capacity if self.mac_capacity else 0.0

    @property
    def utilisation(self) -> dict:
        """Each unit kind's busy share of all its instances' cycles, over every chip."""
        return {u: busy / self.unit_capacity[u] if self.unit_capacity[u] else 0.0 for u, busy in self.unit_busy.items()}

    @property
    def chips(self) -> int:
        """The most chips one program ran on."""
        return max((len(p.chips) for p in self.programs), default=0)

    def to_dict(self) -> dict:
        return {"cycles": self.cycles, "predicted_cycles": self.predicted_cycles, "microseconds": self.microseconds,
                "mac_utilisation": self.mac_utilisation, "chips": self.chips,
                "utilisation": {str(u): v for u, v in self.utilisation.items()},
                "programs": [{"name": p.name, "cycles": p.cycles, "predicted_cycles": p.predicted_cycles,
                              "chips": list(p.chips), "mac_utilisation": p.mac_utilisation} for p in self.programs]}


def model_stats(simulators: dict) -> ModelStats:
    """The :class:`ModelStats` of a compiled model's loaded simulators (``CompiledModel.simulators``)."""
    programs, busy, capacity, clock = [], {}, {}, 0
    weighted = peak = 0.0
    for name, sim in simulators.items():
        chip_stats = list(sim.stats.chips.items()) if hasattr(sim, "sims") else [(0, sim.stats)]
        clock = sim.stats.clock_hz
        work = sum(s.peak_macs_cycles for _, s in chip_stats)
        room = sum(s.planes * s.array_macs * s.cycles for _, s in chip_stats)
        programs.append(ProgramFigures(name, sim.stats.cycles, sim.stats.predicted_cycles,
                                       tuple(chip for chip, _ in chip_stats), work / room if room else 0.0))
        weighted, peak = weighted + work, peak + room
        for _, s in chip_stats:
            for unit, cycles in s.unit_busy.items():
                busy[unit] = busy.get(unit, 0) + cycles
                capacity[unit] = capacity.get(unit, 0) + s.unit_instances[unit] * s.cycles
    return ModelStats(tuple(programs), clock, busy, capacity, weighted, peak)
