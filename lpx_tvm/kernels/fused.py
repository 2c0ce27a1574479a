"""The simulator's fused elementwise runs (:mod:`lpx_tvm.runtime_sim.fusion`), compiled by TVM for this CPU.

A run's key lists its primitive nodes; this module gives each node its TIR
meaning and builds one kernel a key: a loop over rows, and over each row's
columns sixteen at a time in vector registers, then the last few one by one.
Every node is the IEEE operation numpy performs, with numpy's choices where
IEEE leaves one: ``maximum`` and ``minimum`` return a NaN first operand, and
the second operand where the two compare equal (so ``maximum(-0.0, 0.0)``
is ``0.0``); ``clip`` replaces only what compares below its low bound or
above its high one, so ``-0.0`` and NaN pass through. LLVM may not fuse a
product with the addition after it (``-fma``): numpy rounds each. So a fused
run gives numpy's bits (``tests/test_fusion.py`` compares them, specials
included), but for the sign and payload of a NaN an arithmetic step makes:
LLVM keeps neither (it may write -(a / b) as (-a) / b); which results are
NaN is numpy's.

A kernel is built at the first use of its key (about 70 ms) and runs on the
calling thread.
"""

from __future__ import annotations

from .host import _LANES, _compiled, _target


def vector_loop(T, count, body) -> None:
    """``body(j)`` for j in [0, count): sixteen at a time in vector registers, then the rest one by one."""
    with T.serial(0, count // _LANES) as block:
        with T.vectorized(0, _LANES) as lane:
            body(block * _LANES + lane)
    with T.serial(0, count % _LANES) as rest:
        body(count // _LANES * _LANES + rest)


def _select(condition, a, b):
    import tvm.tirx
    return tvm.tirx.Select(condition, a, b)


def _is_nan(x):
    """Whether fp32 ``x`` is a NaN, by its bits: TVM's simplifier folds ``x != x`` to false, and its ``isnan``
    does not survive a bound value in a vectorised loop."""
    from tvm.script.ir_builder import tirx as T
    bits = T.reinterpret("int32", x) & T.int32(0x7FFFFFFF)
    return bits > T.int32(0x7F800000)


def _maximum(a, b):
    return _select(_is_nan(a), a, _select(a > b, a, b))


def _minimum(a, b):
    return _select(_is_nan(a), a, _select(a < b, a, b))


def _clip(x, lo, hi):
    x = _select(x < lo, lo, x)
    return _select(x > hi, hi, x)


# how many times a node's TIR reads each operand: TVM inlines every bound value where it is read, so a run's
# expression grows as the product of these along it
_READS = {"max": (3, 2), "min": (3, 2), "relu": (3,), "clip": (4,), "leaky_relu": (3,), "hard_swish": (5,),
          "gelu_from_exp": (8, 1)}
_MAX_EXPRESSION = 256  # nodes of a run's expression, written out: past this the run is split (its build
# time grows with it: 0.1 s at 120 nodes, 0.3 s at 360, 3 s at 1,100)


def expression_size(nodes) -> int:
    """The number of nodes of a run's expression with every value written out where it is read."""
    sizes = []
    for name, operands, _ in nodes:
        reads = _READS.get(name, (1,) * len(operands))
        sizes.append(1 + sum(n * (sizes[-1 - r] if r < 0 else 1) for n, r in zip(reads, operands)))
    return sizes[-1]


_HALF_SQRT2 = 0.7071067811865476
_ERF_P, _ERF_FIRST, _ERF_COEFFICIENTS = 0.3275911, 1.061405429, (-1.453152027, 1.421413741, -0.284496736, 0.254829592)


def _gelu(x, exp):
    """GELU of ``x`` as :func:`lpx_tvm.runtime_sim.semantics.gelu` computes it, step for step in fp32, given
    ``exp`` = exp(-(x / sqrt 2)²) (numpy's)."""
    from tvm.script.ir_builder import tirx as T

    z = x * T.float32(_HALF_SQRT2)
    t = T.float32(1.0) / (T.float32(_ERF_P) * T.abs(z) + T.float32(1.0))
    poly = t * T.float32(_ERF_FIRST)
    for coefficient in _ERF_COEFFICIENTS:
        poly = (poly + T.float32(coefficient)) * t
    magnitude = T.float32(1.0) - poly * exp
    sign = T.reinterpret("int32", z) & T.int32(-0x80000000)
    erf = T.reinterpret("float32", (T.reinterpret("int32", magnitude) & T.int32(0x7FFFFFFF)) | sign)
    return x * T.float32(0.5) * (T.float32(1.0) + erf)


def _node_value(name: str, args: list, constants: tuple):
    """The TIR value of one primitive node on TIR values ``args``."""
    from tvm.script.ir_builder import tirx as T

    c = [T.float32(v) for v in constants]
    zero = T.float32(0.0)
    if name == "add":
        return args[0] + args[1]
    if name == "sub":
        return args[0] - args[1]
    if name == "mul":
        return args[0] * args[1]
    if name == "div":
        return args[0] / args[1]
    if name == "max":
        return _maximum(args[0], args[1])
    if name == "min":
        return _minimum(args[0], args[1])
    if name == "relu":
        return _maximum(args[0], zero)
    if name == "clip":
        return _clip(args[0], c[0], c[1])
    if name == "neg":  # the sign bit flipped, as numpy's negative does (0 - x keeps a NaN's sign and makes +0)
        flipped = T.reinterpret("int32", args[0]) ^ T.int32(-0x80000000)
        return T.reinterpret("float32", flipped)
    if name == "sqrt":
        return T.sqrt(args[0])
    if name == "leaky_relu":
        x = args[0]
        return _select(x >= zero, x, x * c[0])
    if name == "hard_swish":  # x * clip(x + 3, 0, 6) / 6, each rounded as numpy rounds it
        x = args[0]
        return x * _clip(x + T.float32(3.0), zero, T.float32(6.0)) / T.float32(6.0)
    if name == "gelu_exp_argument":  # -(|x / sqrt 2|)², what erf takes the exp of
        a = T.abs(args[0] * T.float32(_HALF_SQRT2))
        return -(a * a)
    if name == "gelu_from_exp":  # x / 2 · (1 + erf(x / sqrt 2)), erf's exp given
        return _gelu(args[0], args[1])
    if name == "copy":
        return args[0]
    raise ValueError(f"no fused kernel node {name!r}")


def _build(key: tuple):
    """The kernel of a fused run's ``key`` (see :mod:`lpx_tvm.runtime_sim.fusion`)."""
    import tvm
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    nodes, broadcast = key
    with IRBuilder() as builder:
        with T.prim_func():
            T.func_name("main")
            pointers = [T.arg(f"p{k}", T.handle("float32")) for k in range(len(broadcast) + 1)]
            strides = [T.arg(f"s{k}", T.int64()) for k in range(len(broadcast) + 1)]
            rows, cols = T.arg("rows", T.int64()), T.arg("cols", T.int64())
            # extents only name the buffers: the caller's views say where each lies
            buffers = [T.decl_buffer((rows * s + cols,), "float32", data=p, align=4)
                       for p, s in zip(pointers, strides)]

            def element(i, j):
                inputs = [buffers[k + 1][i * strides[k + 1] + (0 if flat else j)]
                          for k, flat in enumerate(broadcast)]
                values = []
                for name, operands, constants in nodes:
                    values.append(_node_value(name, [inputs[r] if r >= 0 else values[-1 - r] for r in operands],
                                              constants))
                return values[-1]

            with T.serial(0, rows) as i:
                vector_loop(T, cols, lambda j, i=i: T.buffer_store(buffers[0], element(i, j), [i * strides[0] + j]))
    return tvm.tirx.build(tvm.IRModule({"main": builder.get()}), target=_target(fused=False))["main"]


def kernel(key: tuple):
    """The compiled kernel of ``key``, built once a process; None where its expression, written out, would be
    too large (the run is then split)."""
    if expression_size(key[0]) > _MAX_EXPRESSION:
        return None
    return _compiled(_build, key)
