"""The LPX instruction set: one opcode enum and one op table.

Every fact about an opcode lives in its :class:`OpSpec` row of :data:`OP_TABLE`:
the unit that runs it, its group (which fixes its operand and shape rule and its
timing rule), its named attributes (order, kind, default), the ALU operations
per element it costs on the vector unit, the dtypes it computes on, and whether
it can run as the fused epilogue of a matrix or depthwise instruction. The
group sets, ``UNIT_OF``, the decoder's attribute packing, the disassembler and
the ISA reference (``docs/ISA.md``) all derive from this table.

What each opcode computes is :mod:`.semantics` (one function per opcode); the
shapes it accepts are :mod:`.shapes` (one rule per group); what it occupies and
for how long is :mod:`.timing` (one rule per group). Each table is checked at
import: every opcode has a row, semantics and a timing rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, IntEnum
from math import prod
from types import MappingProxyType

import ml_dtypes
import numpy as np

from .errors import LpxUserError


class DType(IntEnum):
    """Storage dtypes of SRAM tensors."""

    F32 = 0
    F16 = 1
    BF16 = 2
    I8 = 3
    I32 = 4
    U8 = 5
    BOOL = 6
    F8 = 7  # fp8 e4m3 (ml_dtypes.float8_e4m3fn)

    @property
    def np(self) -> np.dtype:
        return _DTYPE_INFO[self][0]

    @property
    def itemsize(self) -> int:
        return _DTYPE_INFO[self][0].itemsize

    @property
    def short(self) -> str:
        """The name the codegen, the chip presets and the CLI use (``fp32``, ``int8``, ...)."""
        return _DTYPE_INFO[self][1]

    @property
    def is_float(self) -> bool:
        return self in FLOAT_DTYPES

    @property
    def is_quantized(self) -> bool:
        """An int8 or uint8 tensor: quantised activations and weights."""
        return self in QUANT_DTYPES

    @property
    def int_range(self) -> tuple:
        """(lowest, highest) value of an integer dtype."""
        info = np.iinfo(self.np)
        return int(info.min), int(info.max)

    @property
    def matrix_class(self) -> str:
        """The key of the matrix unit's rate table: uint8 runs at int8's rate."""
        return "int8" if self in QUANT_DTYPES else self.short

    @classmethod
    def from_numpy(cls, dtype) -> "DType":
        dtype = np.dtype(dtype)
        for member, (candidate, _) in _DTYPE_INFO.items():
            if candidate == dtype:
                return member
        raise LpxUserError(f"no LPX dtype for numpy dtype {dtype}")

    @classmethod
    def from_name(cls, name: str) -> "DType":
        for member, (_, short) in _DTYPE_INFO.items():
            if short == name:
                return member
        raise LpxUserError(f"unknown dtype {name!r}; LPX dtypes: {', '.join(d.short for d in cls)}")


_DTYPE_INFO = {
    DType.F32: (np.dtype(np.float32), "fp32"), DType.F16: (np.dtype(np.float16), "fp16"),
    DType.BF16: (np.dtype(ml_dtypes.bfloat16), "bf16"), DType.I8: (np.dtype(np.int8), "int8"),
    DType.I32: (np.dtype(np.int32), "int32"), DType.U8: (np.dtype(np.uint8), "uint8"),
    DType.BOOL: (np.dtype(np.bool_), "bool"), DType.F8: (np.dtype(ml_dtypes.float8_e4m3fn), "fp8"),
}
FLOAT_DTYPES = frozenset({DType.F32, DType.F16, DType.BF16, DType.F8})
QUANT_DTYPES = frozenset({DType.I8, DType.U8})
ANY_DTYPE = frozenset(DType)
# the storage types a whole program can be compiled to (``dtype=`` of the codegen)
STORAGE_DTYPES = ("fp32", "fp16", "bf16", "fp8", "int8")


class Unit(IntEnum):
    """Functional units. MXM has one instance per matrix plane."""

    MEM = 0  # host DMA
    MXM = 1  # matrix
    VXM = 2  # vector elementwise and reductions
    SXM = 3  # switch: transpose, permute, gather, im2col
    C2C = 4  # chip-to-chip
    ICU = 5  # sync, nop


class Space(IntEnum):
    """Where an operand lives: an SRAM tensor, or a stream carrying a chained result between units."""

    SRAM = 0
    STREAM = 1


class Group(Enum):
    """Opcode groups: each has one operand/shape rule and one timing rule."""

    HOST = "host"          # moves between host memory and SRAM over the host link
    CONTROL = "control"    # no data
    INSTALL = "install"    # a stationary operand into a matrix plane's weight buffer
    MATRIX = "matrix"      # products on a matrix plane against its installed buffer
    EPILOGUE = "epilogue"  # bias, activation or requantisation of matrix results, on the vector unit
    UNARY = "unary"        # elementwise, one operand
    BINARY = "binary"      # elementwise, two operands (numpy broadcasting)
    QBINARY = "qbinary"    # elementwise on int8/uint8 operands, requantised (ONNX Runtime's QLinearAdd)
    QUANT = "quant"        # float <-> int8/uint8
    REDUCE = "reduce"      # reductions over axes
    NORM = "norm"          # softmax, layer norm
    WINDOW = "window"      # pooling over a 2-D window
    DEPTHWISE = "depthwise"  # per-channel convolution on the vector unit
    MOVE = "move"          # data movement on the switch unit
    LINK = "link"          # chip-to-chip transfers


@dataclass(frozen=True)
class Attr:
    """One named attribute of an opcode.

    ``kind`` is ``int``, ``float``, ``bool``, ``opcode`` (an activation applied
    as an epilogue), ``ints`` or ``floats`` (tuples; ``length`` fixes their
    length, None means any). ``default`` of ``REQUIRED`` means it must be given.
    """

    name: str
    kind: str
    default: object = None
    length: int | None = None
    doc: str = ""

    @property
    def required(self) -> bool:
        return self.default is REQUIRED


REQUIRED = object()
_SCALAR_KINDS = ("int", "float", "bool", "opcode")
_TUPLE_KINDS = ("ints", "floats")


@dataclass(frozen=True)
class OpSpec:
    """Everything the ISA says about one opcode (see the module docstring)."""

    unit: Unit
    group: Group
    doc: str
    attrs: tuple = ()
    alu_ops: int = 0  # vector ALU operations per output element (elementwise cost class)
    dtypes: frozenset = FLOAT_DTYPES  # dtypes of the operands it computes on
    epilogue: bool = False  # may be applied to a MATMUL or DWCONV result on its way out

    def attr(self, name: str) -> Attr:
        for a in self.attrs:
            if a.name == name:
                return a
        raise KeyError(name)


def _window_attrs() -> tuple:
    return (Attr("kernel", "ints", REQUIRED, 2, "window height, width"),
            Attr("stride", "ints", (1, 1), 2, "step between windows"),
            Attr("pad", "ints", (0, 0, 0, 0), 4, "padding top, left, bottom, right"),
            Attr("dilation", "ints", (1, 1), 2, "spacing of the window's taps"))


def _epilogue_attrs() -> tuple:
    return (Attr("act", "opcode", 0, doc="activation applied on the way out (NOP: none)"),
            Attr("act_args", "floats", (0.0, 0.0), 2, "the activation's own attributes, in its order"))


def _int8_attrs(*names: str) -> tuple:
    return tuple(Attr(n, "int", 0, doc="zero point (int8/uint8 operands only)") for n in names)


_INDEX = (Attr("index", "int", REQUIRED, doc="host tensor index"),
          Attr("offset", "int", 0, doc="byte offset into the host tensor (a slice of it moves)"))


class Opcode(IntEnum):
    """Every LPX instruction; its meaning is its row of ``OP_TABLE``."""

    NOP = 0
    LOAD = 1
    STORE = 2
    STREAM = 3
    MATMUL = 10
    INSTALL = 11
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
    QUANTIZE = 32
    DEQUANTIZE = 33
    LEAKY_RELU = 34
    HARD_SWISH = 35
    EPILOGUE = 36
    NAN_TO_NUM = 37
    SIN = 38
    COS = 39
    ADD = 40
    SUB = 41
    MUL = 42
    DIV = 43
    MAXIMUM = 44
    MINIMUM = 45
    POW = 46
    QADD = 47
    NAN_SELECT = 48
    REDUCE_SUM = 50
    REDUCE_MEAN = 51
    REDUCE_MAX = 52
    SOFTMAX = 53
    LAYERNORM = 54
    MAXPOOL = 55
    AVGPOOL = 56
    DWCONV = 57
    TRANSPOSE = 60
    IM2COL = 61
    CONCAT = 62
    SLICE = 63
    SEND = 70
    RECV = 71


def _unary(doc, alu_ops, attrs=(), epilogue=False, dtypes=FLOAT_DTYPES) -> OpSpec:
    return OpSpec(Unit.VXM, Group.UNARY, doc, attrs, alu_ops, dtypes, epilogue)


def _binary(doc, alu_ops=1, dtypes=FLOAT_DTYPES) -> OpSpec:
    return OpSpec(Unit.VXM, Group.BINARY, doc, (), alu_ops, dtypes)


_AXES = (Attr("axes", "ints", REQUIRED, doc="axes reduced (kept as size 1)"),)
_LINK = (Attr("peer", "int", REQUIRED, doc="the chip at the other end of the transfer (its index in the system)"),
         Attr("tag", "int", REQUIRED, doc="pairs a SEND with its RECV"))

OP_TABLE = {
    Opcode.NOP: OpSpec(Unit.ICU, Group.CONTROL, "wait", (Attr("cycles", "int", 0),)),
    Opcode.LOAD: OpSpec(Unit.MEM, Group.HOST, "host input ─► SRAM", _INDEX, dtypes=ANY_DTYPE),
    Opcode.STORE: OpSpec(Unit.MEM, Group.HOST, "SRAM ─► host output", _INDEX, dtypes=ANY_DTYPE),
    Opcode.STREAM: OpSpec(Unit.MEM, Group.HOST, "host-resident weight ─► SRAM, each time it is used",
                          (Attr("index", "int", REQUIRED, doc="streamed weight index"),), dtypes=ANY_DTYPE),
    Opcode.INSTALL: OpSpec(
        Unit.MXM, Group.INSTALL, "w[K, N] (K, N ≤ the array) ─► the plane's weight buffer",
        (Attr("buffer", "int", 0, doc="which of the plane's weight buffers"),), dtypes=FLOAT_DTYPES | QUANT_DTYPES),
    Opcode.MATMUL: OpSpec(
        Unit.MXM, Group.MATRIX,
        "out = [acc +] (a - zp_a) @ (W - zp_b), W the plane's installed buffer; fp32 sums of float "
        "operands, int32 sums of int8/uint8 ones",
        (Attr("buffer", "int", 0, doc="which installed weight buffer"),) + _int8_attrs("zp_a", "zp_b"),
        dtypes=FLOAT_DTYPES | QUANT_DTYPES),
    Opcode.EPILOGUE: OpSpec(
        Unit.VXM, Group.EPILOGUE,
        "out = act(acc + bias) in the destination's float type, act((acc + bias) · scale) with an fp32 "
        "weight scale (fp8 weights stored scaled to their range; an int8 product's int32 sums dequantised); "
        "for an int8/uint8 destination "
        "saturate(rint(float32(acc + bias) · requant) + zp_out), ONNX Runtime's QLinearConv requantisation",
        _epilogue_attrs() + (Attr("zp_out", "int", 0, doc="output zero point (int8/uint8 only)"),), 3,
        dtypes=frozenset({DType.F32, DType.I32})),  # bias, activation, store (int8: one more, see timing)
    Opcode.COPY: _unary("out = x", 1, dtypes=ANY_DTYPE),
    Opcode.RELU: _unary("max(x, 0)", 1, epilogue=True),
    Opcode.CLIP: _unary("min(max(x, lo), hi)", 2, (Attr("lo", "float", REQUIRED), Attr("hi", "float", REQUIRED)),
                        epilogue=True),
    Opcode.GELU: _unary("x · Φ(x), erf form", 12, epilogue=True),
    Opcode.EXP: _unary("e^x", 4),
    Opcode.ERF: _unary("erf(x)", 8),
    Opcode.TANH: _unary("tanh(x)", 6, epilogue=True),
    Opcode.SIGMOID: _unary("1 / (1 + e^-x)", 6, epilogue=True),
    Opcode.SQRT: _unary("√x", 4),
    Opcode.RSQRT: _unary("1 / √x", 4),
    Opcode.NEG: _unary("-x", 1),
    Opcode.CAST: _unary("convert to the destination's dtype (to fp8: saturating at ±448, e4m3 has no inf)", 1,
                        dtypes=ANY_DTYPE),
    Opcode.LEAKY_RELU: _unary("x if x ≥ 0 else alpha · x", 2, (Attr("alpha", "float", 0.01),), epilogue=True),
    Opcode.HARD_SWISH: _unary("x · min(max(x + 3, 0), 6) / 6", 4, epilogue=True),
    # a compare and a select (assumed); PyTorch's safe softmax gives 0 where a row has no finite score
    Opcode.NAN_TO_NUM: _unary("value where x is NaN, else x", 2, (Attr("value", "float", 0.0),)),
    # a range reduction and a polynomial, as ERF's (assumed): rotary tables from positions (Hugging Face's)
    Opcode.SIN: _unary("sin(x)", 8),
    Opcode.COS: _unary("cos(x)", 8),
    Opcode.QUANTIZE: OpSpec(Unit.VXM, Group.QUANT, "saturate(rint(x / scale) + zero_point), ONNX QuantizeLinear",
                            (Attr("scale", "float", REQUIRED), Attr("zero_point", "int", 0)), 3),
    Opcode.DEQUANTIZE: OpSpec(Unit.VXM, Group.QUANT, "(x - zero_point) · scale, ONNX DequantizeLinear",
                              (Attr("scale", "float", REQUIRED), Attr("zero_point", "int", 0)), 2,
                              QUANT_DTYPES),
    # int32 too: the matrix planes' integer partial sums of one product, split over planes, meet in an ADD
    Opcode.ADD: _binary("a + b", dtypes=FLOAT_DTYPES | {DType.I32}),
    Opcode.SUB: _binary("a - b"),
    Opcode.MUL: _binary("a · b"),
    Opcode.DIV: _binary("a / b", 4),
    Opcode.MAXIMUM: _binary("max(a, b)"),
    Opcode.MINIMUM: _binary("min(a, b)"),
    Opcode.POW: _binary("a ^ b", 8),
    # a compare and a select (assumed), as NAN_TO_NUM's: PyTorch's safe softmax in a QDQ model tests the
    # softmax for NaN and selects from its quantise-dequantised copy
    Opcode.NAN_SELECT: OpSpec(Unit.VXM, Group.BINARY, "value where a is NaN, else b", (Attr("value", "float", 0.0),), 2),
    Opcode.QADD: OpSpec(
        Unit.VXM, Group.QBINARY,
        "saturate(rint((scale_a·(a - zp_a) + scale_b·(b - zp_b)) / scale_out) + zp_out), ONNX Runtime's QLinearAdd",
        tuple(Attr(n, k, REQUIRED if k == "float" else 0) for n, k in (
            ("scale_a", "float"), ("zp_a", "int"), ("scale_b", "float"), ("zp_b", "int"), ("scale_out", "float"),
            ("zp_out", "int"))) + (Attr("act", "opcode", 0, doc="NOP or RELU"),), 4, QUANT_DTYPES),  # 2 FMAs, round, saturate
    Opcode.REDUCE_SUM: OpSpec(Unit.VXM, Group.REDUCE, "sum over axes", _AXES, 1),
    Opcode.REDUCE_MEAN: OpSpec(Unit.VXM, Group.REDUCE, "mean over axes", _AXES, 1),
    Opcode.REDUCE_MAX: OpSpec(Unit.VXM, Group.REDUCE, "max over axes", _AXES, 1),
    Opcode.SOFTMAX: OpSpec(Unit.VXM, Group.NORM, "softmax along axis", (Attr("axis", "int", REQUIRED),), 8),
    Opcode.LAYERNORM: OpSpec(Unit.VXM, Group.NORM, "(x - mean) / √(var + eps) · gamma + beta over trailing axes",
                             (Attr("eps", "float", 1e-5), Attr("n_axes", "int", 1, doc="trailing axes normalised")),
                             8),
    Opcode.MAXPOOL: OpSpec(Unit.VXM, Group.WINDOW, "max over each window (NCHW)", _window_attrs(),
                           dtypes=ANY_DTYPE - {DType.BOOL}),
    Opcode.AVGPOOL: OpSpec(Unit.VXM, Group.WINDOW, "mean over each window (NCHW)",
                           _window_attrs() + (Attr("count_include_pad", "bool", False),)),
    Opcode.DWCONV: OpSpec(
        Unit.VXM, Group.DEPTHWISE,
        "depthwise convolution x[N, C, H, W] * w[C, kh, kw] + bias, then act; on int8 requantised as MATMUL is",
        _window_attrs() + _epilogue_attrs() + _int8_attrs("zp_in", "zp_out"), dtypes=FLOAT_DTYPES | QUANT_DTYPES),
    Opcode.TRANSPOSE: OpSpec(Unit.SXM, Group.MOVE, "permute axes", (Attr("perm", "ints", REQUIRED),),
                             dtypes=ANY_DTYPE),
    Opcode.IM2COL: OpSpec(Unit.SXM, Group.MOVE, "[N, C, H, W] ─► columns [N, G, C/G·kh·kw, OH·OW]",
                          _window_attrs() + (Attr("groups", "int", 1), Attr("pad_value", "int", 0)),
                          dtypes=ANY_DTYPE),
    Opcode.CONCAT: OpSpec(Unit.SXM, Group.MOVE, "join along axis", (Attr("axis", "int", REQUIRED),),
                          dtypes=ANY_DTYPE),
    Opcode.SEND: OpSpec(Unit.C2C, Group.LINK, "SRAM ─► a chip-to-chip link (the unit index is the port), to peer",
                        _LINK, dtypes=ANY_DTYPE),
    Opcode.RECV: OpSpec(Unit.C2C, Group.LINK, "a chip-to-chip link ─► SRAM, as the data arrives from peer",
                        _LINK, dtypes=ANY_DTYPE),
    Opcode.SLICE: OpSpec(Unit.SXM, Group.MOVE, "strided slice: begin and step per axis, the size is the dst's",
                         (Attr("begin", "ints", REQUIRED), Attr("step", "ints", REQUIRED)), dtypes=ANY_DTYPE),
}

assert set(OP_TABLE) == set(Opcode), f"opcodes without a table row: {set(Opcode) - set(OP_TABLE)}"
for _op, _spec in OP_TABLE.items():
    assert not _spec.epilogue or (_spec.group == Group.UNARY and len(_spec.attrs) <= 2), _op


def ops_in(*groups: Group) -> frozenset:
    """The opcodes of the given groups."""
    return frozenset(op for op, spec in OP_TABLE.items() if spec.group in groups)


UNIT_OF = {op: spec.unit for op, spec in OP_TABLE.items()}
UNARY_OPS = ops_in(Group.UNARY)
BINARY_OPS = ops_in(Group.BINARY)
REDUCE_OPS = ops_in(Group.REDUCE)
POOL_OPS = ops_in(Group.WINDOW)
MOVE_OPS = ops_in(Group.MOVE)
EPILOGUE_OPS = frozenset({Opcode.NOP} | {op for op, spec in OP_TABLE.items() if spec.epilogue})

MAX_RANK = 8
MAX_CYCLE = 1 << 48  # issue cycles past this (3.6 days at 900 MHz) are corruption, and overflow int64 sums


# ---------------------------------------------------------------------------
# attributes by name
# ---------------------------------------------------------------------------
def make_attrs(opcode: Opcode, given: dict | None = None) -> dict:
    """The full, checked attribute dict of ``opcode``: defaults filled, kinds checked.

    Raises
    ------
    ValueError
        Naming the opcode and the attribute for an unknown, missing or ill-typed one.
    """
    spec = OP_TABLE[opcode]
    given = dict(given or {})
    unknown = set(given) - {a.name for a in spec.attrs}
    if unknown:
        raise ValueError(f"{opcode.name} has no attribute {sorted(unknown)[0]!r} "
                         f"(it takes {', '.join(a.name for a in spec.attrs) or 'none'})")
    out = {}
    for a in spec.attrs:
        if a.name not in given:
            if a.required:
                raise ValueError(f"{opcode.name} needs attribute {a.name!r}")
            value = a.default
        else:
            value = given[a.name]
        out[a.name] = _coerce(opcode, a, value)
    return out


def _integral(value) -> bool:
    return isinstance(value, (int, np.integer)) or (isinstance(value, (float, np.floating)) and float(value).is_integer())


def _coerce(opcode: Opcode, a: Attr, value):
    where = f"{opcode.name}.{a.name}"
    if a.kind in _TUPLE_KINDS:
        try:
            values = tuple(value)
        except TypeError:
            raise ValueError(f"{where} must be a sequence, got {value!r}") from None
        if a.length is not None and len(values) != a.length:
            raise ValueError(f"{where} takes {a.length} values, got {len(values)}")
        if a.kind == "ints":
            if not all(_integral(v) for v in values):
                raise ValueError(f"{where} must be integers, got {values}")
            return tuple(int(v) for v in values)
        return tuple(float(v) for v in values)
    if a.kind == "float":
        return float(value)
    if not _integral(value):
        raise ValueError(f"{where} must be an integer, got {value!r}")
    value = int(value)
    if a.kind == "bool":
        if value not in (0, 1):
            raise ValueError(f"{where} must be 0 or 1, got {value}")
        return bool(value)
    if a.kind == "opcode":
        if value not in EPILOGUE_OPS:
            raise ValueError(f"{where}: {value} is not an activation that can run as an epilogue")
        return Opcode(value)
    return value


def pack_attrs(opcode: Opcode, attrs: dict) -> tuple:
    """Attributes as the positional float tuple of the binary format: table order, tuples length-prefixed."""
    flat = []
    for a in OP_TABLE[opcode].attrs:
        value = attrs[a.name]
        if a.kind in _TUPLE_KINDS:
            flat.append(float(len(value)))
            flat.extend(float(v) for v in value)
        else:
            flat.append(float(value))
    return tuple(flat)


def unpack_attrs(opcode: Opcode, flat) -> dict:
    """The inverse of :func:`pack_attrs`, checked (ValueError on any mismatch)."""
    return make_attrs(opcode, split_attrs(opcode, flat))


def split_attrs(opcode: Opcode, flat) -> dict:
    """The named values of :func:`pack_attrs`' tuple, their kinds not yet checked (:func:`make_attrs` does,
    as an :class:`Instruction` is made); ValueError on a wrong count."""
    flat = list(flat)
    given, pos = {}, 0
    for a in OP_TABLE[opcode].attrs:
        if pos >= len(flat):
            raise ValueError(f"{opcode.name}: attributes end before {a.name!r}")
        if a.kind in _TUPLE_KINDS:
            n = flat[pos]
            if not float(n).is_integer() or not 0 <= n <= MAX_RANK * 2 or pos + 1 + int(n) > len(flat):
                raise ValueError(f"{opcode.name}.{a.name}: bad length {n}")
            given[a.name] = flat[pos + 1:pos + 1 + int(n)]
            pos += 1 + int(n)
        else:
            given[a.name] = flat[pos]
            pos += 1
    if pos != len(flat):
        raise ValueError(f"{opcode.name}: {len(flat) - pos} attribute values left over")
    return given


def activation_attrs(act: Opcode, args) -> dict:
    """The named attributes of an epilogue activation from an instruction's ``act_args``."""
    spec = OP_TABLE[act]
    return make_attrs(act, {a.name: v for a, v in zip(spec.attrs, args)}) if act != Opcode.NOP else {}


def format_attrs(opcode: Opcode, attrs: dict) -> str:
    """``name=value`` pairs, defaults left out, activations by name (for the disassembler)."""
    parts = []
    for a in OP_TABLE[opcode].attrs:
        value = attrs[a.name]
        if not a.required and value == a.default:
            continue
        if a.name == "act_args" and OP_TABLE[attrs["act"]].attrs:
            named = activation_attrs(attrs["act"], value)
            parts.append(",".join(f"{k}={v:g}" for k, v in named.items()))
            continue
        if a.kind == "opcode":
            text = Opcode(value).name
        elif a.kind in _TUPLE_KINDS:
            text = "x".join(f"{v:g}" for v in value) if a.name in ("kernel", "stride", "dilation") else \
                ",".join(f"{v:g}" for v in value)
        elif a.kind == "bool":
            text = str(bool(value)).lower()
        else:
            text = f"{value:g}"
        parts.append(f"{a.name}={text}")
    return " ".join(parts)


# ---------------------------------------------------------------------------
# instructions
# ---------------------------------------------------------------------------
def _set_enum(obj, name: str, kind) -> None:
    """Store ``obj.name`` as a member of ``kind`` (an int is taken as its value); anything else is named."""
    value = getattr(obj, name)
    if type(value) is kind:
        return
    try:
        object.__setattr__(obj, name, kind(value))
    except (ValueError, TypeError):
        raise TypeError(f"{type(obj).__name__}.{name} must be one of {kind.__name__}'s members, "
                        f"got {value!r}") from None


class cached_property:  # noqa: N801 (a drop-in for functools'): its name says what it is
    """``functools.cached_property`` without its lock (Python 3.11 takes one on every first read, which is most
    of the cost of a ref's first size: the scheduler reads thousands). Computed twice in a race, which is
    harmless for the pure values it caches."""

    def __init__(self, compute):
        self.compute, self.name, self.__doc__ = compute, compute.__name__, compute.__doc__

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        value = obj.__dict__[self.name] = self.compute(obj)
        return value


@dataclass(frozen=True)
class TensorRef:
    """An operand: a (possibly strided) view of SRAM, or a stream.

    Parameters
    ----------
    addr : int
        SRAM byte address of element 0, or the stream's number.
    shape : tuple
    dtype : DType
    strides : tuple, optional
        Element strides per axis; None is dense row-major.
    space : Space
        SRAM (default) or STREAM (a chained result flowing from one unit to the next).
    """

    addr: int
    shape: tuple
    dtype: DType
    strides: tuple | None = None
    space: Space = Space.SRAM

    def __post_init__(self):  # (the numbers are validation's: a program names its first bad one)
        _set_enum(self, "dtype", DType)
        _set_enum(self, "space", Space)

    @cached_property  # a frozen ref's size is asked for by every timing and checking rule: computed once
    def size(self) -> int:
        return prod(self.shape)

    @cached_property
    def nbytes(self) -> int:
        """Bytes of data (what moves), not of the span it lies in."""
        return self.size * self.dtype.itemsize

    @property
    def element_strides(self) -> tuple:
        if self.strides is not None:
            return tuple(self.strides)
        out, step = [], 1
        for d in reversed(self.shape):
            out.append(step)
            step *= d
        return tuple(reversed(out))

    @cached_property  # a frozen ref's derived values are asked for once per rule checked: compute them once
    def end(self) -> int:
        """One past the last byte the view touches."""
        if self.size == 0:
            return self.addr
        last = sum((d - 1) * st for d, st in zip(self.shape, self.element_strides))
        return self.addr + (last + 1) * self.dtype.itemsize

    @cached_property
    def in_sram(self) -> bool:
        return self.space == Space.SRAM

    def footprint(self) -> tuple:
        """The bytes the view touches as a 2-D block ``(addr, rows, run, row_stride)``."""
        return self._footprint

    @cached_property
    def _footprint(self) -> tuple:
        """The bytes the view touches as a 2-D block ``(addr, rows, run, row_stride)``.

        ``rows`` runs of ``run`` contiguous bytes, ``row_stride`` bytes apart. A
        view that is not such a block (three strided axes, say) is widened to its
        bounding range, which only ever adds dependencies, never drops one.
        """
        item = self.dtype.itemsize
        # an axis of stride 0 (a broadcast) repeats the same bytes: it adds none
        axes = sorted(((st, d) for st, d in zip(self.element_strides, self.shape) if d > 1 and st), reverse=True)
        merged = []  # (stride, size) from outermost; neighbours that tile each other merge
        for st, d in axes:
            if merged and merged[-1][0] == st * d:
                merged[-1] = (st, merged[-1][1] * d)
            else:
                merged.append((st, d))
        if not merged:
            return (self.addr, 1, item, item)
        if len(merged) == 1 and merged[0][0] == 1:
            return (self.addr, 1, merged[0][1] * item, merged[0][1] * item)
        if len(merged) == 1:  # one strided axis of single elements
            return (self.addr, merged[0][1], item, merged[0][0] * item)
        if len(merged) == 2 and merged[1][0] == 1 and merged[0][0] >= merged[1][1]:
            return (self.addr, merged[0][1], merged[1][1] * item, merged[0][0] * item)
        span = self.end - self.addr
        return (self.addr, 1, span, span)

    def __str__(self) -> str:
        dims = "x".join(str(d) for d in self.shape) or "scalar"
        if self.space == Space.STREAM:
            return f"{self.dtype.short}[{dims}]@S{self.addr}"
        view = "" if self.strides is None else "/" + ",".join(str(s) for s in self.strides)
        return f"{self.dtype.short}[{dims}]@{self.addr:#x}{view}"


@dataclass(frozen=True)
class HostTensor:
    """Shape and dtype of a program input or output on the host side."""

    shape: tuple
    dtype: DType

    def __post_init__(self):
        _set_enum(self, "dtype", DType)
        shape = self.shape
        if not isinstance(shape, (tuple, list)) or not all(_integral(d) and d >= 0 for d in shape):
            raise TypeError(f"HostTensor.shape must be a tuple of non-negative integers, got {shape!r}")
        object.__setattr__(self, "shape", tuple(int(d) for d in shape))

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
    attrs : dict
        Named attributes (see ``OP_TABLE``); missing ones take their defaults. Checked here, and read-only
        from then on (a mapping proxy): a value set afterwards would reach the simulator unchecked.
    layer : int
        Index into the program's layer names, for per-layer reports.
    """

    opcode: Opcode
    unit_index: int
    cycle: int
    srcs: tuple = ()
    dsts: tuple = ()
    attrs: dict = field(default_factory=dict)
    layer: int = 0

    def __post_init__(self):
        _set_enum(self, "opcode", Opcode)
        for name in ("srcs", "dsts"):  # tuples of TensorRef: the checks and the simulator read them so
            refs = getattr(self, name)
            if not isinstance(refs, (tuple, list)) or not all(isinstance(ref, TensorRef) for ref in refs):
                raise TypeError(f"{self.opcode.name}: {name} must be a tuple of TensorRef, got {refs!r}")
            object.__setattr__(self, name, tuple(refs))
        object.__setattr__(self, "attrs", MappingProxyType(make_attrs(self.opcode, self.attrs)))

    @property
    def unit(self) -> Unit:
        return UNIT_OF[self.opcode]

    @property
    def spec(self) -> OpSpec:
        return OP_TABLE[self.opcode]


# ---------------------------------------------------------------------------
# the ISA reference (docs/ISA.md is this text; scripts/isa_doc.py writes it)
# ---------------------------------------------------------------------------
def isa_reference() -> str:
    """The ISA reference in Markdown, generated from the op table."""
    lines = ["# The LPX instruction set", "",
             "Generated from `runtime_sim/isa.py` (`OP_TABLE`) by `python scripts/isa_doc.py`; a test checks it is",
             "current. Every instruction names its unit instance, its issue cycle, its operands (SRAM views or",
             "chained streams) and the attributes below; its timing is `runtime_sim/timing.py`, its meaning",
             "`runtime_sim/semantics.py`.", ""]
    for group in Group:
        ops = [op for op, spec in OP_TABLE.items() if spec.group == group]
        if not ops:
            continue
        lines += [f"## {group.value}", "", "| opcode | unit | computes | attributes | ALU ops/element | dtypes | "
                  "epilogue |", "|---|---|---|---|---|---|---|"]
        for op in ops:
            spec = OP_TABLE[op]
            attrs = "; ".join(_describe_attr(a) for a in spec.attrs) or "none"
            dtypes = "any" if spec.dtypes == ANY_DTYPE else ", ".join(sorted(d.short for d in spec.dtypes))
            lines.append(f"| `{op.name}` ({int(op)}) | {spec.unit.name} | {spec.doc} | {attrs} | "
                         f"{spec.alu_ops or ''} | {dtypes} | {'yes' if spec.epilogue else ''} |")
        lines.append("")
    return "\n".join(lines)


def _describe_attr(a: Attr) -> str:
    kind = f"{a.kind}[{a.length}]" if a.length else a.kind
    default = "required" if a.required else f"default {Opcode(a.default).name if a.kind == 'opcode' else a.default}"
    return f"`{a.name}` {kind}, {default}" + (f": {a.doc}" if a.doc else "")
