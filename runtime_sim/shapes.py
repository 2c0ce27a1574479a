"""What shapes each opcode accepts and produces: the decoder's half of the ISA's definition.

``infer_shapes`` gives the output shapes an instruction must have for its inputs
and attributes, and rejects anything else with ``ValueError`` (the decoder turns
that into ``ProgramFormatError``) before a program runs. What the opcodes compute
is :mod:`.semantics`; the attribute layouts are listed there.
"""

from __future__ import annotations

import numpy as np

from .isa import BINARY_OPS, EPILOGUE_OPS, INT_DTYPES, POOL_OPS, REDUCE_OPS, UNARY_OPS, Opcode


def _window_out(size, k, s, p0, p1, d):
    return (size + p0 + p1 - (k - 1) * d - 1) // s + 1


def _check(cond, message):
    if not cond:
        raise ValueError(message)


def _ints(attrs):
    _check(all(float(a).is_integer() for a in attrs), "integer attribute expected")
    return [int(a) for a in attrs]


def _rule_window(src, attrs):
    _check(len(src) == 4, "window ops take an NCHW tensor")
    _check(len(attrs) == 11, "window ops take 11 attributes")
    kh, kw, sh, sw, pt, pl, pb, pr, dh, dw, extra = _ints(attrs)
    _check(min(kh, kw, sh, sw, dh, dw) >= 1 and min(pt, pl, pb, pr) >= 0, "bad window attributes")
    oh = _window_out(src[2], kh, sh, pt, pb, dh)
    ow = _window_out(src[3], kw, sw, pl, pr, dw)
    _check(oh >= 1 and ow >= 1, "window larger than its input")
    return kh, kw, oh, ow, extra


def _zero_points(values) -> None:
    """Zero points (and int8 pad values) are integers an int8 or uint8 tensor can hold."""
    _check(all(-128 <= v <= 255 for v in _ints(values)), "zero point outside the int8/uint8 range")


def infer_shapes(op: Opcode, srcs: list, attrs: tuple) -> list | None:
    """Output shapes an instruction must have, or None where the dst shape is free.

    Parameters
    ----------
    op : Opcode
    srcs : list of (shape, DType)
    attrs : tuple of float

    Raises
    ------
    ValueError
        If the operands or attributes are not valid for the opcode.
    """
    shapes = [tuple(s) for s, _ in srcs]
    if op in (Opcode.LOAD, Opcode.STORE, Opcode.STREAM, Opcode.NOP):
        _check(len(attrs) == 1 and _ints(attrs)[0] >= 0, f"{op.name} takes one index attribute")
        return None
    if op in (Opcode.QUANTIZE, Opcode.DEQUANTIZE):
        _check(len(shapes) == 1 and len(attrs) == 2 and attrs[0] > 0, f"{op.name} takes x, scale > 0, zero point")
        _zero_points(attrs[1:])
        return [shapes[0]]
    if op == Opcode.MATMUL and srcs and srcs[0][1] in INT_DTYPES:
        _check(len(shapes) == 4 and len(attrs) == 4, "int8 MATMUL takes a, b, bias, requant and 4 attributes")
        _zero_points(attrs[1:])
        _check(Opcode(_ints(attrs[:1])[0]) in (Opcode.NOP, Opcode.RELU), "int8 MATMUL epilogue is NOP or RELU")
        a, b = shapes[0], shapes[1]
        _check(len(a) >= 2 and len(b) >= 2 and a[-1] == b[-2], f"MATMUL shapes {a} and {b} do not chain")
        out = tuple(np.broadcast_shapes(a[:-2], b[:-2])) + (a[-2], b[-1])
        for extra in shapes[2:]:
            _check(np.broadcast_shapes(out, extra) == out, "int8 MATMUL bias/requant do not broadcast")
        return [out]
    if op == Opcode.MATMUL:
        _check(len(shapes) in (2, 3) and len(attrs) == 3, "MATMUL takes 2-3 operands and 3 attributes")
        a, b = shapes[0], shapes[1]
        _check(len(a) >= 2 and len(b) >= 2 and a[-1] == b[-2], f"MATMUL shapes {a} and {b} do not chain")
        _check(Opcode(_ints(attrs[:1])[0]) in EPILOGUE_OPS, "MATMUL epilogue must be an activation")
        batch = np.broadcast_shapes(a[:-2], b[:-2])
        out = tuple(batch) + (a[-2], b[-1])
        if len(shapes) == 3:
            _check(np.broadcast_shapes(out, shapes[2]) == out, "MATMUL bias does not broadcast")
        return [out]
    if op in UNARY_OPS:
        _check(len(shapes) == 1 and len(attrs) == (2 if op == Opcode.CLIP else 0), f"{op.name} operands")
        return [shapes[0]]
    if op in BINARY_OPS:
        _check(len(shapes) == 2 and not attrs, f"{op.name} takes two operands")
        return [tuple(np.broadcast_shapes(*shapes))]
    if op in REDUCE_OPS:
        _check(len(shapes) == 1 and attrs, f"{op.name} takes one operand and its axes")
        axes = _ints(attrs)
        _check(all(0 <= a < len(shapes[0]) for a in axes), "reduce axis out of range")
        return [tuple(1 if i in axes else d for i, d in enumerate(shapes[0]))]
    if op == Opcode.SOFTMAX:
        _check(len(shapes) == 1 and len(attrs) == 1 and 0 <= _ints(attrs)[0] < len(shapes[0]), "SOFTMAX axis")
        return [shapes[0]]
    if op == Opcode.LAYERNORM:
        _check(len(shapes) == 3 and len(attrs) == 2, "LAYERNORM takes x, gamma, beta, eps, n_axes")
        n = _ints(attrs[1:])[0]
        _check(1 <= n <= len(shapes[0]), "LAYERNORM axis count")
        for p in shapes[1:]:
            _check(np.broadcast_shapes(shapes[0], p) == shapes[0], "LAYERNORM gamma/beta shape")
        return [shapes[0]]
    if op in POOL_OPS:
        _check(len(shapes) == 1, f"{op.name} takes one operand")
        _, _, oh, ow, _ = _rule_window(shapes[0], attrs)
        return [shapes[0][:2] + (oh, ow)]
    if op == Opcode.DWCONV:
        quantized = srcs[0][1] in INT_DTYPES
        _check(len(shapes) in ((4,) if quantized else (2, 3)) and len(attrs) == 14,
               "DWCONV takes x, w, bias (and requant on int8) and 14 attributes")
        if quantized:
            _zero_points(attrs[12:])
        kh, kw, oh, ow, _ = _rule_window(shapes[0], attrs[:11])
        n, c = shapes[0][:2]
        _check(shapes[1] == (c, kh, kw), f"DWCONV weight must be {(c, kh, kw)}, got {shapes[1]}")
        _check(Opcode(_ints(attrs[11:12])[0]) in EPILOGUE_OPS, "DWCONV epilogue must be an activation")
        out = (n, c, oh, ow)
        for extra in shapes[2:]:
            _check(np.broadcast_shapes(out, extra) == out, "DWCONV bias/requant does not broadcast")
        return [out]
    if op == Opcode.IM2COL:
        _check(len(shapes) == 1 and len(attrs) in (11, 12), "IM2COL takes one operand and 11-12 attributes")
        _zero_points(attrs[11:])
        kh, kw, oh, ow, groups = _rule_window(shapes[0], attrs[:11])
        n, c = shapes[0][:2]
        _check(groups >= 1 and c % groups == 0, "IM2COL groups must divide channels")
        return [(n, groups, c // groups * kh * kw, oh * ow)]
    if op == Opcode.TRANSPOSE:
        _check(len(shapes) == 1, "TRANSPOSE takes one operand")
        perm = _ints(attrs)
        _check(sorted(perm) == list(range(len(shapes[0]))), "TRANSPOSE perm")
        return [tuple(shapes[0][p] for p in perm)]
    if op == Opcode.CONCAT:
        _check(len(shapes) >= 1 and len(attrs) == 1, "CONCAT operands")
        axis = _ints(attrs)[0]
        first = shapes[0]
        _check(0 <= axis < len(first), "CONCAT axis")
        for s in shapes:
            _check(len(s) == len(first) and all(s[i] == first[i] for i in range(len(s)) if i != axis),
                   "CONCAT shapes")
        return [first[:axis] + (sum(s[axis] for s in shapes),) + first[axis + 1:]]
    if op == Opcode.SLICE:
        _check(len(shapes) == 1 and len(attrs) == 2 * len(shapes[0]), "SLICE attributes")
        return None
    raise ValueError(f"no shape rule for {op.name}")


def check_slice(src_shape, dst_shape, attrs) -> None:
    """SLICE bounds: every index read must lie inside the source."""
    rank = len(src_shape)
    _check(len(dst_shape) == rank, "SLICE rank")
    vals = _ints(attrs)
    for i in range(rank):
        begin, step, n = vals[i], vals[rank + i], dst_shape[i]
        _check(step >= 1 and 0 <= begin and (n == 0 or begin + step * (n - 1) < src_shape[i]),
               "SLICE out of bounds")
