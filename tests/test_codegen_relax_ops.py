"""The TVM side's one table (``codegen/relax_ops.py``): which Relax ops lpx runs, which of their attributes it
refuses and with what reason (the partitioner leaves those calls on the host and reports the reason), the
multi-op idioms' constant checks, and the numpy quantisation helpers."""

import numpy as np
import pytest
import tvm
from tvm import relax

from lpx_tvm.codegen.relax_ops import (RELAX_OPS, RELAX_PATTERNS, LoweringError, axis_params, prim, quantize_array,
                                       shape_of)

BB = relax.BlockBuilder()  # normalises a bare call, giving it its type (some checks read the output shape)


def _t(*shape, dtype="float32"):
    return relax.TensorType(shape, dtype)


X = relax.Var("x", _t(1, 8, 4, 4))
X2 = relax.Var("x2", _t(4, 8))
X5 = relax.Var("x5", _t(1, 8, 4, 4, 4))
W = relax.Var("w", _t(4, 8, 3, 3))
ONES8 = relax.const(np.ones(8, np.float32))
ONES4 = relax.const(np.ones(4, np.float32))


def _why(op, call):
    return RELAX_OPS[op].unsupported(BB.normalize(call))


def test_a_rows_pattern_is_named_lpx_dot_the_op_without_its_nn_prefix():
    assert [RELAX_OPS[op].pattern_name for op in ("add", "nn.relu", "nn.conv2d", "nn.adaptive_avg_pool2d")] == [
        "lpx.add", "lpx.relu", "lpx.conv2d", "lpx.adaptive_avg_pool2d"]


def test_rows_name_their_operand_count_and_which_operands_must_be_weights():
    rows = {op: (RELAX_OPS[op].arity, RELAX_OPS[op].weights) for op in
            ("nn.relu", "add", "clip", "strided_slice", "nn.conv2d", "nn.batch_norm", "nn.layer_norm", "quantize",
             "matmul")}
    assert rows == {"nn.relu": (1, ()), "add": (2, ()), "clip": (3, ()), "strided_slice": (5, ()),
                    "nn.conv2d": (2, (1,)), "nn.batch_norm": (5, (1, 2, 3, 4)), "nn.layer_norm": (3, (1, 2)),
                    "quantize": (3, (1, 2)), "matmul": (2, ())}  # a matmul's B may be an activation (attention)


def test_ops_with_no_row_are_not_offered_and_the_idioms_are_three():
    for op in ("floor", "where", "nn.silu", "nn.conv2d_transpose", "take"):
        assert op not in RELAX_OPS
    assert set(RELAX_PATTERNS) == {"lpx.hard_swish", "lpx.gelu_erf", "lpx.nan_to_num"}


REFUSED = [
    ("nn.conv2d", lambda: relax.op.nn.conv2d(relax.Var("nhwc", _t(1, 4, 4, 8)), relax.Var("ohwi", _t(4, 3, 3, 8)),
                                             data_layout="NHWC", kernel_layout="OHWI"),
     "layout NHWC/OHWI/NHWC is not NCHW/OIHW/NCHW"),
    ("nn.conv2d", lambda: relax.op.nn.conv2d(X, W, out_dtype="float16"), "out_dtype float16"),
    ("matmul", lambda: relax.op.matmul(X2, relax.Var("y", _t(8, 3)), out_dtype="float16"), "out_dtype float16"),
    ("nn.avg_pool2d", lambda: relax.op.nn.avg_pool2d(X, (2, 2), ceil_mode=True), "avg_pool2d with ceil_mode"),
    ("nn.max_pool2d", lambda: relax.op.nn.max_pool2d(X, (2, 2), layout="NHWC"), "layout NHWC"),
    ("nn.adaptive_avg_pool2d", lambda: relax.op.nn.adaptive_avg_pool2d(X, (2, 2)),
     "adaptive_avg_pool2d to more than 1x1"),
    ("nn.avg_pool3d", lambda: relax.op.nn.avg_pool3d(X5, (3, 3, 1), layout="NCDHW"),
     "avg_pool3d other than a window over channels"),
    ("nn.batch_norm", lambda: relax.op.nn.batch_norm(X, ONES8, ONES8, ONES8, ONES8, axis=1, training=True),
     "batch_norm in training mode (it normalises with the batch's own statistics)"),
    ("nn.layer_norm", lambda: relax.op.nn.layer_norm(X2, ONES4, ONES4, axes=[0]), "layer_norm over non-trailing axes"),
    ("strided_slice", lambda: relax.op.strided_slice(X2, axes=[1], begin=[6], end=[0], strides=[-2]),
     "strided_slice with a negative or zero step"),
    ("quantize", lambda: relax.op.quantize(X2, relax.const(np.full(8, 0.5, np.float32)),
                                           relax.const(np.zeros(8, np.int8)), axis=1, out_dtype="int8"),
     "per-channel quantisation of an activation"),
    ("quantize", lambda: relax.op.quantize(X2, relax.Var("s", _t()), relax.const(np.int8(0)), axis=1,
                                           out_dtype="int8"),
     "quantisation parameters that are not constants"),
]


@pytest.mark.parametrize("op, build, reason", REFUSED,
                         ids=[f"{op}:{'_'.join(reason.split()[:4])}" for op, _, reason in REFUSED])
def test_attributes_lpx_does_not_implement_are_refused_with_the_reason(op, build, reason):
    assert _why(op, build()) == reason


ACCEPTED = [
    ("nn.conv2d", lambda: relax.op.nn.conv2d(X, W, padding=(1, 1))),
    ("matmul", lambda: relax.op.matmul(X2, relax.Var("y", _t(8, 3)))),
    ("nn.max_pool2d", lambda: relax.op.nn.max_pool2d(X, (2, 2), ceil_mode=True)),  # only avg refuses ceil_mode
    ("nn.adaptive_avg_pool2d", lambda: relax.op.nn.adaptive_avg_pool2d(X, (1, 1))),
    ("nn.avg_pool3d", lambda: relax.op.nn.avg_pool3d(X5, (3, 1, 1), padding=(1, 0, 0, 1, 0, 0), layout="NCDHW")),
    ("nn.batch_norm", lambda: relax.op.nn.batch_norm(X, ONES8, ONES8, ONES8, ONES8, axis=1, training=False)),
    ("nn.layer_norm", lambda: relax.op.nn.layer_norm(X2, ONES8, ONES8, axes=[-1])),
    ("strided_slice", lambda: relax.op.strided_slice(X2, axes=[1], begin=[0], end=[6], strides=[2])),
    ("quantize", lambda: relax.op.quantize(X2, relax.const(np.float32(0.5)), relax.const(np.int8(0)), axis=1,
                                           out_dtype="int8")),
    ("clip", lambda: relax.op.clip(X2, 0, 6)),
]


@pytest.mark.parametrize("op, build", ACCEPTED, ids=[op for op, _ in ACCEPTED])
def test_the_same_ops_with_attributes_lpx_implements_are_accepted(op, build):
    assert _why(op, build()) is None


def test_prim_reads_int_and_float_immediates_and_scalar_constants_as_python_floats():
    clip = relax.op.clip(X2, 0, 6)  # the bounds are IntImm
    assert [prim(clip.args[1]), prim(clip.args[2]), prim(relax.const(np.float32(0.5)))] == [0.0, 6.0, 0.5]
    assert type(prim(clip.args[2])) is float
    with pytest.raises(LoweringError, match=r"expected a constant scalar, got a constant of shape \[2\]"):
        prim(relax.const(np.ones(2, np.float32)))


def test_a_shape_known_only_at_run_time_cannot_lower():
    n = tvm.tirx.Var("n", "int64")
    assert shape_of(X2) == (4, 8)
    with pytest.raises(LoweringError, match="dynamic shape .* cannot run on lpx"):
        shape_of(relax.Var("d", _t(n, 8)))


def _hard_swish_calls(add_c=3.0, lo=0, hi=6, div_c=6.0):
    add = relax.op.add(X2, relax.const(add_c, "float32"))
    clip = relax.op.clip(add, lo, hi)
    div = relax.op.divide(clip, relax.const(div_c, "float32"))
    return [add, clip, div, relax.op.multiply(X2, div)]


def test_hard_swish_matches_only_with_the_constants_3_0_6_and_6():
    """The pattern says only "a constant"; x · clip(x + 2, 0, 6) / 6 is not a hard swish."""
    match = RELAX_PATTERNS["lpx.hard_swish"].matches
    assert match(_hard_swish_calls()) is True
    assert [match(_hard_swish_calls(add_c=2.0)), match(_hard_swish_calls(hi=5)),
            match(_hard_swish_calls(div_c=3.0))] == [False, False, False]


def test_the_erf_gelu_matches_x_over_root_2_or_x_times_its_reciprocal_and_nothing_else():
    match = RELAX_PATTERNS["lpx.gelu_erf"].matches

    def calls(scaled, half=0.5, one=1.0):  # x · half · (one + erf(scaled)), every call of it
        erf = relax.op.erf(scaled)
        plus = relax.op.add(erf, relax.const(one, "float32"))
        halved = relax.op.multiply(X2, relax.const(half, "float32"))
        return [scaled, erf, plus, halved, relax.op.multiply(halved, plus)]
    by_div = relax.op.divide(X2, relax.const(np.sqrt(2.0), "float32"))
    by_mul = relax.op.multiply(X2, relax.const(1 / np.sqrt(2.0), "float32"))
    assert [match(calls(by_div)), match(calls(by_mul))] == [True, True]
    assert [match(calls(by_div, half=0.25)), match(calls(by_div, one=2.0)),
            match(calls(relax.op.divide(X2, relax.const(2.0, "float32"))))] == [False, False, False]


def test_nan_to_num_matches_a_finite_replacement_only():
    match = RELAX_PATTERNS["lpx.nan_to_num"].matches

    def where(value):
        return [relax.op.where(relax.op.isnan(X2), relax.const(value, "float32"), X2)]
    assert [match(where(0.0)), match(where(-1e4)), match(where(np.inf)), match(where(np.nan))] == [
        True, True, False, False]


def test_quantize_array_is_onnx_quantize_linear_rounding_half_to_even_and_saturating():
    x = np.array([1.25, 1.75, -0.75, 100.0, -100.0], np.float32)
    # / 0.5 = 2.5, 3.5, -1.5, 200, -200; rint (half to even) 2, 4, -2; + zp 3 = 5, 7, 1, 203 ─► 127, -197 ─► -128
    q = quantize_array(x, 0.5, 3, 0, "int8")
    assert q.dtype == np.dtype(np.int8)
    np.testing.assert_array_equal(q, [5, 7, 1, 127, -128])
    # uint8 saturates at 0 and 255 instead: 203 stays, -197 ─► 0
    np.testing.assert_array_equal(quantize_array(x, 0.5, 3, 0, "uint8"), [5, 7, 1, 203, 0])


def test_per_channel_quantisation_scales_along_its_axis():
    x = np.array([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]], np.float32)
    # axis 1: column scales 1, 0.5, 0.25 ─► x / s = [[1, 2, 4], [2, 4, 8]]
    np.testing.assert_array_equal(quantize_array(x, [1.0, 0.5, 0.25], 0, 1, "int8"), [[1, 2, 4], [2, 4, 8]])
    s, z = axis_params(np.zeros((2, 3, 4)), [1.0, 0.5, 0.25], 0, -2)
    assert (s.shape, z.shape, s.dtype) == ((1, 3, 1), (1, 1, 1), np.dtype(np.float32))
    np.testing.assert_array_equal(s.reshape(-1), [1.0, 0.5, 0.25])
