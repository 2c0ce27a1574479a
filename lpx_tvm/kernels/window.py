"""The simulator's IM2COL and max pooling as kernels TVM compiles for this CPU.

numpy's IM2COL copies one strided view a kernel tap (and fills the border
strips around it), and its max pooling makes a pass a tap: a 7 x 7 stem is 49
copies and up to 196 fills a band of rows, each a numpy call of a few
microseconds over a few hundred bytes, so the calls, not the bytes, are the
cost (ResNet-50's stem: 220 us a band). Here the input is padded once
(numpy), and one kernel a window (kernel, stride, dilation) and element type
walks every tap: a copy is exact in any type, and a maximum takes numpy's
rule (a NaN wins, and of two equal values the second), each tap in numpy's
order, so the results are numpy's bits.

A kernel writes each tap out, and its build time grows with the taps faster
than the calls it saves a run: max pooling about 20 ms a tap, IM2COL 6.5 s
at 7 x 7 and 126 s at 16 x 16 (a 60 x 80 pooling window had not built after
150 s). A window of more taps than a 7 x 7 stem's keeps numpy's passes.
"""

from __future__ import annotations

import numpy as np

from .fused import _maximum, vector_loop
from .host import _compiled, _target, padded_copy

# the most taps a window's kernel is built for (a 7 x 7 stem's): past it the build would not pay for itself
# in the per-tap numpy calls it saves
MAX_TAPS = 49


def _build_im2col(window: tuple, dtype: str):
    """``main(x, out, channels, height, width, oh, ow, groups, s_n, s_g, s_k)``: ``x`` padded [N, C, H, W]
    contiguous, ``out`` [N, G, C/G·kh·kw, OH·OW] with those strides (elements) and adjacent positions."""
    import tvm
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    (kh, kw), (sh, sw), (dh, dw) = window
    with IRBuilder() as builder:
        with T.prim_func():
            T.func_name("main")
            px, po = T.arg("x", T.handle(dtype)), T.arg("out", T.handle(dtype))
            batch, channels, height, width, oh, ow, groups, s_n, s_g, s_k = (
                T.arg(name, T.int64()) for name in
                ("batch", "channels", "height", "width", "oh", "ow", "groups", "s_n", "s_g", "s_k"))
            x = T.decl_buffer((batch * channels * height * width,), dtype, data=px)
            out = T.decl_buffer((batch * s_n,), dtype, data=po, align=np.dtype(dtype).itemsize)
            per_group = channels // groups
            with T.serial(0, batch) as b, T.serial(0, groups) as g, T.serial(0, per_group) as c:
                for i in range(kh):
                    for j in range(kw):
                        row = b * s_n + g * s_g + ((c * kh + i) * kw + j) * s_k
                        with T.serial(0, oh) as y:
                            source = ((b * channels + g * per_group + c) * height + y * sh + i * dh) * width + j * dw

                            def copy(col, row=row, y=y, source=source):
                                T.buffer_store(out, x[source + col * sw], [row + y * ow + col])
                            vector_loop(T, ow, copy)
    return tvm.tirx.build(tvm.IRModule({"main": builder.get()}), target=_target(fused=False))["main"]


def _build_maxpool(window: tuple):
    """``main(x, out, planes, height, width, oh, ow, s_p, s_y)``: ``x`` padded [P, H, W] fp32 contiguous (P the
    batch times the channels), ``out`` [P, OH, OW] with strides ``s_p``, ``s_y`` (elements), columns adjacent."""
    import tvm
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    (kh, kw), (sh, sw), (dh, dw) = window
    with IRBuilder() as builder:
        with T.prim_func():
            T.func_name("main")
            px, po = T.arg("x", T.handle("float32")), T.arg("out", T.handle("float32"))
            planes, height, width, oh, ow, s_p, s_y = (
                T.arg(name, T.int64()) for name in ("planes", "height", "width", "oh", "ow", "s_p", "s_y"))
            x = T.decl_buffer((planes * height * width,), "float32", data=px)
            out = T.decl_buffer((planes * s_p,), "float32", data=po, align=4)
            with T.serial(0, planes) as p, T.serial(0, oh) as y:
                def pool(col, p=p, y=y):
                    at = p * s_p + y * s_y + col
                    # the running maximum kept in the output: as one expression it would grow as 3 ** taps
                    for i in range(kh):
                        for j in range(kw):
                            tap = x[(p * height + y * sh + i * dh) * width + col * sw + j * dw]
                            T.buffer_store(out, _maximum(out[at], tap) if i or j else tap, [at])
                vector_loop(T, ow, pool)
    return tvm.tirx.build(tvm.IRModule({"main": builder.get()}), target=_target(fused=False))["main"]


def _window(attrs: dict) -> tuple:
    return tuple(tuple(int(v) for v in attrs[name]) for name in ("kernel", "stride", "dilation"))


def _too_many_taps(attrs: dict) -> bool:
    kh, kw = (int(v) for v in attrs["kernel"])
    return kh * kw > MAX_TAPS


def im2col(x: np.ndarray, out: np.ndarray, attrs: dict) -> bool:
    """IM2COL of ``x`` [N, C, H, W] into ``out`` [N, G, C/G·kh·kw, OH·OW] (attributes as the instruction's).
    False, having written nothing, where ``out``'s positions are not adjacent or the window has more than
    :data:`MAX_TAPS` taps."""
    (kh, kw), (sh, sw), (dh, dw) = _window(attrs)
    if _too_many_taps(attrs) or out.ndim != 4 or out.strides[3] != out.itemsize \
            or any(s % out.itemsize for s in out.strides):
        return False
    padded = padded_copy(x, attrs["pad"], attrs["pad_value"])
    n, c, h, w = padded.shape
    oh, ow = (h - (kh - 1) * dh - 1) // sh + 1, (w - (kw - 1) * dw - 1) // sw + 1
    s_n, s_g, s_k, _ = (s // out.itemsize for s in out.strides)
    kernel = _compiled(_build_im2col, _window(attrs), str(x.dtype))
    kernel(_pointer(padded), _pointer(out), n, c, h, w, oh, ow, attrs["groups"], s_n, s_g, s_k)
    return True


def max_pool(x: np.ndarray, out: np.ndarray, attrs: dict) -> bool:
    """Max pooling of fp32 ``x`` [N, C, H, W] into fp32 ``out`` [N, C, OH, OW]. False, having written nothing,
    where ``out``'s columns are not adjacent, its planes do not share one stride, or the window has more than
    :data:`MAX_TAPS` taps."""
    if _too_many_taps(attrs) or x.dtype != np.float32 or out.dtype != np.float32 or out.ndim != 4 \
            or out.strides[3] != 4 or any(s % 4 for s in out.strides) \
            or (out.shape[0] > 1 and out.strides[0] != out.strides[1] * out.shape[1]):
        return False
    (kh, kw), (sh, sw), (dh, dw) = _window(attrs)
    padded = padded_copy(x, attrs["pad"], -np.inf)
    n, c, h, w = padded.shape
    oh, ow = out.shape[2:]
    kernel = _compiled(_build_maxpool, _window(attrs))
    kernel(_pointer(padded), _pointer(out), n * c, h, w, oh, ow, out.strides[1] // 4,
           out.strides[2] // 4)
    return True


def _pointer(array: np.ndarray):
    import ctypes
    return ctypes.c_void_p(array.ctypes.data)
