"""The fast path's elementwise runs as one kernel (``runtime_sim.fusion``, ``lpx_tvm.kernels.fused``).

Each case builds the steps a chain runs (the simulator's own semantics functions, on views shaped as the
fast path binds them), fuses them, and checks that one kernel step replaced them and that it writes
numpy's bits: the steps run one by one are the definition. Specials (NaN, infinities, signed zeros) are
planted where a comparison decides. A NaN is compared as a NaN: LLVM keeps no NaN's sign or payload
through arithmetic (it may write -(a / b) as (-a) / b), so only which results are NaN is numpy's.
"""

import numpy as np
import pytest

import lpx_tvm  # noqa: F401
import tvm  # noqa: F401  (lpx_tvm installs the kernels when TVM loads)
from lpx_tvm.runtime_sim import Opcode, fusion
from lpx_tvm.runtime_sim.semantics import SEMANTICS


def _specials(x: np.ndarray, rng) -> np.ndarray:
    flat = x.reshape(-1)
    for value in (np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0):
        flat[rng.integers(0, flat.size, 7)] = value
    return x


def _assert_bits(got: np.ndarray, want: np.ndarray) -> None:
    """The same bits everywhere but where both are NaN."""
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got.view(np.int32)[~nan], want.view(np.int32)[~nan])


def _step(op, out, ins, **attrs):
    return (SEMANTICS[op], op, [out], list(ins), attrs)


def _epilogue_attrs(act=Opcode.NOP, args=()):
    return {"act": act, "act_args": tuple(args)}


def _run(steps):
    with np.errstate(all="ignore"):  # (specials make NaNs and infinities on purpose)
        for fn, _, outs, ins, attrs in steps:
            fn(outs, ins, attrs)


def _numpy_and_fused(build, inputs):
    """``(arrays by numpy, arrays fused, the fused steps)``: the steps ``build(arrays)`` makes (and their
    ``chained``) run one by one by numpy on copies of ``inputs``, and fused on other copies."""
    numpy_arrays = [a.copy() for a in inputs]
    _run(build(numpy_arrays)[0])
    fused_arrays = [a.copy() for a in inputs]
    fused = fusion.fused(*build(fused_arrays))
    _run(fused)
    return numpy_arrays, fused_arrays, fused


def _check(build, inputs):
    """One kernel step for the steps ``build`` makes, and every byte of every array as numpy's steps leave it."""
    numpy_arrays, fused_arrays, fused = _numpy_and_fused(build, inputs)
    assert len(fused) == 1 and fused[0][0] not in SEMANTICS.values(), "the run became one kernel step"
    for got, want in zip(fused_arrays, numpy_arrays):
        _assert_bits(got, want)


@pytest.mark.parametrize("act, args", [(Opcode.RELU, ()), (Opcode.CLIP, (0.0, 6.0)), (Opcode.CLIP, (-1.5, 2.0)),
                                       (Opcode.LEAKY_RELU, (0.1,)), (Opcode.HARD_SWISH, ()), (Opcode.GELU, ())])
@pytest.mark.parametrize("layout", ["rows", "channels-first"])
def test_a_products_epilogue_bias_and_activation_in_one_pass(act, args, layout, rng):
    """ResNet-50's EPILOGUE: the product's block of a channels-first activation (a band of a wider array, 37
    columns: two vectors and a tail), its bias one per row, the activation, in place; or bert's, rows of
    positions with a bias per column. GELU's erf takes numpy's exp between two kernels."""
    wide = _specials(rng.standard_normal((24, 50)).astype(np.float32) * 4, rng)
    if layout == "rows":
        bias = rng.standard_normal((24, 1)).astype(np.float32)
        bias[3] = -0.0
    else:
        bias = rng.standard_normal((1, 37)).astype(np.float32)

    def build(arrays):
        block = arrays[0][:, 5:42]
        return [_step(Opcode.EPILOGUE, block, [block, arrays[1]], **_epilogue_attrs(act, args))], [None]
    _check(build, [wide, bias])


def test_an_epilogue_with_a_scale_per_column():
    """fp8 weights' EPILOGUE: (sum + bias) * scale, then the activation."""
    rng = np.random.default_rng(4)
    acc = rng.standard_normal((9, 20)).astype(np.float32)
    bias, scale = rng.standard_normal((1, 20)).astype(np.float32), rng.random((1, 20)).astype(np.float32)
    out = np.zeros((9, 20), np.float32)

    def build(arrays):
        return [_step(Opcode.EPILOGUE, arrays[3], arrays[:3], **_epilogue_attrs(Opcode.RELU))], [None]
    _check(build, [acc, bias, scale, out])


def test_a_residual_add_then_relu_in_the_residuals_destination(rng):
    """The residual add's result streams to its ReLU; the chain runs in place in one of the two inputs."""
    x = _specials(rng.standard_normal((2, 16, 4, 19)).astype(np.float32), rng)
    y = _specials(rng.standard_normal((2, 16, 4, 19)).astype(np.float32), rng)

    def build(arrays):
        a, b = arrays
        return [_step(Opcode.ADD, b, [a, b]), _step(Opcode.RELU, b, [b])], [None, 0]
    _check(build, [x, y])


def test_a_hard_swish_written_out_as_six_ops():
    """ppocr_rec's hard-swish, x * clip(x + 3, 0, 6) / 6 as QDQ-free ONNX spells it, plus a residual: six
    steps through a carrier buffer of the chain's own, one pass."""
    rng = np.random.default_rng(6)
    x = _specials((rng.standard_normal((3, 40)) * 5).astype(np.float32), rng)
    three, zero_six = np.float32([[3.0]]), np.float32([[6.0]])
    residual = rng.standard_normal((3, 40)).astype(np.float32)
    carrier, out = np.zeros((3, 40), np.float32), np.zeros((3, 40), np.float32)

    def build(arrays):
        x, three, six, residual, carrier, out = arrays
        return [_step(Opcode.ADD, carrier, [x, three]), _step(Opcode.CLIP, carrier, [carrier], lo=0.0, hi=6.0),
                _step(Opcode.MUL, carrier, [x, carrier]), _step(Opcode.DIV, carrier, [carrier, six]),
                _step(Opcode.MUL, carrier, [carrier, three]), _step(Opcode.ADD, out, [carrier, residual])], \
            [None, 0, 1, 0, 0, 0]
    numpy_arrays, fused_arrays, fused = _numpy_and_fused(build, [x, three, zero_six, residual, carrier, out])
    assert len(fused) == 1 and fused[0][0] not in SEMANTICS.values()
    # the carrier between the steps is never stored: only the destination is compared
    _assert_bits(fused_arrays[5], numpy_arrays[5])


@pytest.mark.parametrize("op", [Opcode.MAXIMUM, Opcode.MINIMUM, Opcode.SUB, Opcode.DIV])
def test_binary_steps_keep_numpys_rules_for_nans_and_signed_zeros(op, rng):
    """Every pair of specials, each order, then a NEG and a SQRT: numpy's maximum and minimum keep a NaN first
    operand and, of two that compare equal, return the second (maximum(-0.0, 0.0) is 0.0)."""
    specials = np.float32([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0, 2.5])
    a = np.repeat(specials, len(specials)).reshape(9, 9)
    b = np.tile(specials, len(specials)).reshape(9, 9)
    out = np.zeros((9, 9), np.float32)

    def build(arrays):
        a, b, out = arrays
        return [_step(op, out, [a, b]), _step(Opcode.NEG, out, [out]), _step(Opcode.SQRT, out, [out])], [None, 0, 0]
    _check(build, [a, b, out])


def test_a_run_reading_what_it_overwrites_elsewhere_stays_numpys():
    """An input that overlaps the destination shifted by a column would be read after the kernel wrote it:
    the run is left to numpy's steps."""
    base = np.arange(40, dtype=np.float32).reshape(4, 10)

    def build(arrays):
        (whole,) = arrays
        out, shifted = whole[:, 1:9], whole[:, 0:8]
        return [_step(Opcode.ADD, out, [shifted, shifted]), _step(Opcode.RELU, out, [out])], [None, 0]
    steps, chained = build([base])
    assert fusion.fused(steps, chained) == steps


def test_a_step_numpy_computes_by_a_library_ends_the_run():
    """EXP's bits are numpy's library's, not IEEE's: ADD + RELU before it fuse, EXP stays numpy's step."""
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((4, 32)).astype(np.float32), rng.standard_normal((4, 32)).astype(np.float32)
    steps = [_step(Opcode.ADD, b, [a, b]), _step(Opcode.RELU, b, [b]), _step(Opcode.EXP, b, [b])]
    fused = fusion.fused(steps, [None, 0, 0])
    assert len(fused) == 2 and fused[1] is steps[2] and fused[0][0] not in SEMANTICS.values()


@pytest.mark.slow
def test_a_long_run_is_split_where_its_expression_would_grow_too_large():
    """Each maximum reads its running value three times, and TVM writes bound values out where they are read:
    twelve in a row would be 3 ** 12 nodes, so the run goes as kernels of a few steps each, the same bits."""
    rng = np.random.default_rng(2)
    x = _specials(rng.standard_normal((5, 33)).astype(np.float32), rng)
    others = [rng.standard_normal((5, 33)).astype(np.float32) for _ in range(12)]

    def build(arrays):
        x, *rest = arrays
        return [_step(Opcode.MAXIMUM, x, [x, r]) for r in rest], [None] + [0] * 11
    numpy_arrays, fused_arrays, fused = _numpy_and_fused(build, [x, *others])
    assert 1 < len(fused) < 12 and not any(step[0] in SEMANTICS.values() for step in fused)
    _assert_bits(fused_arrays[0], numpy_arrays[0])


def test_without_a_kernel_every_step_is_numpys():
    x = np.ones((2, 16), np.float32)
    steps = [_step(Opcode.ADD, x, [x, x]), _step(Opcode.RELU, x, [x])]
    compiler = fusion.use_elementwise_kernels(None)
    try:
        assert fusion.fused(steps, [None, 0]) == steps
    finally:
        fusion.use_elementwise_kernels(compiler)
    assert compiler is not None, "lpx_tvm installs TVM's kernels"
