"""Kernels the simulator runs on the host, compiled by TVM for this CPU.

The simulator's semantics are numpy (:mod:`lpx_tvm.runtime_sim.semantics`, which needs no TVM). One of its
products numpy does badly: a few fp32 rows times an fp16 weight tile, a decode step's every product. numpy
has no fp16 arithmetic, so it widens the tile (a pass writing twice its bytes) before a BLAS pass reads the
widened copy back. TVM compiles the product as one pass: each weight is widened in a register (``vcvtph2ps``)
and multiplied into its column's fp32 sum at once, the K terms added in order with a fused multiply-add
(a 2048 x 8192 tile in cache, one row: 1.7 ms, 20 GB/s of weights on one core, against 7.4 ms for numpy's
passes; a llama-1b decode step's 2 GB of weights from memory: 6.6 GB/s, where numpy sums them at 5).

One kernel per tile width serves every number of rows, of K rows and row stride; it is built at its first
use (about 30 ms) and runs on the calling thread: no thread pool, so a forked child, or several threads
at once, may call it. The other kernel is a depthwise convolution's: numpy makes a pass over the output for
each tap, the kernel one pass (ppocr_rec's 5 x 5 on 240 channels, 8 x 80: 0.52 ms against 1.74).
"""

from __future__ import annotations

import math
import threading

import numpy as np

_ALIGN = 64  # TVM assumes a buffer's first byte at a multiple of 64 (its vector loads and stores do)
_COLUMN_BLOCK = 256  # each weight row's columns are taken this many at a time: their sums stay in L1
_LANES = 16  # fp32 lanes of an AVX-512 register
_kernels: dict = {}  # (builder, its arguments) -> the compiled kernel
_lock = threading.Lock()


def _build(columns: int):
    """``main(a, w, first_column, out)``: ``out[m, n] = sum_k a[m, k] * float32(w[k, first_column + n])``
    for the ``columns`` n, rows ``m`` and ``k`` and the row stride of ``w`` taken from the arrays."""
    import tvm
    import tvm.tirx
    from tvm import s_tir, te

    rows, depth, stride = te.var("rows", "int64"), te.var("depth", "int64"), te.var("stride", "int64")
    first = te.var("first_column", "int64")
    a = te.placeholder((rows, depth), "float32", name="a")
    w = te.placeholder((depth, stride), "float16", name="w")
    k = te.reduce_axis((0, depth), name="k")
    out = te.compute((rows, columns), lambda m, n: te.sum(a[m, k] * w[k, first + n].astype("float32"), axis=k),
                     name="out")
    schedule = s_tir.Schedule(te.create_prim_func([a, w, first, out]).with_attr("global_symbol", "main"))
    block = schedule.get_sblock("out")
    m, n, k = schedule.get_loops(block)
    # the widest block of whole vectors, at most _COLUMN_BLOCK, that the columns divide into
    block_columns = next((b for b in range(_COLUMN_BLOCK, 0, -_LANES) if columns % b == 0), columns)
    outer, inner = schedule.split(n, [None, block_columns])
    schedule.reorder(outer, k, m, inner)  # a block's sums stay in L1 while the weights stream past them
    if block_columns % _LANES == 0:
        schedule.vectorize(schedule.split(inner, [None, _LANES])[1])
    schedule.decompose_reduction(block, k)
    return tvm.tirx.build(schedule.mod, target=_target(fused=True))["main"]


def _target(fused: bool):
    """This CPU, fusing a multiplication with the addition after it (one rounding) or not."""
    import tvm
    from tvm.target import codegen

    options = {} if fused else {"mattr": ["-fma"]}  # (TVM lets LLVM fuse wherever the CPU can)
    return tvm.target.Target({"kind": "llvm", "mcpu": codegen.llvm_get_system_cpu(), **options})


def _compiled(build, *key):
    """``build(*key)``, compiled once a process."""
    with _lock:
        if (build, key) not in _kernels:
            _kernels[build, key] = build(*key)
        return _kernels[build, key]


class _Interface:
    """An array described by ``__array_interface__`` alone: a view that starts where no ndarray does."""

    def __init__(self, interface: dict):
        self.__array_interface__ = interface


def _aligned_rows(tile: np.ndarray):
    """``(view, first_column)``: the rows of the 2-D fp16 ``tile`` (unit column stride) from the multiple of 64
    bytes at or before its first element, as wide as its row stride; the tile is ``view[:, first_column:]``.
    The bytes before the tile are never read."""
    pointer = tile.__array_interface__["data"][0]
    back = pointer % _ALIGN
    view = np.asarray(_Interface({"data": (pointer - back, False), "shape": (tile.shape[0], tile.strides[0] // 2),
                                  "strides": (tile.strides[0], 2), "typestr": "<f2", "version": 3}))
    return view, back // 2


def _aligned(shape, fill=np.empty, dtype=np.float32) -> np.ndarray:
    """A new array of ``shape`` (fp32 unless ``dtype``) from a multiple of 64 bytes (``fill``: np.empty or
    np.zeros)."""
    size = math.prod(shape) * np.dtype(dtype).itemsize
    raw = fill(size + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return raw[start:start + size].view(dtype).reshape(shape)


def padded_copy(x: np.ndarray, pad, fill, width: int | None = None) -> np.ndarray:
    """``x`` [N, C, H, W] with ``pad`` (top, left, bottom, right) rows and columns of ``fill`` around it, ``width``
    columns in all where given (more on the right), contiguous from a multiple of 64 bytes."""
    top, left, bottom, right = pad
    n, c, h, w = x.shape
    padded = _aligned((n, c, h + top + bottom, width or w + left + right), dtype=x.dtype)
    padded[...] = fill
    padded[:, :, top:top + h, left:left + w] = x
    return padded


def _aligned_whole(x: np.ndarray) -> bool:
    """Whether ``x`` is C-contiguous from a multiple of 64 bytes: a buffer the kernel may take as it is."""
    return x.flags.c_contiguous and x.__array_interface__["data"][0] % _ALIGN == 0


def half_product(a: np.ndarray, tile: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``a @ tile`` in fp32 for fp32 ``a`` (rows x K) and a 2-D fp16 ``tile`` (K x N) whose columns are
    adjacent (its rows may lie apart); into ``out`` where given. Each sum adds its K products in order, each
    product fused with its addition (one rounding). Exact for subnormal, infinite and NaN weights alike."""
    import tvm_ffi

    if tile.ndim != 2 or tile.dtype != np.float16 or tile.strides[1] != 2 or tile.strides[0] % 2 \
            or tile.strides[0] < 2 * tile.shape[1]:
        raise ValueError(f"half_product takes a 2-D fp16 tile with adjacent columns, got {tile.dtype} "
                         f"{tile.shape} with strides {tile.strides}")
    if a.ndim != 2 or a.dtype != np.float32 or a.shape[1] != tile.shape[0]:
        raise ValueError(f"half_product takes fp32 rows of {tile.shape[0]}, got {a.dtype} {a.shape}")
    if tile.__array_interface__["data"][0] % 2:  # halves at odd addresses (a byte buffer's view): copied whole
        tile = tile.copy()
    rows, columns = len(a), tile.shape[1]
    operand = a
    if not _aligned_whole(a):
        operand = _aligned((rows, tile.shape[0]))
        np.copyto(operand, a)
    vectors = columns - columns % _LANES  # the last few columns go by a kernel of their own
    direct = out is not None and vectors == columns and _aligned_whole(out) and out.dtype == np.float32
    result = out if direct else _aligned((rows, columns))
    weights, first = _aligned_rows(tile)
    for start, stop in ((0, vectors), (vectors, columns)):
        if stop > start:
            part = result if stop - start == columns else _aligned((rows, stop - start))
            _compiled(_build, stop - start)(tvm_ffi.from_dlpack(operand), tvm_ffi.from_dlpack(weights), first + start,
                                  tvm_ffi.from_dlpack(part))
            if part is not result:
                result[:, start:stop] = part
    if out is None or direct:
        return result
    np.copyto(out, result)
    return out


def _build_depthwise(kernel: tuple, stride: tuple, dilation: tuple):
    """``main(x, w, out)``:
    ``out[b, c, y, v, l] = sum_(i, j) x[b, c, y·sh + i·dh, (16v + l)·sw + j·dw] · w[c, i, j]``, the taps in
    order, for ``x`` padded ([N, C, H, W]; wide enough for every vector) and ``out`` [N, C, OH, V, 16]: every
    size but the window's taken from the arrays."""
    import tvm
    import tvm.tirx
    from tvm import s_tir, te

    (kh, kw), (sh, sw), (dh, dw) = kernel, stride, dilation
    n, c, h, w_, oh, vectors = (te.var(name, "int64") for name in ("n", "c", "h", "w", "oh", "vectors"))
    x = te.placeholder((n, c, h, w_), "float32", name="x")
    taps = te.placeholder((c, kh, kw), "float32", name="taps")
    i, j = te.reduce_axis((0, kh), name="i"), te.reduce_axis((0, kw), name="j")
    out = te.compute((n, c, oh, vectors, _LANES), lambda b, ch, y, v, lane: te.sum(
        x[b, ch, y * sh + i * dh, (v * _LANES + lane) * sw + j * dw] * taps[ch, i, j], axis=[i, j]), name="out")
    schedule = s_tir.Schedule(te.create_prim_func([x, taps, out]).with_attr("global_symbol", "main"))
    block = schedule.get_sblock("out")
    b, ch, y, v, lane, i, j = schedule.get_loops(block)
    schedule.reorder(b, ch, y, v, i, j, lane)
    schedule.vectorize(lane)  # a vector of output columns sums its taps in a register
    schedule.decompose_reduction(block, i)
    # each product rounded before its addition, as numpy's passes do: the same sums, to the bit
    return tvm.tirx.build(schedule.mod, target=_target(fused=False))["main"]


def depthwise_sums(x: np.ndarray, w: np.ndarray, attrs: dict) -> np.ndarray:
    """A depthwise convolution's fp32 sums, [N, C, OH, OW], for fp32 ``x`` [N, C, H, W] (zeros around it as
    ``attrs["pad"]`` says) and ``w`` [C, KH, KW]: each output's taps added in order, row by row, each product
    rounded before its addition (numpy's passes' sums, to the bit). One kernel per window (kernel, stride,
    dilation) serves every size; its output columns go sixteen at a time, the last vector's extra columns over
    zeros and dropped."""
    import tvm_ffi

    from ..runtime_sim.shapes import window_out

    (kh, kw), (sh, sw), (dh, dw) = attrs["kernel"], attrs["stride"], attrs["dilation"]
    top, left, bottom, right = attrs["pad"]
    n, c, h, width = x.shape
    oh, ow = window_out(h, kh, sh, top, bottom, dh), window_out(width, kw, sw, left, right, dw)
    vectors = -(-ow // _LANES)
    padded_w = max(width + left + right, (vectors * _LANES - 1) * sw + (kw - 1) * dw + 1)
    padded = padded_copy(x, attrs["pad"], 0, width=padded_w)
    taps = _aligned((c, kh, kw))
    taps[...] = w
    out = _aligned((n, c, oh, vectors, _LANES))
    kernel = _compiled(_build_depthwise, (kh, kw), (sh, sw), (dh, dw))
    kernel(tvm_ffi.from_dlpack(padded), tvm_ffi.from_dlpack(taps), tvm_ffi.from_dlpack(out))
    return out.reshape(n, c, oh, vectors * _LANES)[..., :ow]
