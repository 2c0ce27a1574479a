"""The simulator's host kernel for few fp32 rows times an fp16 tile (``lpx_tvm.kernels.host``), against numpy.

The kernel adds each sum's K products in order, each fused with its addition. numpy has no fused
multiply-add, so the reference works each step in float64: the product of an fp32 and an fp16 is exact
there (24 + 11 significant bits), and so is its sum with an fp32 partial sum of nearby magnitude, so one
rounding to fp32 is the fused step's.
"""

import multiprocessing

import numpy as np
import pytest

import lpx_tvm  # noqa: F401  (registers with TVM, which installs the kernel)
import tvm  # noqa: F401
from lpx_tvm.kernels import host as host_kernels
from lpx_tvm.runtime_sim import semantics


def _in_order(a, tile):
    """Each output's K terms added in order, one rounding to fp32 a step (a fused multiply-add)."""
    weights = tile.astype(np.float64)
    total = np.zeros((len(a), tile.shape[1]), np.float32)
    for k in range(tile.shape[0]):
        total = (total.astype(np.float64) + a[:, k:k + 1].astype(np.float64) * weights[k]).astype(np.float32)
    return total


def _weights(rng, shape, scale=0.02):
    """Normal weights with fp16 subnormals, the smallest negative subnormal and negative zeros among them."""
    tile = (rng.standard_normal(shape) * scale).astype(np.float16)
    tile.flat[::97] = np.float16(3e-6)
    tile.flat[1::89] = -np.float16(6e-8)
    tile.flat[2::83] = np.float16(-0.0)
    return tile


def test_lpx_installs_the_kernels_for_the_simulators_half_products_and_depthwise_convolutions():
    assert semantics._half_product is host_kernels.half_product
    assert semantics._depthwise_sums is host_kernels.depthwise_sums


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("columns, first", [(256, 0), (5000, 3), (7, 1)])
def test_few_rows_times_an_fp16_tile_are_an_in_order_fused_sum_to_the_bit(rows, columns, first):
    """Narrow, wide with a tail of 8 columns past the last whole vector, and narrower than one vector; each
    tile a view that starts ``first`` halves into its rows (not where an allocation starts) and whose rows lie
    farther apart than its width."""
    rng = np.random.default_rng(rows * 7 + columns)
    depth = 300
    rows_of = _weights(rng, (depth, columns + 16))
    tile = rows_of[:, first:first + columns]
    a = rng.standard_normal((rows, depth)).astype(np.float32)
    a[0, 5] = 7e-40  # a subnormal operand
    got = semantics.half_product(a, tile)
    np.testing.assert_array_equal(got.view(np.int32), _in_order(a, tile).view(np.int32))


def test_a_tile_at_an_odd_address_gives_the_same_sums():
    """A view of halves at an odd byte address (as a byte buffer may hold them) has no 64-byte boundary at a
    whole half before it: it is multiplied from a copy, with the same bits."""
    rng = np.random.default_rng(8)
    tile = _weights(rng, (64, 80))
    raw = np.zeros(tile.nbytes + 1, np.uint8)
    odd = raw[1:].view(np.float16).reshape(tile.shape)
    odd[...] = tile
    assert odd.__array_interface__["data"][0] % 2 == 1
    a = rng.standard_normal((2, 64)).astype(np.float32)
    np.testing.assert_array_equal(semantics.half_product(a, odd).view(np.int32), _in_order(a, tile).view(np.int32))


def test_the_kernel_writes_into_a_given_output_aligned_or_not_and_meets_an_inf_and_a_nan_as_numpy_does():
    rng = np.random.default_rng(5)
    tile = rng.integers(-3, 4, (64, 48)).astype(np.float16)  # small integers: every sum exact, in any order
    a = rng.integers(-3, 4, (2, 64)).astype(np.float32)
    a[:, 10] = 0.0
    tile[10, 4] = np.inf  # meets only zeros: NaN, as in numpy
    tile[11, 5] = -np.inf
    tile[12, 6] = np.nan
    with np.errstate(invalid="ignore"):
        want = a @ tile.astype(np.float32)
    assert np.isnan(want[:, 4]).all() and np.isnan(want[:, 6]).all()
    raw = np.full(2 * 48 + 32, 7.0, np.float32)
    aligned = -raw.ctypes.data % 64 // 4
    for start in (aligned, aligned + 1):  # written in place, and through a copy from an aligned buffer
        out = raw[start:start + 96].reshape(2, 48)
        with np.errstate(invalid="ignore"):
            assert semantics.half_product(a, tile, out) is out
        np.testing.assert_array_equal(out, want)


def test_a_tile_the_kernel_cannot_read_is_named():
    a = np.ones((1, 8), np.float32)
    with pytest.raises(ValueError, match="adjacent columns"):
        host_kernels.half_product(a, np.ones((8, 8), np.float16)[:, ::2])
    with pytest.raises(ValueError, match="fp32 rows of 8"):
        host_kernels.half_product(np.ones((1, 9), np.float32), np.ones((8, 8), np.float16))


def test_numpys_own_half_product_is_the_cast_and_product():
    rng = np.random.default_rng(6)
    tile = _weights(rng, (200, 320))
    a = rng.standard_normal((2, 200)).astype(np.float32)
    semantics.use_half_product(None)
    try:
        got = semantics.half_product(a, tile)
    finally:
        semantics.use_half_product(host_kernels.half_product)
    np.testing.assert_array_equal(got, a @ tile.astype(np.float32))


def _product_in_child(a, tile, queue):
    queue.put(semantics.half_product(a, tile))


def test_a_forked_child_runs_the_kernel_its_parent_built():
    """The kernel runs on the calling thread (no thread pool a forked child would lack)."""
    rng = np.random.default_rng(7)
    tile = _weights(rng, (512, 4096))
    a = rng.standard_normal((1, 512)).astype(np.float32)
    want = _in_order(a, tile)
    np.testing.assert_array_equal(semantics.half_product(a, tile), want)
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_product_in_child, args=(a, tile, queue))
    child.start()
    try:
        got = queue.get(timeout=60)
    finally:
        child.join(timeout=5)
        if child.is_alive():
            child.kill()
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("shape, kernel, stride, dilation, pad", [
    ((1, 40, 10, 37), (3, 3), (1, 1), (1, 1), (1, 1, 1, 1)),  # 37 columns: the last vector mostly past them
    ((2, 24, 9, 13), (5, 5), (2, 2), (1, 1), (2, 2, 2, 2)),
    ((1, 16, 16, 20), (3, 3), (1, 2), (2, 2), (0, 1, 2, 0)),  # dilated, pad on two sides only
    ((1, 8, 6, 50), (1, 7), (1, 3), (1, 1), (0, 3, 0, 3)),
])
def test_depthwise_sums_are_numpys_tap_by_tap_to_the_bit(shape, kernel, stride, dilation, pad):
    """Each product rounded, then added, the taps in order row by row of the window: numpy's passes
    (``use_depthwise_sums(None)``), and a float64 sum of the same terms to within fp32's rounding."""
    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal(shape).astype(np.float32)
    w = rng.standard_normal((shape[1], *kernel)).astype(np.float32)
    attrs = {"kernel": kernel, "stride": stride, "dilation": dilation, "pad": pad}
    got = host_kernels.depthwise_sums(x, w, attrs)
    semantics.use_depthwise_sums(None)
    try:
        out = np.empty((shape[0], shape[1], *got.shape[2:]), np.float32)
        semantics._dwconv([out], [x, w], {**attrs, "act": semantics.Opcode.NOP})
    finally:
        semantics.use_depthwise_sums(host_kernels.depthwise_sums)
    np.testing.assert_array_equal(got.view(np.int32), out.view(np.int32))
    (kh, kw), (sh, sw), (dh, dw) = kernel, stride, dilation
    top, left, bottom, right = pad
    padded = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (top, bottom), (left, right)))
    oh, ow = got.shape[2:]
    exact = sum(padded[:, :, i * dh:i * dh + (oh - 1) * sh + 1:sh, j * dw:j * dw + (ow - 1) * sw + 1:sw]
                * w[None, :, i, j, None, None] for i in range(kh) for j in range(kw))
    np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-5)


def _numpy_windows():
    """A context in which IM2COL and MAXPOOL run numpy's passes, one a tap (the definition)."""
    from contextlib import contextmanager

    @contextmanager
    def windows():
        previous = semantics.use_window_kernels(None)
        try:
            yield
        finally:
            semantics.use_window_kernels(*previous)
    return windows()


_WINDOWS = [  # (input shape, kernel, stride, dilation, pad, groups)
    ((1, 64, 6, 56), (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), 1),  # a band of ResNet-50's 3 x 3
    ((1, 3, 19, 224), (7, 7), (2, 2), (1, 1), (3, 3, 3, 3), 1),  # its stem: stride 2, 112 columns
    ((2, 8, 9, 13), (3, 5), (1, 2), (2, 1), (0, 2, 1, 0), 2),  # dilated, grouped, padded on two sides
    ((1, 4, 5, 7), (1, 1), (1, 1), (1, 1), (0, 0, 0, 0), 1),  # fewer columns than a vector holds
]


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int8])
@pytest.mark.parametrize("shape, kernel, stride, dilation, pad, groups", _WINDOWS)
@pytest.mark.slow
def test_im2col_by_the_kernel_is_numpys_to_the_bit(dtype, shape, kernel, stride, dilation, pad, groups):
    """The kernel's columns are numpy's tap-by-tap copy's, the pad value around them included, for every element
    type a program's IM2COL moves; the input a band of rows of a larger array (a view that starts inside it)."""
    from lpx_tvm.kernels import window as window_kernels

    rng = np.random.default_rng(sum(shape))
    whole = (rng.standard_normal((shape[0], shape[1], shape[2] + 3, shape[3])) * 50).astype(dtype)
    x = whole[:, :, 2:2 + shape[2]]
    (kh, kw), (sh, sw), (dh, dw) = kernel, stride, dilation
    top, left, bottom, right = pad
    oh = (shape[2] + top + bottom - (kh - 1) * dh - 1) // sh + 1
    ow = (shape[3] + left + right - (kw - 1) * dw - 1) // sw + 1
    attrs = {"kernel": kernel, "stride": stride, "dilation": dilation, "pad": pad, "groups": groups,
             "pad_value": 3}
    columns = (shape[1] // groups * kh * kw, oh * ow)
    got = np.full((shape[0], groups, *columns), 99, dtype)
    assert window_kernels.im2col(x, got, attrs)
    want = np.full_like(got, 99)
    with _numpy_windows():
        semantics._im2col([want], [x], attrs)
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def test_max_pooling_by_the_kernel_is_numpys_to_the_bit_nans_and_signed_zeros_included():
    """numpy's maximum keeps a NaN and, of two equal values, the second (so -0.0 then 0.0 gives 0.0): the
    kernel takes the taps in numpy's order by the same rule, into a strided band of a larger output."""
    from lpx_tvm.kernels import window as window_kernels

    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 5, 17, 35)).astype(np.float32)
    x[0, 0, ::3, ::2] = np.float32(-0.0)
    x[0, 1, ::2, ::3] = np.float32(0.0)
    x[0, 1, 1::2, ::3] = np.float32(-0.0)
    x[0, 2, 4, 4] = np.nan
    x[0, 3, 6, 6] = -np.inf
    x[0, 4] = -np.inf
    attrs = {"kernel": (3, 3), "stride": (2, 2), "dilation": (1, 1), "pad": (1, 1, 1, 1)}
    whole = np.full((1, 5, 12, 18), 7, np.float32)
    got = whole[:, :, 1:10]
    assert window_kernels.max_pool(x, got, attrs)
    want = np.empty((1, 5, 9, 18), np.float32)
    with _numpy_windows():
        semantics._maxpool([want], [x], attrs)
    np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))
    assert (whole[:, :, 0] == 7).all() and (whole[:, :, 10:] == 7).all(), "nothing written outside the band"


def test_the_window_kernels_decline_what_they_cannot_lay_out():
    """An output whose positions are not adjacent (or an int8 max pool) is left to numpy: the kernel says no
    and writes nothing."""
    from lpx_tvm.kernels import window as window_kernels

    x = np.ones((1, 2, 4, 4), np.float32)
    attrs = {"kernel": (1, 1), "stride": (1, 1), "dilation": (1, 1), "pad": (0, 0, 0, 0), "groups": 1,
             "pad_value": 0}
    out = np.zeros((1, 1, 2, 32), np.float32)[..., ::2]
    assert not window_kernels.im2col(x, out, attrs)
    assert not out.any()
    assert not window_kernels.max_pool(x.astype(np.int8), np.zeros((1, 2, 4, 4), np.int8), attrs)


def test_lpx_installs_the_window_kernels():
    from lpx_tvm.kernels import window as window_kernels

    assert semantics._window_kernels == (window_kernels.im2col, window_kernels.max_pool)
