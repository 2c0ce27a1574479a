"""Every opcode, one single-instruction program per dtype it takes, against a numpy reference.

In the style of tinygrad's ``helper_test_op``: one line per case. The
references are written here from the ops' definitions, never by calling the
simulator's semantics. The last test asserts that every opcode was covered.
"""

import math

import ml_dtypes
import numpy as np
import pytest

from lpx_tvm.runtime_sim import DType, Opcode, Space, TensorRef, load_config
from lpx_tvm.runtime_sim.isa import OP_TABLE
from programs import Layout, ins, program, run_unchecked

TESTED = set()
RNG = np.random.default_rng(7)
FLOATS = [DType.F32, DType.F16, DType.BF16]
TOLERANCE = {DType.F32: 2e-6, DType.F16: 1e-3, DType.BF16: 8e-3, DType.F8: 7e-2}
_erf = np.vectorize(math.erf)


def helper_test_op(opcode, inputs, attrs, reference, out_shape=None, out_dtype=None, tol=None):
    """Run ``opcode`` once on constant ``inputs``; compare its destination with ``reference``."""
    TESTED.add(opcode)
    layout = Layout()
    srcs = [layout.const(x) for x in inputs]
    expected = np.asarray(reference)
    dtype = out_dtype if out_dtype is not None else srcs[0].dtype
    dst = layout.take(out_shape or expected.shape, dtype)
    sim = run_unchecked(program([ins(opcode, srcs, [dst], **attrs)], layout))
    got = sim.read(dst).astype(np.float64)
    want = expected.astype(dtype.np).astype(np.float64)
    if tol is None and dtype.is_float:
        tol = TOLERANCE[dtype]
    if tol is None:
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(1.0, float(np.abs(want).max())))


def floats(shape, dtype, low=-3.0, high=3.0):
    return RNG.uniform(low, high, shape).astype(np.float32).astype(dtype.np)


def f64(x):
    return np.asarray(x).astype(np.float64)


UNARY = {
    "COPY": (lambda x: x, {}), "RELU": (lambda x: np.maximum(x, 0), {}),
    "CLIP": (lambda x: np.clip(x, -1.5, 0.5), {"lo": -1.5, "hi": 0.5}),
    "GELU": (lambda x: 0.5 * x * (1 + _erf(x / math.sqrt(2))), {}), "EXP": (np.exp, {}), "ERF": (_erf, {}),
    "TANH": (np.tanh, {}), "SIGMOID": (lambda x: 1 / (1 + np.exp(-x)), {}),
    "SQRT": (lambda x: np.sqrt(np.abs(x)), {}), "RSQRT": (lambda x: 1 / np.sqrt(np.abs(x) + 0.5), {}),
    "NEG": (np.negative, {}), "LEAKY_RELU": (lambda x: np.where(x >= 0, x, 0.2 * x), {"alpha": 0.2}),
    "HARD_SWISH": (lambda x: x * np.clip(x + 3, 0, 6) / 6, {}), "SIN": (np.sin, {}), "COS": (np.cos, {}),
}


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.short)
@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary(name, dtype):
    fn, attrs = UNARY[name]
    x = floats((3, 37), dtype)
    if name in ("SQRT", "RSQRT"):  # their references take |x| (+0.5); feed the same
        x = (np.abs(x.astype(np.float32)) + (0.5 if name == "RSQRT" else 0)).astype(dtype.np)
        fn = np.sqrt if name == "SQRT" else (lambda v: 1 / np.sqrt(v))
    helper_test_op(Opcode[name], [x], attrs, fn(f64(x)))


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.short)
@pytest.mark.parametrize("name", ["NAN_TO_NUM"])
def test_nan_to_num_replaces_only_the_nans(name, dtype):
    x = floats((3, 37), dtype)
    x[1, ::3] = np.nan
    helper_test_op(Opcode[name], [x], {"value": 0.25}, np.where(np.isnan(f64(x)), 0.25, f64(x)))


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.short)
def test_nan_select_takes_the_value_where_a_is_nan_and_b_elsewhere(dtype):
    a, b = floats((3, 37), dtype), floats((3, 37), dtype)
    a[1, ::3] = np.nan
    b[2, ::5] = np.nan  # b's own NaNs pass through: only a is tested
    helper_test_op(Opcode.NAN_SELECT, [a, b], {"value": -0.5}, np.where(np.isnan(f64(a)), -0.5, f64(b)))


def test_cast_between_every_float_type_and_fp8():
    x = floats((4, 9), DType.F32)
    for dtype in FLOATS + [DType.F8]:
        helper_test_op(Opcode.CAST, [x], {}, x.astype(dtype.np), out_dtype=dtype, tol=0)
    helper_test_op(Opcode.RELU, [x.astype(ml_dtypes.float8_e4m3fn)], {}, np.maximum(f64(x.astype(ml_dtypes.float8_e4m3fn)), 0))
    big = np.array([[1000.0, -1e6, 447.0, np.nan]], np.float32)  # e4m3's largest is 448 and it has no inf
    helper_test_op(Opcode.CAST, [big], {}, np.array([[448.0, -448.0, 448.0, np.nan]]), out_dtype=DType.F8, tol=0)


BINARY = {"ADD": np.add, "SUB": np.subtract, "MUL": np.multiply, "DIV": np.divide, "MAXIMUM": np.maximum,
          "MINIMUM": np.minimum, "POW": np.power}


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.short)
@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_with_broadcasting(name, dtype):
    a = floats((2, 5, 6), dtype, 0.5, 2.0)
    b = floats((5, 1), dtype, 0.5, 2.0)  # broadcast along the last axis, as numpy does
    helper_test_op(Opcode[name], [a, b], {}, BINARY[name](f64(a), f64(b)))


@pytest.mark.parametrize("dtype", [DType.I8, DType.U8], ids=lambda d: d.short)
def test_quantize_and_dequantize(dtype):
    lo, hi = dtype.int_range
    x = floats((4, 33), DType.F32, -6, 6)
    zp = 3 if dtype == DType.I8 else 128
    q = np.clip(np.rint(f64(x) / 0.05) + zp, lo, hi)  # ONNX QuantizeLinear, round half to even
    helper_test_op(Opcode.QUANTIZE, [x], {"scale": 0.05, "zero_point": zp}, q, out_dtype=dtype)
    ints = RNG.integers(lo, hi + 1, (4, 33)).astype(dtype.np)
    helper_test_op(Opcode.DEQUANTIZE, [ints], {"scale": 0.05, "zero_point": zp}, (f64(ints) - zp) * 0.05,
                   out_dtype=DType.F32)


@pytest.mark.parametrize("dtype", [DType.I8, DType.U8], ids=lambda d: d.short)
def test_qadd_is_qlinearadd(dtype):
    lo, hi = dtype.int_range
    a, b = (RNG.integers(lo, hi + 1, (3, 40)).astype(dtype.np) for _ in range(2))
    attrs = {"scale_a": 0.1, "zp_a": 2, "scale_b": 0.07, "zp_b": -1 if dtype == DType.I8 else 9, "scale_out": 0.12,
             "zp_out": 5}
    f32 = np.float32  # QLinearAdd computes in fp32: the rounding of ties depends on it
    total = (f32(0.1) * (a.astype(f32) - f32(2)) + f32(0.07) * (b.astype(f32) - f32(attrs["zp_b"]))) / f32(0.12)
    helper_test_op(Opcode.QADD, [a, b], attrs, np.clip(np.rint(total) + 5, lo, hi), tol=None)
    relu = np.clip(np.rint(total) + 5, max(lo, 5), hi)
    helper_test_op(Opcode.QADD, [a, b], {**attrs, "act": Opcode.RELU}, relu)


@pytest.mark.parametrize("name, fn", [("REDUCE_SUM", np.sum), ("REDUCE_MEAN", np.mean), ("REDUCE_MAX", np.max)])
def test_reduce(name, fn):
    x = floats((2, 6, 7), DType.F32)
    helper_test_op(Opcode[name], [x], {"axes": (0, 2)}, fn(f64(x), axis=(0, 2), keepdims=True))


def test_softmax_and_layernorm():
    x = floats((3, 10), DType.F32)
    e = np.exp(f64(x) - f64(x).max(axis=1, keepdims=True))
    helper_test_op(Opcode.SOFTMAX, [x], {"axis": 1}, e / e.sum(axis=1, keepdims=True))
    gamma, beta = floats((10,), DType.F32), floats((10,), DType.F32)
    mean = f64(x).mean(axis=1, keepdims=True)
    var = ((f64(x) - mean) ** 2).mean(axis=1, keepdims=True)
    helper_test_op(Opcode.LAYERNORM, [x, gamma, beta], {"eps": 1e-3, "n_axes": 1},
                   (f64(x) - mean) / np.sqrt(var + 1e-3) * gamma + beta, tol=1e-5)


def _windows(x, k, s, pad, fill):
    """Reference pooling windows: [N, C, OH, OW, k*k] of a padded NCHW array (loops, not strides)."""
    n, c, h, w = x.shape
    padded = np.full((n, c, h + pad[0] + pad[2], w + pad[1] + pad[3]), fill, np.float64)
    padded[:, :, pad[0]:pad[0] + h, pad[1]:pad[1] + w] = x
    oh, ow = (padded.shape[2] - k) // s + 1, (padded.shape[3] - k) // s + 1
    out = np.empty((n, c, oh, ow, k * k))
    for i in range(oh):
        for j in range(ow):
            out[:, :, i, j] = padded[:, :, i * s:i * s + k, j * s:j * s + k].reshape(n, c, -1)
    return out


def test_pooling():
    x = floats((1, 3, 7, 8), DType.F32)
    win = {"kernel": (3, 3), "stride": (2, 2), "pad": (1, 1, 1, 1)}
    helper_test_op(Opcode.MAXPOOL, [x], win, _windows(f64(x), 3, 2, (1, 1, 1, 1), -np.inf).max(axis=-1))
    q = RNG.integers(-128, 128, (1, 3, 7, 8)).astype(np.int8)
    helper_test_op(Opcode.MAXPOOL, [q], win, _windows(f64(q), 3, 2, (1, 1, 1, 1), -np.inf).max(axis=-1))
    total = _windows(f64(x), 3, 2, (1, 1, 1, 1), 0.0).sum(axis=-1)
    helper_test_op(Opcode.AVGPOOL, [x], {**win, "count_include_pad": True}, total / 9)
    counts = _windows(np.ones((1, 1, 7, 8)), 3, 2, (1, 1, 1, 1), 0.0).sum(axis=-1)
    helper_test_op(Opcode.AVGPOOL, [x], win, total / counts)


def test_depthwise_conv_float_and_int8():
    x = floats((1, 4, 6, 5), DType.F32)
    w, bias = floats((4, 3, 3), DType.F32), floats((4, 1, 1), DType.F32)
    win = {"kernel": (3, 3), "stride": (1, 1), "pad": (1, 1, 1, 1)}
    taps = _windows(f64(x), 3, 1, (1, 1, 1, 1), 0.0)  # [1, 4, 6, 5, 9]
    conv = (taps * f64(w).reshape(1, 4, 1, 1, 9)).sum(axis=-1) + f64(bias)
    helper_test_op(Opcode.DWCONV, [x, w, bias], {**win, "act": Opcode.RELU}, np.maximum(conv, 0))
    xq = RNG.integers(-128, 128, (1, 4, 6, 5)).astype(np.int8)
    wq = RNG.integers(-20, 20, (4, 3, 3)).astype(np.int8)
    bq = RNG.integers(-500, 500, (4, 1, 1)).astype(np.int32)
    rq = np.full((4, 1, 1), 0.003, np.float32)
    acc = (_windows(f64(xq) - 3, 3, 1, (1, 1, 1, 1), 0.0) * f64(wq).reshape(1, 4, 1, 1, 9)).sum(-1) + bq
    want = np.clip(np.rint((acc.astype(np.float32) * rq).astype(np.float64)) - 7, -128, 127)
    helper_test_op(Opcode.DWCONV, [xq, wq, bq, rq], {**win, "zp_in": 3, "zp_out": -7}, want)


@pytest.mark.parametrize("k, stride, pad", [(5, 1, (2, 0, 1, 3)), (3, 2, (1, 1, 1, 1)), (3, 2, (0, 1, 2, 0))])
def test_depthwise_conv_strides_and_uneven_pads(k, stride, pad):
    """A stride-1 window and a stride-2 one (their sums are made two ways), with pads unequal on each side."""
    x = floats((2, 3, 9, 7), DType.F32)
    w, bias = floats((3, k, k), DType.F32), floats((3, 1, 1), DType.F32)
    taps = _windows(f64(x), k, stride, pad, 0.0)
    conv = (taps * f64(w).reshape(1, 3, 1, 1, k * k)).sum(axis=-1) + f64(bias)
    helper_test_op(Opcode.DWCONV, [x, w, bias], {"kernel": (k, k), "stride": (stride, stride), "pad": pad}, conv)


@pytest.mark.parametrize("shape, stride", [((1, 300, 10, 40), 1), ((1, 200, 60, 40), 2)])
def test_depthwise_conv_of_many_channels_goes_in_bands_and_adds_its_taps_in_order(shape, stride):
    """More channels than the flat path takes, and so many outputs that they go in two bands of rows: the
    sums are fp32's adding the taps one after the other, row by row of the kernel, to the bit."""
    k, pad = 3, (1, 1, 1, 1)
    x = floats(shape, DType.F32)
    w = floats((shape[1], k, k), DType.F32)
    taps = _windows(x.astype(np.float32), k, stride, pad, 0.0).astype(np.float32)  # exact: each is an input
    want = taps[..., 0] * w.reshape(1, shape[1], 1, 1, k * k)[..., 0]
    for t in range(1, k * k):
        want = want + taps[..., t] * w.reshape(1, shape[1], 1, 1, k * k)[..., t]
    helper_test_op(Opcode.DWCONV, [x, w], {"kernel": (k, k), "stride": (stride, stride), "pad": pad}, want, tol=0.0)


def test_im2col_fills_the_pad_where_a_tap_falls_outside_the_image():
    """Stride 2, two rows of pad above and three below a 3×3 window, none on the left and one on the right:
    some taps of the first and last output rows read only pad."""
    image = RNG.integers(-9, 9, (1, 2, 5, 4)).astype(np.int8)
    pad = (2, 0, 3, 1)
    windows = _windows(f64(image), 3, 2, pad, -5.0)[0]  # [2, OH = 4, OW = 2, 9]
    cols = windows.reshape(2, 8, 9).transpose(0, 2, 1).reshape(1, 1, 18, 8)
    helper_test_op(Opcode.IM2COL, [image], {"kernel": (3, 3), "stride": (2, 2), "pad": pad, "pad_value": -5}, cols)

def test_switch_ops():
    x = floats((2, 3, 4), DType.F32)
    helper_test_op(Opcode.TRANSPOSE, [x], {"perm": (2, 0, 1)}, f64(x).transpose(2, 0, 1))
    y = floats((2, 1, 4), DType.F32)
    helper_test_op(Opcode.CONCAT, [x, y], {"axis": 1}, np.concatenate([f64(x), f64(y)], axis=1))
    helper_test_op(Opcode.SLICE, [x], {"begin": (1, 0, 1), "step": (1, 2, 2)}, f64(x)[1:2, 0:3:2, 1:4:2],
                   out_shape=(1, 2, 2))
    image = RNG.integers(-9, 9, (1, 2, 4, 5)).astype(np.int8)
    cols = np.stack([_windows(f64(image), 3, 1, (1, 1, 1, 1), 4.0)[0, c].reshape(20, 9).T for c in range(2)])
    helper_test_op(Opcode.IM2COL, [image], {"kernel": (3, 3), "pad": (1, 1, 1, 1), "pad_value": 4},
                   cols.reshape(1, 1, 18, 20))


@pytest.mark.parametrize("dtype", FLOATS + [DType.I8, DType.U8], ids=lambda d: d.short)
def test_install_then_matmul_accumulates_in_fp32_or_int32(dtype):
    TESTED.update({Opcode.INSTALL, Opcode.MATMUL})
    layout = Layout()
    if dtype.is_float:
        a, w, acc = floats((5, 16), dtype), floats((16, 12), dtype), floats((5, 12), DType.F32)
        zp_a = zp_b = 0
        want = f64(acc) + f64(a) @ f64(w)
    else:
        lo, hi = dtype.int_range
        a, w = RNG.integers(lo, hi + 1, (5, 16)).astype(dtype.np), RNG.integers(-128, 128, (16, 12)).astype(np.int8)
        acc = RNG.integers(-1000, 1000, (5, 12)).astype(np.int32)
        zp_a, zp_b = (4 if dtype == DType.I8 else 130), -2
        want = f64(acc) + (f64(a) - zp_a) @ (f64(w) - zp_b)
    ra, rw, racc = layout.const(a), layout.const(w), layout.const(acc)
    out = layout.take((5, 12), racc.dtype)
    prog = program([ins("INSTALL", [rw], [], buffer=1), ins("MATMUL", [ra, racc], [out], cycle=100, buffer=1,
                                                           zp_a=zp_a, zp_b=zp_b)], layout)
    got = run_unchecked(prog).read(out)
    if dtype.is_float:  # fp32 sums of the dtype's products: a few fp32 ulps of the largest term
        np.testing.assert_allclose(f64(got), want, atol=1e-5 * float(np.abs(want).max()))
    else:  # int32 sums are exact
        np.testing.assert_array_equal(f64(got), want)


def test_epilogue_float_and_int8():
    acc, bias = floats((4, 6), DType.F32), floats((1, 6), DType.F32)
    helper_test_op(Opcode.EPILOGUE, [acc, bias], {"act": Opcode.CLIP, "act_args": (-0.5, 1.0)},
                   np.clip(f64(acc) + f64(bias), -0.5, 1.0), out_dtype=DType.F16)
    acc32 = RNG.integers(-20000, 20000, (4, 6)).astype(np.int32)
    bias32 = RNG.integers(-300, 300, (4, 1)).astype(np.int32)
    requant = RNG.uniform(0.001, 0.01, (4, 1)).astype(np.float32)
    scaled = ((acc32 + bias32).astype(np.float32) * requant).astype(np.float64)  # QLinearConv: fp32 product
    helper_test_op(Opcode.EPILOGUE, [acc32, bias32, requant], {"zp_out": 10, "act": Opcode.RELU},
                   np.clip(np.rint(scaled) + 10, 10, 255), out_dtype=DType.U8)
    scale = RNG.uniform(1e-4, 1e-3, (1, 6)).astype(np.float32)  # fp8 weights stored scaled: the scale comes back
    helper_test_op(Opcode.EPILOGUE, [acc, bias, scale], {"act": Opcode.RELU},
                   np.maximum((f64(acc) + f64(bias)) * f64(scale), 0), out_dtype=DType.F16)


def test_host_transfers_and_nop():
    TESTED.update({Opcode.LOAD, Opcode.STORE, Opcode.STREAM, Opcode.NOP})
    from lpx_tvm.runtime_sim import StreamedWeight
    from lpx_tvm.runtime_sim.isa import HostTensor

    layout = Layout()
    x = floats((6, 8), DType.F32)
    weight = floats((3, 8), DType.F32)
    part = layout.take((2, 8), DType.F32)  # a LOAD of rows 3..4 only, by byte offset
    copy = layout.take((3, 8), DType.F32)
    prog = program([ins("LOAD", [], [part], index=0, offset=3 * 8 * 4),
                    ins("LOAD", [], [layout.take((6, 8), DType.F32)], cycle=50, index=0),
                    ins("STREAM", [], [copy], cycle=100, index=0), ins("NOP", cycle=200, cycles=5),
                    ins("STORE", [copy], [], cycle=300, index=0)], layout, inputs=[((6, 8), DType.F32)],
                   outputs=[((3, 8), DType.F32)],
                   streamed=[StreamedWeight(HostTensor((3, 8), DType.F32), weight.reshape(-1).view(np.uint8))])
    from lpx_tvm.runtime_sim import Simulator

    sim = Simulator(prog, check_schedule=False)
    (out,) = sim.run([x])
    np.testing.assert_array_equal(sim.read(part), x[3:5])
    np.testing.assert_array_equal(out, weight)


def test_chained_stream_carries_a_result_to_its_consumer():
    layout = Layout()
    a, w = floats((3, 8), DType.F32), floats((8, 4), DType.F32)
    ra, rw = layout.const(a), layout.const(w)
    chain = TensorRef(5, (3, 4), DType.F32, None, Space.STREAM)
    out = layout.take((3, 4), DType.F32)
    prog = program([ins("INSTALL", [rw], []), ins("MATMUL", [ra], [chain], cycle=50),
                    ins("EPILOGUE", [chain], [out], cycle=80, act=Opcode.RELU)], layout)
    want = np.maximum(f64(a) @ f64(w), 0)
    # fp32 sums of 8 products against float64's: within a few fp32 ulps of the largest term, whatever the
    # draw (the module's generator draws differently in another test order)
    np.testing.assert_allclose(run_unchecked(prog).read(out), want, rtol=1e-6,
                               atol=1e-6 * float(np.abs(f64(a)).max() * np.abs(f64(w)).max() * 8))


def test_send_and_recv_move_a_tensor_between_two_chips():
    """SEND and RECV only mean something as a pair, on a system: the RECV's SRAM holds exactly what was sent."""
    from programs import system_program
    from lpx_tvm.runtime_sim.system_sim import SystemSimulator

    TESTED.update({Opcode.SEND, Opcode.RECV})
    for dtype in (DType.F32, DType.F16, DType.I8):
        value = floats((3, 40), dtype) if dtype.is_float else RNG.integers(-128, 128, (3, 40)).astype(np.int8)
        sender, receiver = Layout(), Layout()
        x = sender.const(value)
        y = receiver.take(value.shape, dtype)
        send = ins("SEND", [x], [], peer=1, tag=3)
        recv = ins("RECV", [], [y], cycle=load_config("tiny").latency_cycles["C2C"], peer=0, tag=3)
        sim = SystemSimulator(system_program("tiny-2", {0: program([send], sender), 1: program([recv], receiver)}),
                              check_schedule=False)
        sim.run([])
        np.testing.assert_array_equal(sim.sims[1].read(y), value)


def _opcodes_under_test() -> set:
    """Every opcode a test in this file runs: the first argument of each ``helper_test_op`` call, and each
    opcode a test adds to ``TESTED`` itself. Read from the source, so it holds whichever tests ran first."""
    import ast

    found = set()
    for func in ast.parse(open(__file__).read()).body:
        if not (isinstance(func, ast.FunctionDef) and func.name.startswith("test_")):
            continue
        for node in ast.walk(func):
            if not isinstance(node, ast.Call):
                continue
            callee = node.func
            named = callee.id if isinstance(callee, ast.Name) else callee.attr if isinstance(callee, ast.Attribute) else ""
            args = node.args[:1] if named == "helper_test_op" else node.args if named in ("add", "update") else []
            for arg in args:
                for leaf in ast.walk(arg):
                    if isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name) and leaf.value.id == "Opcode":
                        found.add(Opcode[leaf.attr])
                    elif isinstance(leaf, ast.Subscript) and isinstance(leaf.value, ast.Name) and leaf.value.id == "Opcode":
                        found |= {Opcode[name] for name in _parametrized_names(func)}  # Opcode[name]
    return found


def _parametrized_names(func) -> set:
    """The values a test's ``name`` parameter takes, from its parametrize decorator (evaluated here)."""
    import ast

    for deco in func.decorator_list:
        if isinstance(deco, ast.Call) and deco.args and isinstance(deco.args[0], ast.Constant) \
                and deco.args[0].value.split(",")[0].strip() == "name":
            values = eval(compile(ast.Expression(deco.args[1]), __file__, "eval"), globals())
            return {v[0] if isinstance(v, tuple) else v for v in values}
    return set()


def test_every_opcode_is_tested():
    covered = _opcodes_under_test()
    assert covered == set(Opcode), f"untested opcodes: {sorted(op.name for op in set(Opcode) - covered)}"
    assert set(OP_TABLE) == set(Opcode)


def test_a_1d_convolution_runs_on_lpx_as_a_2d_one_over_one_row(rng):
    """Conv over [1, 4, 32] with an [8, 4, 3] kernel, stride 2, padding 1 (Whisper's front end has two): one
    program, nothing on the host, ONNX Runtime's numbers; its FLOPs are 2 · 8·16 outputs · 4·3 taps plus the
    ReLU's 8·16."""
    from onnx import helper

    import lpx_tvm
    from conftest import make_model, ort_run, run_on_lpx, tensor_info, weights

    model = make_model([helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1], strides=[2]),
                        helper.make_node("Relu", ["c"], ["y"])],
                       [tensor_info("x", [1, 4, 32])], [tensor_info("y", [1, 8, 16])],
                       [weights(rng, "w", (8, 4, 3)), weights(rng, "b", (8,))])
    compiled = lpx_tvm.compile(model, config="tiny")
    x = rng.standard_normal((1, 4, 32)).astype(np.float32)
    (out,) = run_on_lpx(compiled, [x], programs=1)
    np.testing.assert_allclose(out, ort_run(model, {"x": x})[0], rtol=1e-5, atol=1e-5)
    assert compiled.report.flops_host == 0
    assert compiled.report.flops_offloaded == 2 * 8 * 16 * 4 * 3 + 8 * 16 + 8 * 16  # the conv, its bias, the ReLU


def test_torch_s_safe_softmax_runs_on_lpx_and_zeroes_a_row_with_no_finite_score(rng):
    """softmax, then where(isnan(·), 0, ·), as torch.export writes every attention softmax: one program, no
    host op; a row of -inf gives ONNX Runtime's zeros, the other rows its softmax."""
    from onnx import TensorProto, helper

    import lpx_tvm
    from conftest import make_model, ort_run, run_on_lpx, tensor_info

    zero = helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])
    model = make_model([helper.make_node("Softmax", ["x"], ["s"], axis=-1), helper.make_node("IsNaN", ["s"], ["n"]),
                        helper.make_node("Where", ["n", "zero", "s"], ["y"])],
                       [tensor_info("x", [4, 16])], [tensor_info("y", [4, 16])], [zero])
    compiled = lpx_tvm.compile(model, config="tiny")
    x = rng.standard_normal((4, 16)).astype(np.float32)
    x[2] = -np.inf
    (out,) = run_on_lpx(compiled, [x], programs=1)
    want = ort_run(model, {"x": x})[0]
    np.testing.assert_array_equal(out[2], np.zeros(16, np.float32))
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-7)


def test_expand_runs_on_lpx_as_one_copy_that_repeats_its_input(rng):
    """Expand [1, 2, 1, 4, 8] ─► [1, 2, 3, 4, 8] (GQA's K/V heads for three query heads each) is one COPY
    whose source view has stride 0 on the repeated axis; then a multiply; ONNX Runtime's numbers."""
    from onnx import TensorProto, helper

    import lpx_tvm
    from conftest import make_model, ort_run, run_on_lpx, tensor_info
    from lpx_tvm.runtime_sim import decode

    shape = helper.make_tensor("shape", TensorProto.INT64, [5], [1, 2, 3, 4, 8])
    model = make_model([helper.make_node("Expand", ["x", "shape"], ["e"]), helper.make_node("Mul", ["e", "y"], ["z"])],
                       [tensor_info("x", [1, 2, 1, 4, 8]), tensor_info("y", [1, 2, 3, 4, 8])],
                       [tensor_info("z", [1, 2, 3, 4, 8])], [shape])
    compiled = lpx_tvm.compile(model, config="tiny")
    x = rng.standard_normal((1, 2, 1, 4, 8)).astype(np.float32)
    y = rng.standard_normal((1, 2, 3, 4, 8)).astype(np.float32)
    (out,) = run_on_lpx(compiled, [x, y], programs=1)
    np.testing.assert_array_equal(out, ort_run(model, {"x": x, "y": y})[0])
    (program,) = (decode(blob) for blob in compiled.programs.values())
    (copy,) = [i for i in program.instructions if i.opcode == Opcode.COPY]
    assert copy.srcs[0].strides == (2 * 4 * 8, 4 * 8, 0, 8, 1)
