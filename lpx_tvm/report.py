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
