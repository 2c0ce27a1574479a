"""The cost model: cycles, FLOPs and bytes of one instruction on one chip.

Defined once here; the compiler's scheduler and the simulator both call it, so
the cycle count the compiler predicts is the one the simulator measures.

Every instruction costs its unit's fixed latency plus the larger of its compute
time and its SRAM streaming time; which one is larger is its ``bound``.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil, prod

import numpy as np

from .config import ChipConfig
from .isa import BINARY_OPS, POOL_OPS, REDUCE_OPS, UNARY_OPS, Instruction, Opcode, Unit

# VXM ALU operations per output element (transcendentals take several passes)
VXM_OPS_PER_ELEMENT = {
    Opcode.COPY: 1, Opcode.CAST: 1, Opcode.RELU: 1, Opcode.CLIP: 2, Opcode.NEG: 1,
    Opcode.GELU: 12, Opcode.EXP: 4, Opcode.ERF: 8, Opcode.TANH: 6, Opcode.SIGMOID: 6,
    Opcode.SQRT: 4, Opcode.RSQRT: 4,
    Opcode.ADD: 1, Opcode.SUB: 1, Opcode.MUL: 1, Opcode.DIV: 4, Opcode.MAXIMUM: 1,
    Opcode.MINIMUM: 1, Opcode.POW: 8,
    Opcode.SOFTMAX: 8, Opcode.LAYERNORM: 8, Opcode.QUANTIZE: 3, Opcode.DEQUANTIZE: 2,
}


@dataclass(frozen=True)
class Cost:
    """What one instruction costs: cycles, arithmetic work and SRAM traffic."""

    cycles: int
    flops: int
    bytes: int
    bound: str  # "compute", "memory", "host" or "latency"


def _stream_cycles(nbytes: int, bytes_per_cycle: float) -> int:
    return ceil(nbytes / bytes_per_cycle)


def instruction_cost(instr: Instruction, config: ChipConfig) -> Cost:
    """Cycles, FLOPs and bytes of ``instr`` on ``config``."""
    op = instr.opcode
    unit = instr.unit
    latency = config.latency_cycles[unit.name]
    moved = sum(r.nbytes for r in instr.srcs) + sum(r.nbytes for r in instr.dsts)

    if op == Opcode.NOP:
        return Cost(latency + int(instr.attrs[0]), 0, 0, "latency")
    if unit == Unit.MEM:
        host_bytes = (instr.dsts or instr.srcs)[0].nbytes
        return Cost(latency + _stream_cycles(host_bytes, config.host_bytes_per_cycle), 0, host_bytes, "host")

    if op == Opcode.MATMUL:
        a, b = instr.srcs[0].shape, instr.srcs[1].shape
        m, k, n = a[-2], a[-1], b[-1]
        batch = prod(np.broadcast_shapes(a[:-2], b[:-2]))
        r, c = config.mxm_rows, config.mxm_cols
        # the compiler keeps whichever operand wastes less of the array stationary
        passes = min(m * ceil(k / r) * ceil(n / c), n * ceil(k / r) * ceil(m / c))
        compute = batch * passes * config.mxm_passes[instr.srcs[0].dtype.short]
        flops = 2 * batch * m * k * n
    elif unit == Unit.SXM:
        compute = _stream_cycles(instr.dsts[0].nbytes, config.sxm_bytes_per_cycle)
        flops = 0
    else:
        if op in REDUCE_OPS:
            elements, per = instr.srcs[0].size, 1
        elif op in POOL_OPS:
            elements, per = instr.dsts[0].size, int(instr.attrs[0]) * int(instr.attrs[1])
        elif op == Opcode.DWCONV:  # a multiply and an add per tap
            elements, per = instr.dsts[0].size, 2 * int(instr.attrs[0]) * int(instr.attrs[1])
        else:
            elements, per = instr.dsts[0].size, VXM_OPS_PER_ELEMENT[op]
        flops = elements * per
        compute = ceil(flops / config.vxm_alus)

    memory = _stream_cycles(moved, config.sram_bytes_per_cycle)
    bound = "compute" if compute >= memory else "memory"
    return Cost(latency + max(compute, memory), int(flops), moved, bound)


assert set(VXM_OPS_PER_ELEMENT) >= (UNARY_OPS | BINARY_OPS), "every elementwise op needs a VXM cost"
