"""The cost model: cycles, FLOPs and bytes of one instruction on one chip, one rule per group.

Every instruction costs its unit's fixed latency plus the larger of its compute
time and its SRAM streaming time; which one is larger is its ``bound``.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil, prod

import numpy as np

from .config import ChipConfig
from .isa import OP_TABLE, Group, Instruction


@dataclass(frozen=True)
class Cost:
    """What one instruction costs: cycles, arithmetic work and SRAM traffic."""

    cycles: int
    flops: int
    bytes: int
    bound: str  # "compute", "memory", "host" or "latency"


def _matrix(ins, config):
    a, b = ins.srcs[0].shape, ins.srcs[1].shape
    m, k, n = a[-2], a[-1], b[-1]
    batch = prod(np.broadcast_shapes(a[:-2], b[:-2]))
    r, c = config.mxm_rows, config.mxm_cols
    passes = min(m * ceil(k / r) * ceil(n / c), n * ceil(k / r) * ceil(m / c))
    return batch * passes * config.mxm_passes[ins.srcs[0].dtype.matrix_class], 2 * batch * m * k * n


def _vector(elements_of):
    def rule(ins, config):
        flops = elements_of(ins)
        return ceil(flops / config.vxm_alus), flops
    return rule


def _window_taps(ins) -> int:
    kh, kw = ins.attrs["kernel"]
    return kh * kw


def _switch(ins, config):
    return ceil(ins.dsts[0].nbytes / config.sxm_bytes_per_cycle), 0


# group -> (instruction, config) -> (compute cycles, flops)
COMPUTE_RULES = {
    Group.MATRIX: _matrix,
    Group.UNARY: _vector(lambda ins: ins.dsts[0].size * ins.spec.alu_ops),
    Group.BINARY: _vector(lambda ins: ins.dsts[0].size * ins.spec.alu_ops),
    Group.QUANT: _vector(lambda ins: ins.dsts[0].size * ins.spec.alu_ops),
    Group.NORM: _vector(lambda ins: ins.dsts[0].size * ins.spec.alu_ops),
    Group.REDUCE: _vector(lambda ins: ins.srcs[0].size),
    Group.WINDOW: _vector(lambda ins: ins.dsts[0].size * _window_taps(ins)),
    Group.DEPTHWISE: _vector(lambda ins: ins.dsts[0].size * 2 * _window_taps(ins)),  # a multiply and an add per tap
    Group.MOVE: _switch,
}
assert {s.group for s in OP_TABLE.values()} <= set(COMPUTE_RULES) | {Group.HOST, Group.CONTROL}, \
    "every group needs a cost rule"


def instruction_cost(instr: Instruction, config: ChipConfig) -> Cost:
    """Cycles, FLOPs and bytes of ``instr`` on ``config``."""
    group = instr.spec.group
    latency = config.latency_cycles[instr.unit.name]
    if group == Group.CONTROL:
        return Cost(latency + instr.attrs["cycles"], 0, 0, "latency")
    if group == Group.HOST:
        host_bytes = (instr.dsts or instr.srcs)[0].nbytes
        return Cost(latency + ceil(host_bytes / config.host_bytes_per_cycle), 0, host_bytes, "host")
    compute, flops = COMPUTE_RULES[group](instr, config)
    moved = sum(r.nbytes for r in instr.srcs) + sum(r.nbytes for r in instr.dsts)
    memory = ceil(moved / config.sram_bytes_per_cycle)
    bound = "compute" if compute >= memory else "memory"
    return Cost(latency + max(compute, memory), int(flops), moved, bound)
