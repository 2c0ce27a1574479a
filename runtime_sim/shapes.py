"""Operand rules: the shapes and dtypes each opcode accepts and produces.

One rule per :class:`~.isa.Group` (the MOVE group dispatches on the opcode).
:func:`check_operands` is the decoder's half of the ISA's definition: it
rejects, with ``ValueError`` (the decoder turns it into ``ProgramFormatError``),
any instruction whose operand counts, shapes, dtypes or attribute values do not
fit its opcode, before anything runs. What the opcodes compute is
:mod:`.semantics`.
"""

from __future__ import annotations

from math import prod

import numpy as np

from .isa import FLOAT_DTYPES, MAX_CYCLE, OP_TABLE, QUANT_DTYPES, DType, Group, Opcode


def _check(cond, message):
    if not cond:
        raise ValueError(message)


def window_out(size: int, k: int, s: int, p0: int, p1: int, d: int) -> int:
    """Output size of a window of ``k`` taps (dilation ``d``, stride ``s``) over padded ``size``."""
    return (size + p0 + p1 - (k - 1) * d - 1) // s + 1


def _window(shape, attrs) -> tuple:
    _check(len(shape) == 4, "window ops take an NCHW tensor")
    (kh, kw), (sh, sw), (dh, dw), pads = attrs["kernel"], attrs["stride"], attrs["dilation"], attrs["pad"]
    _check(min(kh, kw, sh, sw, dh, dw) >= 1 and min(pads) >= 0, "bad window attributes")
    oh = window_out(shape[2], kh, sh, pads[0], pads[2], dh)
    ow = window_out(shape[3], kw, sw, pads[1], pads[3], dw)
    _check(oh >= 1 and ow >= 1, "window larger than its input")
    return oh, ow


def _fits(value: int, dtype: DType, what: str) -> None:
    lo, hi = dtype.int_range
    _check(lo <= value <= hi, f"{what} {value} outside the {dtype.short} range")


def _broadcasts_to(shape, out) -> bool:
    try:
        return tuple(np.broadcast_shapes(shape, out)) == tuple(out)
    except ValueError:
        return False


def _count(srcs, dsts, n_src, n_dst, op):
    ok_src = len(srcs) in n_src if isinstance(n_src, tuple) else len(srcs) == n_src
    _check(ok_src and len(dsts) == n_dst, f"{op.name} takes {n_src} sources and {n_dst} destinations, "
                                           f"got {len(srcs)} and {len(dsts)}")


def _same_float(types, op):
    _check(len(set(types)) == 1 and types[0] in OP_TABLE[op].dtypes,
           f"{op.name} operand dtypes {[t.short for t in types]} are not allowed")


def _rule_host(op, srcs, dsts, attrs):
    _count(srcs, dsts, 1 if op == Opcode.STORE else 0, 0 if op == Opcode.STORE else 1, op)
    _check(attrs["index"] >= 0 and attrs.get("offset", 0) >= 0, f"{op.name} index and offset must be >= 0")
    return None  # the host tensor it names decides the shape (checked against the program's signature)


def _rule_link(op, srcs, dsts, attrs):
    _count(srcs, dsts, 1 if op == Opcode.SEND else 0, 0 if op == Opcode.SEND else 1, op)
    _check(attrs["peer"] >= 0 and attrs["tag"] >= 0, f"{op.name} peer and tag must be >= 0")
    return None  # a transfer moves its operand as it is; the system checks that both ends agree


def _rule_control(op, srcs, dsts, attrs):
    _count(srcs, dsts, 0, 0, op)
    _check(0 <= attrs["cycles"] < MAX_CYCLE, "NOP cycles must be >= 0 and below 2^48 (3.6 days at 900 MHz)")
    return None


def _int8_extras(op, srcs, dst, out, attrs, zero_points) -> None:
    """int8 kernels: integer operands, int32 bias, fp32 requantisation scale, zero points in range."""
    types = [t for _, t in srcs]
    _check(types[1] in QUANT_DTYPES and types[2:] == [DType.I32, DType.F32] and dst in QUANT_DTYPES,
           f"{op.name} int8 operand dtypes {[t.short for t in types]} -> {dst.short} are not allowed")
    for extra, _ in srcs[2:]:
        _check(_broadcasts_to(extra, out), f"{op.name} bias/requant {extra} does not broadcast to {out}")
    dtypes = {"a": types[0], "b": types[1], "out": dst}
    for name, operand in zero_points:
        _fits(attrs[name], dtypes[operand], f"{op.name} {name}")
    _check(attrs["act"] in (Opcode.NOP, Opcode.RELU), f"int8 {op.name} epilogue is NOP or RELU")


def _rule_install(op, srcs, dsts, attrs):
    _count(srcs, dsts, 1, 0, op)
    _check(len(srcs[0][0]) == 2, "INSTALL takes a 2-D tile")
    _check(srcs[0][1] in OP_TABLE[op].dtypes, f"INSTALL of {srcs[0][1].short}")
    _check(attrs["buffer"] >= 0, "INSTALL buffer must be >= 0")
    return None


def partial_dtype(dtype: DType) -> DType:
    """The matrix unit's accumulator type for operands of ``dtype``: int32 for int8/uint8, else fp32."""
    return DType.I32 if dtype in QUANT_DTYPES else DType.F32


def _rule_matrix(op, srcs, dsts, attrs):
    _count(srcs, dsts, (1, 2), 1, op)
    (a, ta), (out, tout) = srcs[0], dsts[0]
    _check(len(a) >= 2 and len(out) == len(a) and out[:-1] == a[:-1],
           f"MATMUL rows: a {a} and out {out} must share all but the last axis")
    _check(ta in OP_TABLE[op].dtypes and tout == partial_dtype(ta),
           f"MATMUL of {ta.short} accumulates in {partial_dtype(ta).short}, not {tout.short}")
    if len(srcs) == 2:
        _check(srcs[1] == (out, tout), f"MATMUL accumulator {srcs[1][0]} {srcs[1][1].short} must match its output")
    if ta in QUANT_DTYPES:
        _fits(attrs["zp_a"], ta, "MATMUL zp_a")
        _check(-128 <= attrs["zp_b"] <= 255, "MATMUL zp_b outside the int8/uint8 range")
    else:
        _check(attrs["zp_a"] == 0 and attrs["zp_b"] == 0, "zero points apply to int8/uint8 operands only")
    _check(attrs["buffer"] >= 0, "MATMUL buffer must be >= 0")
    return out


def _rule_epilogue(op, srcs, dsts, attrs):
    (acc, tacc), tout = srcs[0], dsts[0][1]
    if tout in QUANT_DTYPES:
        _count(srcs, dsts, 3, 1, op)
        _check(tacc == DType.I32 and [t for _, t in srcs[1:]] == [DType.I32, DType.F32],
               "int8 EPILOGUE takes an int32 accumulator, an int32 bias and an fp32 requantisation scale")
        _fits(attrs["zp_out"], tout, "EPILOGUE zp_out")
        _check(attrs["act"] in (Opcode.NOP, Opcode.RELU), "int8 EPILOGUE activation is NOP or RELU")
    else:
        _count(srcs, dsts, (1, 2, 3), 1, op)
        # int32 sums with a scale: an int8 product's result dequantised on its way out (its float reader's form)
        _check((tacc == DType.F32 or (tacc == DType.I32 and len(srcs) == 3)) and tout in FLOAT_DTYPES
               and all(t in FLOAT_DTYPES for _, t in srcs[1:]),
               "float EPILOGUE takes fp32 sums (or int32 ones with a scale), a float bias and an optional weight scale")
        _check(len(srcs) < 3 or srcs[2][1] == DType.F32, "a float EPILOGUE's weight scale is fp32")
        _check(attrs["zp_out"] == 0, "EPILOGUE zp_out applies to int8/uint8 results only")
    for extra, _ in srcs[1:]:
        _check(_broadcasts_to(extra, acc), f"EPILOGUE bias/requant {extra} does not broadcast to {acc}")
    return acc


def _rule_qbinary(op, srcs, dsts, attrs):
    _count(srcs, dsts, 2, 1, op)
    types = [t for _, t in srcs] + [dsts[0][1]]
    _check(all(t in QUANT_DTYPES for t in types), f"QADD operand dtypes {[t.short for t in types]}")
    for (name, dtype) in (("zp_a", types[0]), ("zp_b", types[1]), ("zp_out", types[2])):
        _fits(attrs[name], dtype, f"QADD {name}")
    for name in ("scale_a", "scale_b", "scale_out"):
        _check(attrs[name] > 0 and np.isfinite(attrs[name]), f"QADD {name} must be > 0")
    _check(attrs["act"] in (Opcode.NOP, Opcode.RELU), "QADD activation is NOP or RELU")
    try:
        return tuple(np.broadcast_shapes(srcs[0][0], srcs[1][0]))
    except ValueError:
        raise ValueError(f"QADD shapes {srcs[0][0]} and {srcs[1][0]} do not broadcast") from None


def _rule_unary(op, srcs, dsts, attrs):
    _count(srcs, dsts, 1, 1, op)
    if op == Opcode.CAST:
        _check(srcs[0][1] != DType.BOOL and dsts[0][1] != DType.BOOL, "CAST of bool")
    elif op != Opcode.COPY:
        _same_float([srcs[0][1], dsts[0][1]], op)
    else:
        _check(srcs[0][1] == dsts[0][1], "COPY keeps the dtype")
    return srcs[0][0]


def _rule_binary(op, srcs, dsts, attrs):
    _count(srcs, dsts, 2, 1, op)
    _same_float([t for _, t in srcs] + [dsts[0][1]], op)
    try:
        return tuple(np.broadcast_shapes(srcs[0][0], srcs[1][0]))
    except ValueError:
        raise ValueError(f"{op.name} shapes {srcs[0][0]} and {srcs[1][0]} do not broadcast") from None


def _rule_quant(op, srcs, dsts, attrs):
    _count(srcs, dsts, 1, 1, op)
    (shape, src), dst = srcs[0], dsts[0][1]
    floats, ints = (src, dst) if op == Opcode.QUANTIZE else (dst, src)
    _check(floats in FLOAT_DTYPES and ints in QUANT_DTYPES,
           f"{op.name} operand dtypes {src.short} -> {dst.short} are not allowed")
    _check(attrs["scale"] > 0 and np.isfinite(attrs["scale"]), f"{op.name} scale must be > 0")
    _fits(attrs["zero_point"], ints, f"{op.name} zero point")
    return shape


def _rule_reduce(op, srcs, dsts, attrs):
    _count(srcs, dsts, 1, 1, op)
    _same_float([srcs[0][1], dsts[0][1]], op)
    shape, axes = srcs[0][0], attrs["axes"]
    _check(axes and len(set(axes)) == len(axes) and all(0 <= a < len(shape) for a in axes),
           f"{op.name} axes {axes} out of range for rank {len(shape)}")
    return tuple(1 if i in axes else d for i, d in enumerate(shape))


def _rule_norm(op, srcs, dsts, attrs):
    if op == Opcode.SOFTMAX:
        _count(srcs, dsts, 1, 1, op)
        _check(0 <= attrs["axis"] < len(srcs[0][0]), "SOFTMAX axis out of range")
    else:
        _count(srcs, dsts, 3, 1, op)
        _check(1 <= attrs["n_axes"] <= len(srcs[0][0]), "LAYERNORM axis count out of range")
        _check(attrs["eps"] >= 0, "LAYERNORM eps must be >= 0")
        for p, _ in srcs[1:]:
            _check(_broadcasts_to(p, srcs[0][0]), "LAYERNORM gamma/beta shape")
    _same_float([t for _, t in srcs] + [dsts[0][1]], op)
    return srcs[0][0]


def _rule_window(op, srcs, dsts, attrs):
    _count(srcs, dsts, 1, 1, op)
    if op == Opcode.MAXPOOL and srcs[0][1] in QUANT_DTYPES:
        _check(dsts[0][1] == srcs[0][1], "int8 MAXPOOL keeps the dtype")
    else:
        _same_float([srcs[0][1], dsts[0][1]], op)
    shape = srcs[0][0]
    return shape[:2] + _window(shape, attrs)


def _rule_depthwise(op, srcs, dsts, attrs):
    quantized = bool(srcs) and srcs[0][1] in QUANT_DTYPES
    _count(srcs, dsts, 4 if quantized else (2, 3), 1, op)
    x = srcs[0][0]
    oh, ow = _window(x, attrs)
    n, c = x[:2]
    kernel = (c,) + tuple(attrs["kernel"])
    _check(srcs[1][0] == kernel, f"DWCONV weight must be {kernel}, got {srcs[1][0]}")
    out = (n, c, oh, ow)
    if quantized:
        _int8_extras(op, srcs, dsts[0][1], out, attrs, (("zp_in", "a"), ("zp_out", "out")))
    else:
        _same_float([t for _, t in srcs] + [dsts[0][1]], op)
        if len(srcs) == 3:
            _check(_broadcasts_to(srcs[2][0], out), "DWCONV bias does not broadcast")
    return out


def _rule_move(op, srcs, dsts, attrs):
    _count(srcs, dsts, tuple(range(1, 65)) if op == Opcode.CONCAT else 1, 1, op)
    _check(len({t for _, t in srcs} | {dsts[0][1]}) == 1, f"{op.name} keeps the dtype")
    shape = srcs[0][0]
    if op == Opcode.TRANSPOSE:
        _check(sorted(attrs["perm"]) == list(range(len(shape))), f"TRANSPOSE perm {attrs['perm']}")
        return tuple(shape[p] for p in attrs["perm"])
    if op == Opcode.IM2COL:
        oh, ow = _window(shape, attrs)
        groups, (kh, kw) = attrs["groups"], attrs["kernel"]
        n, c = shape[:2]
        _check(groups >= 1 and c % groups == 0, "IM2COL groups must divide channels")
        if srcs[0][1] in QUANT_DTYPES:
            _fits(attrs["pad_value"], srcs[0][1], "IM2COL pad value")
        return (n, groups, c // groups * kh * kw, oh * ow)
    if op == Opcode.CONCAT:
        axis = attrs["axis"]
        _check(0 <= axis < len(shape), "CONCAT axis out of range")
        for s, _ in srcs:
            _check(len(s) == len(shape) and all(s[i] == shape[i] for i in range(len(s)) if i != axis),
                   "CONCAT shapes")
        return shape[:axis] + (sum(s[axis] for s, _ in srcs),) + shape[axis + 1:]
    rank, dst = len(shape), dsts[0][0]
    begin, step = attrs["begin"], attrs["step"]
    _check(len(begin) == len(step) == len(dst) == rank, "SLICE takes begin and step per axis")
    for i in range(rank):
        _check(step[i] >= 1 and begin[i] >= 0 and (dst[i] == 0 or begin[i] + step[i] * (dst[i] - 1) < shape[i]),
               "SLICE out of bounds")
    return dst


RULES = {
    Group.HOST: _rule_host, Group.CONTROL: _rule_control, Group.INSTALL: _rule_install, Group.MATRIX: _rule_matrix,
    Group.EPILOGUE: _rule_epilogue, Group.QBINARY: _rule_qbinary, Group.UNARY: _rule_unary,
    Group.BINARY: _rule_binary, Group.QUANT: _rule_quant, Group.REDUCE: _rule_reduce, Group.NORM: _rule_norm,
    Group.WINDOW: _rule_window, Group.DEPTHWISE: _rule_depthwise, Group.MOVE: _rule_move, Group.LINK: _rule_link,
}
# the destination may be a reshaped view of these groups' results (same element count)
RESHAPING = frozenset({Group.REDUCE, Group.MOVE})
assert {spec.group for spec in OP_TABLE.values()} <= set(RULES), "every group needs an operand rule"


def check_operands(op: Opcode, srcs: list, dsts: list, attrs: dict) -> None:
    """Reject an instruction whose operands do not fit its opcode.

    Parameters
    ----------
    op : Opcode
    srcs, dsts : list of (shape, DType)
    attrs : dict
        Its named attributes.

    Raises
    ------
    ValueError
        Naming the opcode and what is wrong.
    """
    group = OP_TABLE[op].group
    out = RULES[group](op, [(tuple(s), t) for s, t in srcs], [(tuple(s), t) for s, t in dsts], attrs)
    if out is None:
        return
    dst = tuple(dsts[0][0])
    if dst != tuple(out) and not (group in RESHAPING and prod(dst) == prod(out)):
        raise ValueError(f"{op.name} output shape {dst}, expected {tuple(out)}")
