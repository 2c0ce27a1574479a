"""The LPX instruction set: one opcode enum, group sets, and instruction records.

What each opcode computes is one table in :mod:`.semantics`; what it costs is
:mod:`.cost`. Every instruction names its unit (derived from the opcode and
checked when decoded), the unit instance, its issue cycle, its SRAM operands and
its attributes.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from math import prod

import ml_dtypes
import numpy as np


class DType(IntEnum):
    """Storage dtypes of SRAM tensors."""

    F32 = 0
    F16 = 1
    BF16 = 2
    I8 = 3
    I32 = 4
    U8 = 5
    BOOL = 6

    @property
    def np(self) -> np.dtype:
        return _NUMPY[self]

    @property
    def itemsize(self) -> int:
        return _NUMPY[self].itemsize

    @property
    def short(self) -> str:
        return _SHORT[self]

    @classmethod
    def from_numpy(cls, dtype) -> "DType":
        dtype = np.dtype(dtype)
        for member, candidate in _NUMPY.items():
            if candidate == dtype:
                return member
        raise ValueError(f"no LPX dtype for numpy dtype {dtype}")


_NUMPY = {
    DType.F32: np.dtype(np.float32), DType.F16: np.dtype(np.float16),
    DType.BF16: np.dtype(ml_dtypes.bfloat16), DType.I8: np.dtype(np.int8),
    DType.I32: np.dtype(np.int32), DType.U8: np.dtype(np.uint8), DType.BOOL: np.dtype(np.bool_),
}
FLOAT_DTYPES = frozenset({DType.F32, DType.F16, DType.BF16})
INT_DTYPES = frozenset({DType.I8, DType.U8})  # quantised activations and weights
_SHORT = {DType.F32: "fp32", DType.F16: "fp16", DType.BF16: "bf16", DType.I8: "int8",
          DType.I32: "int32", DType.U8: "uint8", DType.BOOL: "bool"}


class Unit(IntEnum):
    """Functional units. MXM has one instance per matrix plane."""

    MEM = 0  # host DMA
    MXM = 1  # matrix
    VXM = 2  # vector elementwise and reductions
    SXM = 3  # switch: transpose, permute, gather, im2col
    C2C = 4  # chip-to-chip
    ICU = 5  # sync, nop


class Opcode(IntEnum):
    """Every LPX instruction. Attribute layouts are documented in semantics.py."""

    NOP = 0
    # MEM
    LOAD = 1
    STORE = 2
    STREAM = 3  # a host-resident weight (too big to stay in SRAM) into SRAM, one tile per use
    # MXM
    MATMUL = 10
    # VXM, unary
    COPY = 20
    RELU = 21
    CLIP = 22
    GELU = 23
    EXP = 24
    ERF = 25
    TANH = 26
    SIGMOID = 27
    SQRT = 28
    RSQRT = 29
    NEG = 30
    CAST = 31
    QUANTIZE = 32    # float -> int8/uint8: saturate(round_half_even(x / scale) + zero_point), ONNX QuantizeLinear
    DEQUANTIZE = 33  # int8/uint8 -> float: (x - zero_point) * scale, ONNX DequantizeLinear
    # VXM, binary (numpy broadcasting)
    ADD = 40
    SUB = 41
    MUL = 42
    DIV = 43
    MAXIMUM = 44
    MINIMUM = 45
    POW = 46
    # VXM, other
    REDUCE_SUM = 50
    REDUCE_MEAN = 51
    REDUCE_MAX = 52
    SOFTMAX = 53
    LAYERNORM = 54
    MAXPOOL = 55
    AVGPOOL = 56
    DWCONV = 57  # depthwise convolution: per-channel taps are vector work, not matrix work
    # SXM
    TRANSPOSE = 60
    IM2COL = 61
    CONCAT = 62
    SLICE = 63


UNARY_OPS = frozenset({Opcode.COPY, Opcode.RELU, Opcode.CLIP, Opcode.GELU, Opcode.EXP, Opcode.ERF,
                       Opcode.TANH, Opcode.SIGMOID, Opcode.SQRT, Opcode.RSQRT, Opcode.NEG, Opcode.CAST})
BINARY_OPS = frozenset({Opcode.ADD, Opcode.SUB, Opcode.MUL, Opcode.DIV, Opcode.MAXIMUM,
                        Opcode.MINIMUM, Opcode.POW})
REDUCE_OPS = frozenset({Opcode.REDUCE_SUM, Opcode.REDUCE_MEAN, Opcode.REDUCE_MAX})
POOL_OPS = frozenset({Opcode.MAXPOOL, Opcode.AVGPOOL})
MOVE_OPS = frozenset({Opcode.TRANSPOSE, Opcode.IM2COL, Opcode.CONCAT, Opcode.SLICE})
# activations an MXM instruction may apply on the way out (its epilogue through VXM)
EPILOGUE_OPS = frozenset({Opcode.NOP, Opcode.RELU, Opcode.CLIP, Opcode.GELU, Opcode.SIGMOID, Opcode.TANH})

UNIT_OF = {
    Opcode.NOP: Unit.ICU, Opcode.LOAD: Unit.MEM, Opcode.STORE: Unit.MEM, Opcode.STREAM: Unit.MEM,
    Opcode.MATMUL: Unit.MXM,
    **{op: Unit.VXM for op in UNARY_OPS | BINARY_OPS | REDUCE_OPS | POOL_OPS},
    Opcode.SOFTMAX: Unit.VXM, Opcode.LAYERNORM: Unit.VXM, Opcode.DWCONV: Unit.VXM,
    Opcode.QUANTIZE: Unit.VXM, Opcode.DEQUANTIZE: Unit.VXM,
    **{op: Unit.SXM for op in MOVE_OPS},
}
assert set(UNIT_OF) == set(Opcode), "every opcode needs a unit"

MAX_RANK = 8


@dataclass(frozen=True)
class TensorRef:
    """A dense row-major tensor in SRAM."""

    addr: int
    shape: tuple
    dtype: DType

    @property
    def size(self) -> int:
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def end(self) -> int:
        return self.addr + self.nbytes

    def __str__(self) -> str:
        dims = "x".join(str(d) for d in self.shape) or "scalar"
        return f"{self.dtype.short}[{dims}]@{self.addr:#x}"


@dataclass(frozen=True)
class HostTensor:
    """Shape and dtype of a program input or output on the host side."""

    shape: tuple
    dtype: DType

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Instruction:
    """One statically scheduled instruction.

    Parameters
    ----------
    opcode : Opcode
    unit_index : int
        Which instance of the opcode's unit runs it (the MXM plane, say).
    cycle : int
        Issue cycle, decided by the compiler.
    srcs, dsts : tuple of TensorRef
        SRAM operands read and written.
    attrs : tuple of float
        Opcode attributes (integers are stored exactly as floats).
    layer : int
        Index into the program's layer names, for per-layer reports.
    """

    opcode: Opcode
    unit_index: int
    cycle: int
    srcs: tuple = ()
    dsts: tuple = ()
    attrs: tuple = ()
    layer: int = 0

    @property
    def unit(self) -> Unit:
        return UNIT_OF[self.opcode]
