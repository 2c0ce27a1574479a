"""What every opcode computes: one table ``Opcode -> numpy function``.

A semantics function has the signature ``f(outs, ins, attrs)``: ``ins`` and
``outs`` are numpy views of the instruction's operands (SRAM views, or host
arrays for LOAD/STORE), ``attrs`` its named attributes (``isa.OP_TABLE``), and it
writes its results into ``outs``. Floating-point storage types (fp16, bf16,
fp8) compute and accumulate in fp32 and round once on the way out, as the
hardware does. Integer kernels (int8/uint8) accumulate exactly and requantise
as ONNX Runtime's QLinear operators define it.

:mod:`.shapes` is the other half of the definition: the shapes an opcode's
outputs must have, given its inputs and attributes.
"""

from __future__ import annotations


import ml_dtypes
import numpy as np

from .isa import BINARY_OPS, OP_TABLE, UNARY_OPS, DType, Opcode, activation_attrs

F32 = np.float32
_INT_RANGES = {DType.I8.np: DType.I8.int_range, DType.U8.np: DType.U8.int_range}


def _f32(a: np.ndarray) -> np.ndarray:
    return a if a.dtype == F32 else a.astype(F32)


# a block of rows this large keeps widen_half's passes in a core's cache (1 MB of fp32, half of a 2 MB L2)
_HALF_ROWS_ELEMENTS = 1 << 18
_HALF_TO_FLOAT_SCALE = F32(2.0 ** 112)  # 2 ** (127 - 15): the two formats' exponent biases apart
_HALF_EXPONENT = 0x7C00  # an fp16's exponent bits: all set in an inf or a NaN


def widen_half(x: np.ndarray) -> np.ndarray:
    """An fp16 array in fp32, bit for bit as ``x.astype(np.float32)``, 2-3 times as fast: numpy casts half
    floats one element at a time. Here each block of rows is moved as integers (the 16 bits shifted into the
    float's place, sign-extended, then masked) and scaled by 2**112, which is exact for every finite half,
    subnormals included (with the FPU keeping subnormals, as numpy leaves it: the scaling is the one pass that
    meets an fp32 subnormal, and makes it normal); a block holding an inf or a NaN is cast by numpy instead. A
    product of many rows (a prefill's) widens its fp16 tile whole, by this."""
    if x.ndim != 2 or x.strides[1] != 2 or x.size < 4096:
        return x.astype(F32)
    return _widen_half_into(x, np.empty(x.shape, F32))


def _widen_half_into(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """:func:`widen_half` of a 2-D fp16 array with unit column stride, into the fp32 ``out`` of its shape."""
    rows = max(1, _HALF_ROWS_ELEMENTS // x.shape[1])
    magnitude = np.empty((rows, x.shape[1]), np.int16)
    for start in range(0, x.shape[0], rows):
        half, widened = x[start:start + rows], out[start:start + rows]
        if not finite_half(half, magnitude):
            np.copyto(widened, half)
            continue
        _half_bits_into(half, widened)
        widened *= _HALF_TO_FLOAT_SCALE
    return out


def finite_half(half: np.ndarray, magnitude: np.ndarray | None = None) -> bool:
    """Whether the fp16 array ``half`` holds no inf and no NaN, asked as integers (numpy's ``isfinite`` takes
    halves one at a time); ``magnitude``: int16 scratch of its shape or more rows, or None."""
    mine = np.empty(half.shape, np.int16) if magnitude is None else magnitude[:len(half)]
    np.bitwise_and(half.view(np.int16), 0x7FFF, out=mine)
    return bool(mine.max(initial=0) < _HALF_EXPONENT)


def _half_bits_into(half: np.ndarray, out: np.ndarray) -> None:
    """A finite fp16 block into the fp32 ``out`` scaled by 2**-112 (exactly: the half's bits in the float's place)."""
    bits = out.view(np.int32)
    np.copyto(bits, half.view(np.int16))  # sign-extended
    bits <<= 13
    bits &= np.int32(-0x70000001)  # keep the sign bit, clear its extension


def to_f32(x: np.ndarray) -> np.ndarray:
    """``x`` in fp32 (itself where it is already): fp16 by :func:`widen_half`."""
    if x.dtype == F32:
        return x
    return widen_half(x) if x.dtype == np.float16 else x.astype(F32)


_F8 = DType.F8.np
_F8_MAX = F32(ml_dtypes.finfo(_F8).max)


def _store(out: np.ndarray, value: np.ndarray) -> None:
    if out.dtype == _F8:  # e4m3 has no infinity: a result past ±448 saturates (NaN stays NaN)
        value = np.clip(value, -_F8_MAX, _F8_MAX)
    if value is not out:
        np.copyto(out, value.reshape(out.shape), casting="unsafe")


def erf(x: np.ndarray) -> np.ndarray:
    """erf in fp32 (Abramowitz & Stegun 7.1.26, evaluated in fp32 in place; |error| < 6e-7).

    fp32 arithmetic rather than fp64 because GELU-heavy transformers spend most of
    their non-GEMM time here; the error stays a few fp32 ulps.
    """
    x = _f32(np.asarray(x))
    a = np.abs(x)
    t = F32(0.3275911) * a
    t += F32(1.0)
    np.reciprocal(t, out=t)
    poly = t * F32(1.061405429)
    for coefficient in (-1.453152027, 1.421413741, -0.284496736, 0.254829592):
        poly += F32(coefficient)
        poly *= t
    np.square(a, out=a)
    np.negative(a, out=a)
    np.exp(a, out=a)
    poly *= a
    np.subtract(F32(1.0), poly, out=poly)
    return np.copysign(poly, x, out=poly)


def gelu(x: np.ndarray) -> np.ndarray:
    return (x * F32(0.5) * (F32(1.0) + erf(x * F32(0.7071067811865476)))).astype(F32)


def sigmoid(x: np.ndarray) -> np.ndarray:
    # two branches so large |x| never overflows exp
    out = np.empty_like(x)
    pos = x >= 0
    out[pos] = 1.0 / (1.0 + np.exp(-x[pos]))
    ex = np.exp(x[~pos])
    out[~pos] = ex / (1.0 + ex)
    return out


def leaky_relu(x, attrs):
    return np.where(x >= 0, x, x * F32(attrs["alpha"])).astype(F32)


def hard_swish(x, attrs):
    return (x * np.clip(x + F32(3), F32(0), F32(6)) / F32(6)).astype(F32)


# unary functions on fp32 arrays: f(x, attrs) -> array
UNARY_FUNCS = {
    Opcode.COPY: lambda x, attrs: x,
    Opcode.CAST: lambda x, attrs: x,
    Opcode.RELU: lambda x, attrs: np.maximum(x, F32(0)),
    Opcode.CLIP: lambda x, attrs: np.clip(x, F32(attrs["lo"]), F32(attrs["hi"])),
    Opcode.GELU: lambda x, attrs: gelu(x),
    Opcode.EXP: lambda x, attrs: np.exp(x),
    Opcode.ERF: lambda x, attrs: erf(x),
    Opcode.TANH: lambda x, attrs: np.tanh(x),
    Opcode.SIGMOID: lambda x, attrs: sigmoid(x),
    Opcode.SQRT: lambda x, attrs: np.sqrt(x),
    Opcode.RSQRT: lambda x, attrs: F32(1.0) / np.sqrt(x),
    Opcode.NEG: lambda x, attrs: np.negative(x),
    Opcode.LEAKY_RELU: leaky_relu,
    Opcode.HARD_SWISH: hard_swish,
    Opcode.NAN_TO_NUM: lambda x, attrs: np.where(np.isnan(x), F32(attrs["value"]), x),
    Opcode.SIN: lambda x, attrs: np.sin(x),
    Opcode.COS: lambda x, attrs: np.cos(x),
}

BINARY_UFUNCS = {
    Opcode.ADD: np.add, Opcode.SUB: np.subtract, Opcode.MUL: np.multiply, Opcode.DIV: np.divide,
    Opcode.MAXIMUM: np.maximum, Opcode.MINIMUM: np.minimum, Opcode.POW: np.power,
}


# the unary ops that are one numpy ufunc: from fp32 into fp32 they write their destination directly
_UNARY_INTO = {
    Opcode.RELU: lambda x, attrs, out: np.maximum(x, F32(0), out=out),
    Opcode.CLIP: lambda x, attrs, out: np.clip(x, F32(attrs["lo"]), F32(attrs["hi"]), out=out),
    Opcode.EXP: lambda x, attrs, out: np.exp(x, out=out),
    Opcode.TANH: lambda x, attrs, out: np.tanh(x, out=out),
    Opcode.SQRT: lambda x, attrs, out: np.sqrt(x, out=out),
    Opcode.NEG: lambda x, attrs, out: np.negative(x, out=out),
    Opcode.SIN: lambda x, attrs, out: np.sin(x, out=out),
    Opcode.COS: lambda x, attrs, out: np.cos(x, out=out),
}


def _unary(op):
    fn, into = UNARY_FUNCS[op], _UNARY_INTO.get(op)

    def run(outs, ins, attrs):
        x, out = ins[0], outs[0]
        if op == Opcode.COPY:
            _store(out, x)
        elif into is not None and x.dtype == out.dtype == F32:
            into(x, attrs, out)
        else:
            _store(out, fn(_f32(x), attrs))
    return run


def _binary(op):
    ufunc = BINARY_UFUNCS.get(op)

    def run(outs, ins, attrs):
        a, b = ins
        out = outs[0]
        if op == Opcode.NAN_SELECT:
            _store(out, np.where(np.isnan(_f32(a)), F32(attrs["value"]), _f32(b)))
        elif a.dtype == b.dtype == out.dtype and a.dtype in (F32, np.int32):
            ufunc(a, b, out=out)  # int32 partial sums add exactly, as the planes' accumulators do
        else:
            _store(out, ufunc(_f32(a), _f32(b)))
    return run


def apply_epilogue(acc: np.ndarray, attrs: dict) -> np.ndarray:
    """The activation an instruction applies to its fp32 result on the way out (in place where it can)."""
    act = attrs["act"]
    if act == Opcode.NOP:
        return acc
    if act == Opcode.RELU:
        return np.maximum(acc, F32(0), out=acc)
    return UNARY_FUNCS[act](acc, activation_attrs(act, attrs["act_args"]))


def quantize_linear(x: np.ndarray, scale: float, zero_point: int, dtype) -> np.ndarray:
    """ONNX QuantizeLinear: ``saturate(rint(x / scale) + zero_point)`` in fp32, ties to even."""
    lo, hi = _INT_RANGES[np.dtype(dtype)]
    return np.clip(np.rint(_f32(x) / F32(scale)) + F32(zero_point), lo, hi).astype(dtype)


def dequantize_linear(x: np.ndarray, scale: float, zero_point: int) -> np.ndarray:
    """ONNX DequantizeLinear: ``(x - zero_point) · scale`` in fp32."""
    return (x.astype(F32) - F32(zero_point)) * F32(scale)


def host_convert(x: np.ndarray, scale: float, zero_point: int, dtype) -> np.ndarray:
    """What the host does to an fp32 input before the link: QuantizeLinear into an integer type, or rounding
    to nearest into a narrow float type as a CAST into it rounds: past fp16's range to ±inf (IEEE's overflow, as
    a mask of float32's lowest does), past fp8's ±448 saturating (e4m3 has no infinity)."""
    dtype = np.dtype(dtype)
    if dtype in _INT_RANGES:
        return quantize_linear(x, scale, zero_point, dtype)
    if dtype == _F8:
        return np.clip(_f32(x), -_F8_MAX, _F8_MAX).astype(dtype)
    with np.errstate(over="ignore"):
        return _f32(x).astype(dtype)


def host_widen(out: np.ndarray, x: np.ndarray, scale: float, zero_point: int) -> None:
    """What the host does to a narrow output after the link: DequantizeLinear from an integer type, or the
    exact widening of a narrow float type, into the fp32 ``out``."""
    np.copyto(out, dequantize_linear(x, scale, zero_point) if x.dtype in _INT_RANGES else x)


def _quantize(outs, ins, attrs):
    np.copyto(outs[0], quantize_linear(ins[0], attrs["scale"], attrs["zero_point"], outs[0].dtype))


def _dequantize(outs, ins, attrs):
    _store(outs[0], dequantize_linear(ins[0], attrs["scale"], attrs["zero_point"]))


def requantize(out, acc, requant, act: Opcode, zp_out: int) -> None:
    """int32 accumulator -> int8/uint8 output: saturate(rint(float32(acc) * requant) + zp_out)."""
    scaled = np.rint(acc.astype(F32) * requant) + F32(zp_out)
    lo, hi = _INT_RANGES[out.dtype]
    if act == Opcode.RELU:
        lo = max(lo, zp_out)
    np.copyto(out, np.clip(scaled, lo, hi).reshape(out.shape), casting="unsafe")


class WeightBuffer:
    """One of a matrix plane's weight buffers: the tile the last INSTALL into it put there.

    It also keeps the tile converted for the arithmetic (fp32, or shifted by a
    zero point), made once per install rather than once per MATMUL.
    """

    __slots__ = ("_value", "_converted")
    keeps_conversions = True  # made once per install: a product reuses them rather than widening in blocks

    def __init__(self):
        self._value, self._converted = None, {}

    @property
    def value(self):
        return self._value

    @value.setter
    def value(self, tile):
        self._value, self._converted = tile, {}

    def converted(self, dtype, zero_point: int = 0) -> np.ndarray:
        if self._value.dtype == dtype and not zero_point:
            return self._value
        key = (np.dtype(dtype), zero_point)
        if key not in self._converted:
            tile = to_f32(self._value) if key[0] == F32 else self._value.astype(dtype)
            self._converted[key] = tile - dtype(zero_point) if zero_point else tile
        return self._converted[key]


def _install(outs, ins, attrs):
    """outs[0] is the plane's WeightBuffer; the tile is copied (its SRAM may be reused while it is installed)."""
    outs[0].value = np.array(ins[0])


def exact_in_fp32(a_dtype, zp_a: int, b_dtype, zp_b: int, k: int) -> bool:
    """Whether every int32 sum of ``k`` products of shifted integers is exact in fp32 (below 2**24)."""
    def largest(dtype, zp):
        lo, hi = _INT_RANGES.get(np.dtype(dtype), (-128, 255))
        return max(hi - zp, zp - lo)
    return largest(a_dtype, zp_a) * largest(b_dtype, zp_b) * k < 2 ** 24


def _matmul(outs, ins, attrs):
    """out = [acc +] (a - zp_a) @ (W - zp_b): exact int32 sums for int8/uint8, fp32 sums for floats."""
    a, buffer, out = ins[0], ins[1], outs[0]
    if out.dtype == np.int32:
        # a tile's K is at most the array's rows: in fp32 the sums are exact for the usual zero points
        exact = exact_in_fp32(a.dtype, attrs["zp_a"], buffer.value.dtype, attrs["zp_b"], a.shape[-1])
        wide = F32 if exact else np.float64
        shifted = a.astype(wide)
        if attrs["zp_a"]:
            shifted -= wide(attrs["zp_a"])
        acc = np.matmul(shifted, buffer.converted(wide, attrs["zp_b"]))
        if len(ins) == 3:  # the partial sum runs past fp32's exact integers: add it as an integer
            acc = acc.astype(np.int64)
            acc += ins[2]
        np.copyto(out, acc, casting="unsafe")
        return
    direct = out.dtype == F32 and (len(ins) == 2 or not np.shares_memory(out, ins[2]))
    a = _f32(a)
    tile = buffer.value
    if a.ndim == 2 and len(a) <= _FEW_ROWS and tile.dtype == np.float16 and tile.size >= 4096 \
            and tile.strides[1] == 2 and tile.strides[0] >= 2 * tile.shape[1] and not buffer.keeps_conversions:
        product = half_product(a, tile, out if direct else None)
    else:  # straight into out, whatever its layout (numpy writes a transposed or strided one as fast)
        product = np.matmul(a, buffer.converted(F32), out=out if direct else None)
    if direct:
        if len(ins) == 3:
            out += ins[2]
        return
    if len(ins) == 3:
        product += ins[2]
    _store(out, product)


_FEW_ROWS = 16  # a product of this few rows is a pass over its tile: widening the tile is most of its cost


def _numpy_half_product(a: np.ndarray, tile: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    return np.matmul(a, widen_half(tile), out=out)


_half_product = _numpy_half_product


def half_product(a: np.ndarray, tile: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``a @ tile`` in fp32 for fp32 ``a`` of few rows and a 2-D fp16 ``tile`` with adjacent columns (into
    ``out`` where given): the tile's values exactly, its sums in fp32, their order of addition the kernel's.

    numpy widens the tile whole, then multiplies; a kernel that widens each weight in a register does it
    in one pass over the weights (a decode step's products are most of its time): :func:`use_half_product`
    installs one (``lpx_tvm`` installs TVM's when TVM loads)."""
    return _half_product(a, tile, out)


def use_half_product(kernel=None) -> None:
    """Make ``kernel(a, tile, out)`` compute :func:`half_product` (None: numpy's widening and product)."""
    global _half_product
    _half_product = kernel or _numpy_half_product


def _epilogue(outs, ins, attrs):
    out = outs[0]
    if out.dtype in _INT_RANGES:
        acc, bias, requant = ins
        requantize(out, acc.astype(np.int64) + bias, requant, attrs["act"], attrs["zp_out"])
        return
    acc = ins[0]
    if out.dtype == acc.dtype == F32 and out.shape == acc.shape and (out is acc or not np.may_share_memory(out, acc)):
        acc = out  # computed where it is stored: a pass fewer
        if len(ins) >= 2:
            np.add(ins[0], ins[1], out=acc)
        else:
            np.copyto(acc, ins[0])
    else:
        acc = _f32(acc) + (ins[1] if len(ins) >= 2 else F32(0))
    if len(ins) == 3:  # the weights' per-column scale (fp8 weights are stored scaled to their range)
        acc *= ins[2]
    _store(out, apply_epilogue(acc, attrs))


def _qadd(outs, ins, attrs):
    a, b = ins
    total = (F32(attrs["scale_a"]) * (a.astype(F32) - F32(attrs["zp_a"]))
             + F32(attrs["scale_b"]) * (b.astype(F32) - F32(attrs["zp_b"])))
    out = outs[0]
    lo, hi = _INT_RANGES[out.dtype]
    if attrs["act"] == Opcode.RELU:
        lo = max(lo, attrs["zp_out"])
    np.copyto(out, np.clip(np.rint(total / F32(attrs["scale_out"])) + F32(attrs["zp_out"]), lo, hi), casting="unsafe")


def _reduce(kind):
    def run(outs, ins, attrs):
        _store(outs[0], kind(_f32(ins[0]), axis=tuple(attrs["axes"]), keepdims=True))
    return run


def _softmax(outs, ins, attrs):
    axis = attrs["axis"]
    x = _f32(ins[0])
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    e /= e.sum(axis=axis, keepdims=True)
    _store(outs[0], e)


def _layernorm(outs, ins, attrs):
    x = _f32(ins[0])
    axes = tuple(range(x.ndim - attrs["n_axes"], x.ndim))
    mean = x.mean(axis=axes, keepdims=True)
    centered = x - mean
    var = np.mean(np.square(centered), axis=axes, keepdims=True)
    y = centered / np.sqrt(var + F32(attrs["eps"]))
    y *= _f32(ins[1])
    y += _f32(ins[2])
    _store(outs[0], y)


def _window_taps(x, attrs, fill, channels_last=False):
    """Yield ``(i, j, view)``: for each kernel tap, the strided output-sized view of the padded input.

    ``x`` is NCHW (NHWC with ``channels_last``). A pooling or im2col over a k×k
    window is k² vectorised passes over output-sized views, which numpy runs at
    memory speed; reducing a 6-D sliding-window view over its two small trailing
    axes is several times slower.
    """
    (kh, kw), (sh, sw), (dh, dw) = attrs["kernel"], attrs["stride"], attrs["dilation"]
    h_axis = 1 if channels_last else 2
    x, oh, ow = _padded(x, attrs, fill, h_axis)
    lead = (slice(None),) * h_axis
    for i in range(kh):
        for j in range(kw):
            yield i, j, x[lead + (slice(i * dh, i * dh + (oh - 1) * sh + 1, sh),
                                  slice(j * dw, j * dw + (ow - 1) * sw + 1, sw))]


def _padded(x, attrs, fill, h_axis: int) -> tuple:
    """``(x padded by attrs' pad with fill, output height, output width)`` for a window over axes ``h_axis`` and
    the one after it."""
    (kh, kw), (sh, sw), (dh, dw) = attrs["kernel"], attrs["stride"], attrs["dilation"]
    pt, pl, pb, pr = attrs["pad"]
    if pt or pl or pb or pr:
        pads = [(0, 0)] * x.ndim
        pads[h_axis], pads[h_axis + 1] = (pt, pb), (pl, pr)
        x = np.pad(x, pads, constant_values=fill)
    oh = (x.shape[h_axis] - (kh - 1) * dh - 1) // sh + 1
    ow = (x.shape[h_axis + 1] - (kw - 1) * dw - 1) // sw + 1
    return x, oh, ow


def _pool(x, attrs, fill, combine):
    acc = None
    for _, _, view in _window_taps(x, attrs, fill):
        if acc is None:
            acc = view.copy()
        else:
            combine(acc, view, out=acc)
    return acc


def _maxpool(outs, ins, attrs):
    if _window_kernels is not None and _window_kernels[1](ins[0], outs[0], attrs):
        return
    # int8/uint8 values are exact in fp32, so one path serves every dtype
    _store(outs[0], _pool(_f32(ins[0]), attrs, -np.inf, np.maximum))


_window_kernels = None  # (im2col, max_pool) kernels that walk every tap in one call (lpx_tvm installs TVM's)


def use_window_kernels(im2col=None, max_pool=None) -> tuple | None:
    """Make ``im2col(x, out, attrs)`` and ``max_pool(x, out, attrs)`` compute IM2COL and MAXPOOL where they
    can (each returns False, having written nothing, where it cannot); None: numpy's passes, one a tap.
    Returns the pair it replaces (None where there was none)."""
    global _window_kernels
    previous, _window_kernels = _window_kernels, ((im2col, max_pool) if im2col is not None else None)
    return previous


def _avgpool(outs, ins, attrs):
    x = _f32(ins[0])
    total = _pool(x, attrs, 0.0, np.add)
    if attrs["count_include_pad"]:
        total /= F32(attrs["kernel"][0] * attrs["kernel"][1])
    else:
        total /= _pool(np.ones((1, 1) + x.shape[2:], F32), attrs, 0.0, np.add)
    _store(outs[0], total)


def _dwconv(outs, ins, attrs):
    """Depthwise convolution: one multiply-accumulate pass per kernel tap, in fp32 (or an installed kernel's
    one pass, the same sums: :func:`use_depthwise_sums`).

    The taps run channels-last, where each tap's weights broadcast along the
    contiguous axis (about twice as fast in numpy as broadcasting along NCHW's
    channel axis, conversions included).
    """
    quantized = outs[0].dtype in _INT_RANGES
    # int8: (x - zp) * w summed over at most a few hundred taps is exact in fp32 (|sum| < 2**24)
    zero_point = attrs["zp_in"] if quantized else 0
    # (measured on ppocr_rec's: 2-3 times as fast for up to 64 channels, no faster from 128, slower for 240)
    if _depthwise_sums is not None:
        x = _f32(ins[0])
        acc = _depthwise_sums(x - F32(zero_point) if zero_point else x, _f32(ins[1]), attrs)
    elif tuple(attrs["stride"]) == (1, 1) and ins[0].shape[0] * ins[0].shape[1] <= _FLAT_DWCONV_PLANES:
        acc = _dwconv_unit_stride(ins[0], zero_point, _f32(ins[1]), attrs)
    else:
        x, w = _f32(ins[0]) - F32(zero_point), _f32(ins[1])
        acc = _dwconv_channels_last(x, w, attrs)
    if quantized:
        requantize(outs[0], acc + ins[2], ins[3], attrs["act"], attrs["zp_out"])
        return
    if len(ins) == 3:
        acc = acc + _f32(ins[2])
    _store(outs[0], apply_epilogue(acc, attrs))


_depthwise_sums = None  # a kernel that computes the sums in one pass (lpx_tvm installs TVM's when TVM loads)


def use_depthwise_sums(kernel=None) -> None:
    """Make ``kernel(x, w, attrs)`` give a depthwise convolution's fp32 sums, [N, C, OH, OW], from fp32 ``x``
    [N, C, H, W] and ``w`` [C, KH, KW] (None: numpy's passes, one a tap)."""
    global _depthwise_sums
    _depthwise_sums = kernel


_DWCONV_BLOCK = 1 << 15  # fp32 elements of the channels one pass of taps covers: it stays in a core's cache
_DWCONV_BAND = 1 << 16  # fp32 outputs a band of rows of the channels-last path holds (its sum and a product)


def _dwconv_channels_last(x, w, attrs) -> np.ndarray:
    """A depthwise convolution's fp32 sums, [N, C, OH, OW], tap by tap, channels last (each tap's weights
    broadcast along the contiguous axis), a band of output rows at a time so that a band's sum and its
    product stay in cache over the taps (ppocr_rec's 240- and 480-channel 5 × 5: 3.2 → 2.55 ms, the same sums)."""
    (kh, kw), (sh, sw), (dh, dw) = attrs["kernel"], attrs["stride"], attrs["dilation"]
    padded, oh, ow = _padded(x.transpose(0, 2, 3, 1), attrs, 0.0, 1)
    n, c = padded.shape[0], padded.shape[3]
    taps = np.ascontiguousarray(w.transpose(1, 2, 0))  # [kh, kw, C]
    acc = np.empty((n, oh, ow, c), F32)
    rows = max(1, _DWCONV_BAND // (n * ow * c))
    product = np.empty((n, min(rows, oh), ow, c), F32)
    for top in range(0, oh, rows):
        bottom = min(top + rows, oh)
        band, scratch = acc[:, top:bottom], product[:, :bottom - top]
        for i in range(kh):
            for j in range(kw):
                view = padded[:, top * sh + i * dh:(bottom - 1) * sh + i * dh + 1:sh,
                              j * dw:j * dw + (ow - 1) * sw + 1:sw]
                if i == 0 and j == 0:
                    np.multiply(view, taps[i, j], out=band)
                else:
                    np.multiply(view, taps[i, j], out=scratch)
                    band += scratch
    return acc.transpose(0, 3, 1, 2)
_FLAT_DWCONV_PLANES = 128  # images × channels up to which the flat path is the faster


def _dwconv_unit_stride(x, zero_point: int, w, attrs) -> np.ndarray:
    """A stride-1 depthwise convolution's fp32 sums, [N, C, OH, OW], tap by tap in the same order as the
    general path (so the same sums): each channel's padded image lies flat, and a tap's window over every
    output row is then one contiguous run of it (the output computed at the padded width; the columns past
    OW are dropped), a few channels at a time so that the passes stay in cache."""
    (kh, kw), (dh, dw) = attrs["kernel"], attrs["dilation"]
    top, left, bottom, right = attrs["pad"]
    n, c, h, width = x.shape
    padded_h, padded_w = h + top + bottom, width + left + right
    oh, ow = padded_h - (kh - 1) * dh, padded_w - (kw - 1) * dw
    planes, length = n * c, oh * padded_w
    # the last taps' runs reach (kw - 1)·dw elements past the padded image
    flat = np.zeros((planes, padded_h * padded_w + (kw - 1) * dw), F32)
    inner = flat[:, :padded_h * padded_w].reshape(n, c, padded_h, padded_w)[:, :, top:top + h, left:left + width]
    inner[...] = to_f32(x)
    if zero_point:
        inner -= F32(zero_point)
    taps = np.ascontiguousarray(np.broadcast_to(w.reshape(1, c, kh * kw), (n, c, kh * kw))
                                .reshape(planes, kh * kw).T)[:, :, None]  # [tap, plane, 1]
    acc = np.empty((planes, length), F32)
    per_block = max(1, _DWCONV_BLOCK // length)
    scratch = np.empty((min(per_block, planes), length), F32)
    for lo in range(0, planes, per_block):
        hi = min(lo + per_block, planes)
        block, product = acc[lo:hi], scratch[:hi - lo]
        for tap in range(kh * kw):
            i, j = divmod(tap, kw)
            start = i * dh * padded_w + j * dw
            run = flat[lo:hi, start:start + length]
            if tap == 0:
                np.multiply(run, taps[0, lo:hi], out=block)
            else:
                np.multiply(run, taps[tap, lo:hi], out=product)
                block += product
    return acc.reshape(n, c, oh, padded_w)[..., :ow]


def _im2col(outs, ins, attrs):
    """[N, C, H, W] ─► [N, G, C/G·kh·kw, OH·OW] columns, one strided copy per kernel tap.

    Each tap copies the input where its window lies inside it and fills the border strips outside with the
    pad value: the input is not padded first (that copy cost a third of the time).
    """
    x = ins[0]
    if _window_kernels is not None and _window_kernels[0](x, outs[0], attrs):
        return
    (kh, kw), groups = attrs["kernel"], attrs["groups"]
    (sh, sw), (dh, dw) = attrs["stride"], attrs["dilation"]
    top, left, bottom, right = attrs["pad"]
    n, c, h, w = x.shape
    oh = (h + top + bottom - (kh - 1) * dh - 1) // sh + 1
    ow = (w + left + right - (kw - 1) * dw - 1) // sw + 1
    # splitting axes keeps both sides views
    out = outs[0].reshape(n, groups, c // groups, kh, kw, oh, ow)
    x = x.reshape(n, groups, c // groups, h, w)
    fill = attrs["pad_value"]
    for i in range(kh):
        r0, r1, rows = _inside(i * dh - top, sh, oh, h)
        for j in range(kw):
            c0, c1, cols = _inside(j * dw - left, sw, ow, w)
            tap = out[:, :, :, i, j]
            tap[..., r0:r1, c0:c1] = x[..., rows, cols]
            if r0 or c0 or r1 < oh or c1 < ow:
                tap[..., :r0, :] = fill
                tap[..., r1:, :] = fill
                tap[..., r0:r1, :c0] = fill
                tap[..., r0:r1, c1:] = fill


def _inside(offset: int, stride: int, count: int, size: int) -> tuple:
    """The outputs ``[lo, hi)`` of a tap at input ``offset + k·stride`` that fall inside ``[0, size)``, and the
    input slice they read."""
    lo = min(count, max(0, -(offset // stride) if offset < 0 else 0))
    hi = max(lo, min(count, (size - 1 - offset) // stride + 1))
    start = offset + lo * stride
    return lo, hi, slice(start, start + (hi - lo - 1) * stride + 1 if hi > lo else start, stride)


def _transpose(outs, ins, attrs):
    outs[0][...] = ins[0].transpose(attrs["perm"])


def _concat(outs, ins, attrs):
    np.concatenate(ins, axis=attrs["axis"], out=outs[0])


def _slice(outs, ins, attrs):
    out = outs[0]
    index = tuple(slice(b, b + s * n, s) for b, s, n in zip(attrs["begin"], attrs["step"], out.shape))
    out[...] = ins[0][index]


def _host_copy(outs, ins, attrs):
    np.copyto(outs[0], ins[0].reshape(outs[0].shape), casting="unsafe")


SEMANTICS = {
    Opcode.NOP: lambda outs, ins, attrs: None,
    Opcode.LOAD: _host_copy,
    Opcode.STORE: _host_copy,
    Opcode.STREAM: _host_copy,
    Opcode.INSTALL: _install,
    Opcode.MATMUL: _matmul,
    Opcode.EPILOGUE: _epilogue,
    Opcode.QADD: _qadd,
    **{op: _unary(op) for op in UNARY_OPS},
    **{op: _binary(op) for op in BINARY_OPS},
    Opcode.REDUCE_SUM: _reduce(np.sum),
    Opcode.REDUCE_MEAN: _reduce(np.mean),
    Opcode.REDUCE_MAX: _reduce(np.max),
    Opcode.SOFTMAX: _softmax,
    Opcode.LAYERNORM: _layernorm,
    Opcode.MAXPOOL: _maxpool,
    Opcode.AVGPOOL: _avgpool,
    Opcode.TRANSPOSE: _transpose,
    Opcode.IM2COL: _im2col,
    Opcode.QUANTIZE: _quantize,
    Opcode.DEQUANTIZE: _dequantize,
    Opcode.DWCONV: _dwconv,
    Opcode.CONCAT: _concat,
    Opcode.SLICE: _slice,
    # a transfer's data moves between chips: the system simulator carries it (one chip alone has no peer)
    Opcode.SEND: lambda outs, ins, attrs: None,
    Opcode.RECV: lambda outs, ins, attrs: None,
}
assert set(SEMANTICS) == set(OP_TABLE), f"opcodes without semantics: {set(OP_TABLE) - set(SEMANTICS)}"
assert set(UNARY_FUNCS) >= {op for op, spec in OP_TABLE.items() if spec.epilogue}, "epilogues need a function"
