"""The TVM side's one table: Relax op ─► lpx operator.

Each :class:`RelaxOp` row says how the partitioner matches a Relax op (its
single-op pattern ``lpx.<name>``), which of its attributes lpx implements (an op
whose attributes lpx does not implement stays on the host), and how lowering
turns it into LPX operator-graph nodes. Under ``dtype="int8"`` every row runs on
lpx: an op with no int8 kernel (softmax, layer norm, GELU) runs in float between
its QDQ model's dequantise and quantise, as the model defines it. The
patterns (``lpx_tvm.patterns``) and the lowering (:mod:`.lower`) both read it.

A :class:`RelaxPattern` row is a multi-op idiom the importer writes out (ONNX
HardSwish becomes add, clip, divide, multiply) that lpx runs as one operator.

Adding an elementwise op is one row here and one row in the ISA's op table
(``runtime_sim.isa.OP_TABLE``), plus its semantics and a test.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import tvm
from tvm import relax
from tvm.ir.prim.expr import FloatImm, IntImm

from ..runtime_sim import Opcode
from ..runtime_sim.errors import LpxUserError
from .graph import NodeKind

# TVM 0.27 names: constants are tvm.ir.Constant (data in .value), prim values are IntImm/FloatImm
Constant = tvm.ir.Constant
PRIM_TYPES = (IntImm, FloatImm)


class LoweringError(LpxUserError):
    """A Relax construct the LPX codegen cannot lower."""


def constant_value(expr) -> np.ndarray:
    """The numpy data of a Relax constant: a read-only view of the constant's memory (weights are large)."""
    try:
        array = np.from_dlpack(expr.value)
    except (TypeError, BufferError, RuntimeError):  # a dtype DLPack cannot carry to numpy (bfloat16, say)
        return expr.value.numpy()
    array.flags.writeable = False
    return array


def shape_of(expr) -> tuple:
    """The static shape of a tensor-typed Relax expression."""
    sinfo = expr.ty
    if not isinstance(sinfo, relax.TensorType) or sinfo.shape is None:
        raise LoweringError(f"expected a tensor with a known shape, got {sinfo}")
    try:
        return tuple(int(d) for d in sinfo.shape.values)
    except TypeError:
        raise LoweringError(f"dynamic shape {sinfo.shape} cannot run on lpx") from None


def dtype_of(expr) -> str:
    """The element type of a tensor-typed Relax expression, as a numpy dtype name."""
    return str(expr.ty.dtype)


def prim(expr) -> float:
    """A prim value (IntImm, FloatImm) or scalar constant as a Python number."""
    if isinstance(expr, PRIM_TYPES):
        return float(expr.value)
    if isinstance(expr, Constant):
        value = constant_value(expr)
        if value.size != 1:
            raise LoweringError(f"expected a constant scalar, got a constant of shape {list(value.shape)}")
        return float(value.reshape(()))
    raise LoweringError(f"expected a constant scalar, got {type(expr).__name__}")


def _ints(values) -> list:
    return [int(v) for v in values]


@dataclass(frozen=True)
class RelaxOp:
    """One Relax op lpx runs.

    Parameters
    ----------
    op : str
        The Relax op name without ``relax.`` (``"nn.relu"``).
    lower : callable
        ``(lowerer, call, lowered args, layer name) -> tensor id`` (or a tuple of them).
    arity : int
        Operands of its single-op pattern (wildcards).
    unsupported : callable, optional
        ``(call) -> str | None``: why lpx cannot run this call's attributes, or None.
    weights : tuple of int
        Operand positions that must be weights (constants, or integers a QDQ model dequantises).
    """

    op: str
    lower: Callable
    arity: int = 1
    unsupported: Callable | None = None
    weights: tuple = ()

    @property
    def pattern_name(self) -> str:
        return "lpx." + self.op.removeprefix("nn.")


@dataclass(frozen=True)
class RelaxPattern:
    """A multi-op Relax idiom lpx runs as one operator.

    ``build()`` gives the dataflow pattern; ``matches(calls)`` checks the matched
    calls' constants (a pattern can only say "a constant"); ``lower(lowerer,
    composite function, args, layer)`` lowers the whole composite to one node.
    """

    name: str
    build: Callable
    matches: Callable
    lower: Callable


# ---------------------------------------------------------------------------
# lowering rules: (lowerer, call, lowered args, layer name) -> tensor id
# ---------------------------------------------------------------------------
def elementwise(opcode: Opcode, numpy_fn=None, attrs_of=lambda call: {}):
    """A rule for one elementwise opcode; operands that are all constants fold in numpy instead."""
    def rule(lw, call, args, layer):
        tensors = [a for a in args if isinstance(a, int)]
        values = [lw.const_value(a) for a in tensors]
        if numpy_fn is not None and values and all(v is not None for v in values):
            values = [v.astype(np.float32) if v.dtype == np.float16 else v for v in values]  # fp32 arithmetic
            return lw.graph.constant(np.asarray(numpy_fn(*values)).astype(dtype_of(call)))
        return lw.node(opcode.name, tensors, call, layer, **attrs_of(call))
    return rule


def _conv2d(lw, call, args, layer):
    a = call.attrs
    return lw.node(NodeKind.CONV2D, args, call, layer, strides=_ints(a.strides), padding=_ints(a.padding),
                   dilation=_ints(a.dilation), groups=int(a.groups), act=Opcode.NOP, act_args=(0.0, 0.0))


def _conv1d(lw, call, args, layer):
    """A 1-D convolution (Whisper's, wav2vec's) is a 2-D one over a single row: [N, C, W] as [N, C, 1, W]."""
    a = call.attrs
    x, w = args[0], args[1]
    n, c, width = lw.graph.tensors[x].shape
    o, cg, k = lw.graph.tensors[w].shape
    (left, right) = _ints(a.padding)
    out = shape_of(call)
    node = lw.graph.add_node(NodeKind.CONV2D, [lw.alias(x, (n, c, 1, width)), lw.alias(w, (o, cg, 1, k))],
                             out[:2] + (1, out[2]), dtype_of(call), layer, strides=(1, _ints(a.strides)[0]),
                             padding=(0, left, 0, right), dilation=(1, _ints(a.dilation)[0]), groups=int(a.groups),
                             act=Opcode.NOP, act_args=(0.0, 0.0))
    return lw.alias(node, out)


def _conv1d_unsupported(call):
    a = call.attrs
    if (a.data_layout, a.kernel_layout, a.out_layout) != ("NCW", "OIW", "NCW"):
        return f"layout {a.data_layout}/{a.kernel_layout}/{a.out_layout} is not NCW/OIW/NCW"
    return _out_dtype_unsupported(call)


def _matmul(lw, call, args, layer):
    """numpy matmul semantics: a 1-D operand gains a unit axis for the product, which is dropped after."""
    a_shape, b_shape = (lw.graph.tensors[t].shape for t in args)
    a = lw.alias(args[0], (1,) + a_shape) if len(a_shape) == 1 else args[0]
    b = lw.alias(args[1], b_shape + (1,)) if len(b_shape) == 1 else args[1]
    if len(a_shape) > 1 and len(b_shape) > 1:
        return lw.node(NodeKind.MATMUL, [a, b], call, layer, act=Opcode.NOP, act_args=(0.0, 0.0))
    a_full, b_full = lw.graph.tensors[a].shape, lw.graph.tensors[b].shape
    batch = tuple(np.broadcast_shapes(a_full[:-2], b_full[:-2]))
    out = lw.graph.add_node(NodeKind.MATMUL, [a, b], batch + (a_full[-2], b_full[-1]), dtype_of(call), layer,
                            act=Opcode.NOP, act_args=(0.0, 0.0))
    return lw.alias(out, shape_of(call))


def _batch_norm(lw, call, args, layer):
    """Inference batch norm as a per-channel scale and shift (``fuse`` folds them into a conv before it)."""
    x, gamma, beta, mean, var = args
    values = [lw.const_value(t) for t in (gamma, beta, mean, var)]
    if any(v is None for v in values):
        raise LoweringError("batch_norm needs constant parameters")
    gamma, beta, mean, var = (v.astype(np.float64) for v in values)
    a = call.attrs
    gamma = gamma if a.scale else np.ones_like(gamma)
    beta = beta if a.center else np.zeros_like(beta)
    scale = gamma / np.sqrt(var + float(a.epsilon))
    shift = beta - mean * scale
    shape = shape_of(call.args[0])
    axis = int(a.axis) % len(shape)
    bshape = [1] * len(shape)
    bshape[axis] = shape[axis]
    g = lw.graph
    s = g.constant(scale.astype(np.float32).reshape(bshape))
    t = g.constant(shift.astype(np.float32).reshape(bshape))
    scaled = g.add_node("MUL", [x, s], shape, "float32", layer)
    # inference-mode batch_norm returns the moving statistics unchanged
    return (g.add_node("ADD", [scaled, t], shape, "float32", layer), g.constant(values[2]), g.constant(values[3]))


def _pool(opcode: Opcode):
    def rule(lw, call, args, layer):
        a = call.attrs
        in_shape, out_shape = shape_of(call.args[0]), shape_of(call)
        (kh, kw), (sh, sw), (dh, dw) = _ints(a.pool_size), _ints(a.strides), _ints(a.dilation)
        pt, pl, pb, pr = _ints(a.padding)
        # ceil_mode: grow the bottom/right padding until the floor formula gives the ceil size
        pb += max(0, (out_shape[2] - 1) * sh + (kh - 1) * dh + 1 - (in_shape[2] + pt + pb))
        pr += max(0, (out_shape[3] - 1) * sw + (kw - 1) * dw + 1 - (in_shape[3] + pl + pr))
        attrs = dict(kernel=(kh, kw), stride=(sh, sw), pad=(pt, pl, pb, pr), dilation=(dh, dw))
        if opcode == Opcode.AVGPOOL:
            attrs["count_include_pad"] = bool(a.count_include_pad)
        return lw.node(opcode.name, args, call, layer, **attrs)
    return rule


def _channel_avg_pool3d(lw, call, args, layer):
    """avg_pool3d with a (k, 1, 1) window (ONNX LRN): a 2-D AVGPOOL over [N·C, 1, D, H·W]."""
    a = call.attrs
    n, c, d, h, w = shape_of(call.args[0])
    flat = lw.alias(args[0], (n * c, 1, d, h * w))
    pooled = lw.graph.add_node("AVGPOOL", [flat], (n * c, 1, shape_of(call)[2], h * w), dtype_of(call), layer,
                               kernel=(int(a.pool_size[0]), 1), pad=(int(a.padding[0]), 0, int(a.padding[3]), 0),
                               count_include_pad=bool(a.count_include_pad))
    return lw.alias(pooled, shape_of(call))


def _global_avg_pool(lw, call, args, layer):
    return lw.node("REDUCE_MEAN", args, call, layer, axes=(2, 3))


def _reduce(opcode: Opcode):
    def rule(lw, call, args, layer):
        rank = len(shape_of(call.args[0]))
        axes = range(rank) if call.attrs.axis is None else [int(x) % rank for x in call.attrs.axis]
        return lw.node(opcode.name, args, call, layer, axes=tuple(sorted(axes)))
    return rule


def _softmax(lw, call, args, layer):
    return lw.node("SOFTMAX", args, call, layer, axis=int(call.attrs.axis) % len(shape_of(call)))


def _layer_norm(lw, call, args, layer):
    x, gamma, beta = args
    width = shape_of(call.args[1])
    if not call.attrs.scale:
        gamma = lw.graph.constant(np.ones(width, np.float32))
    if not call.attrs.center:
        beta = lw.graph.constant(np.zeros(width, np.float32))
    return lw.node("LAYERNORM", [x, gamma, beta], call, layer, eps=float(call.attrs.epsilon),
                   n_axes=len(call.attrs.axes))


def _reshape(lw, call, args, layer):
    return lw.alias(args[0], shape_of(call))


def _permute(lw, call, args, layer):
    rank = len(shape_of(call))
    perm = list(range(rank))[::-1] if call.attrs.axes is None else _ints(call.attrs.axes)
    value = lw.const_value(args[0])
    if value is not None:
        from .alloc import current_held

        g = lw.graph
        held = current_held()
        transposed = lambda v: np.ascontiguousarray(v.transpose(perm))  # noqa: E731
        # a held weight's transpose (a tied head) is made once and held too: every program over these
        # weights names that one array
        folded = held.derived(value, ("transpose", *perm), transposed) if held is not None else transposed(value)
        tid = g.constant(folded, dtype_of(call))
        if args[0] in g.quantized:  # a transposed quantised weight (Gemm's transB) keeps its integers
            g.quantized[tid] = tuple(np.ascontiguousarray(part.transpose(perm)) for part in g.quantized[args[0]])
        return tid
    return lw.node("TRANSPOSE", args[:1], call, layer, perm=tuple(perm))


def _scalar(lw, tid, what: str) -> float:
    value = lw.const_value(tid)
    if value is None or value.size != 1:
        raise LoweringError(f"{what} must be one constant number on lpx (per-tensor quantisation)")
    return float(value.reshape(()))


def axis_params(data: np.ndarray, scale, zero_point, axis: int) -> tuple:
    """Scale and zero point as fp32 arrays of ``data``'s rank, per-channel along ``axis`` (or scalars)."""
    axis = axis % max(data.ndim, 1)
    shaped = []
    for value in (np.asarray(scale, np.float32), np.asarray(zero_point, np.float32)):
        shape = [1] * data.ndim
        if value.size > 1:
            shape[axis] = value.size
        shaped.append(value.reshape(shape))
    return tuple(shaped)


def quantize_array(data: np.ndarray, scale, zero_point, axis: int, dtype: str) -> np.ndarray:
    """ONNX QuantizeLinear in numpy: saturate(rint(x / scale) + zero_point)."""
    s, z = axis_params(data, scale, zero_point, axis)
    info = np.iinfo(np.dtype(dtype))
    return np.clip(np.rint(data.astype(np.float32) / s) + z, info.min, info.max).astype(dtype)


def _dequantize(lw, call, args, layer):
    x, scale, zero_point = args
    data = lw.const_value(x)
    if data is not None:  # a weight: fold to float, and keep the integers for int8 kernels
        s, z = axis_params(data, lw.const_value(scale), lw.const_value(zero_point), int(call.attrs.axis))
        tid = lw.graph.constant(((data.astype(np.float32) - z) * s).astype(np.float32))
        lw.graph.quantized[tid] = (data, s, z)
        return tid
    return lw.node("DEQUANTIZE", [x], call, layer, scale=_scalar(lw, scale, "dequantize scale"),
                   zero_point=_scalar(lw, zero_point, "dequantize zero point"))


def _quantize(lw, call, args, layer):
    x, scale, zero_point = args
    data = lw.const_value(x)
    if data is not None:  # a constant the quantiser left in float (a concat operand, say): fold it here
        return lw.graph.constant(quantize_array(data, lw.const_value(scale), lw.const_value(zero_point),
                                                int(call.attrs.axis), dtype_of(call)))
    return lw.node("QUANTIZE", [x], call, layer, scale=_scalar(lw, scale, "quantize scale"),
                   zero_point=_scalar(lw, zero_point, "quantize zero point"))


def _concat(lw, call, args, layer):
    return lw.node("CONCAT", list(args[0]), call, layer, axis=int(call.attrs.axis) % len(shape_of(call)))


def _slice_bounds(call, shape) -> tuple:
    """``(begin, step)`` on every axis of a strided_slice (numpy's clamping, as ONNX Slice defines it)."""
    axes, begin, end = ([int(v) for v in call.args[k].fields] for k in (1, 2, 3))
    strides = [int(v) for v in call.args[4].fields] if len(call.args) > 4 else [1] * len(axes)
    first, step = [0] * len(shape), [1] * len(shape)
    for axis, b, e, s in zip(axes, begin, end, strides):
        axis %= len(shape)
        first[axis], _, step[axis] = slice(b, e, s).indices(shape[axis])
    return tuple(first), tuple(step)


def _strided_slice(lw, call, args, layer):
    begin, step = _slice_bounds(call, lw.graph.tensors[args[0]].shape)
    value = lw.const_value(args[0])
    out = shape_of(call)
    if value is not None:
        index = tuple(slice(b, b + s * n, s) for b, s, n in zip(begin, step, out))
        return lw.graph.constant(np.ascontiguousarray(value[index]), dtype_of(call))
    return lw.node("SLICE", args[:1], call, layer, begin=begin, step=step)


def _strided_slice_unsupported(call):
    if not all(isinstance(a, relax.Tuple) and all(isinstance(v, IntImm) for v in a.fields) for a in call.args[1:]):
        return "strided_slice with bounds known only at run time"
    if len(call.args) > 4 and any(int(v) <= 0 for v in call.args[4].fields):
        return "strided_slice with a negative or zero step"
    return None


def _broadcast_to(lw, call, args, layer):
    """numpy's broadcast_to: a constant is broadcast here; a tensor becomes a ``broadcast`` node, one COPY
    reading it with stride 0 on the axes it repeats (GQA's K/V heads for each query head, a mask for each)."""
    out = shape_of(call)
    value = lw.const_value(args[0])
    if value is not None:
        return lw.graph.constant(np.ascontiguousarray(np.broadcast_to(value, out)), dtype_of(call))
    return lw.node(NodeKind.BROADCAST, args[:1], call, layer)


def _broadcast_to_unsupported(call):
    if not isinstance(call.args[1], relax.ShapeExpr) or not all(isinstance(v, IntImm) for v in call.args[1].values):
        return "broadcast_to a shape known only at run time"
    return None


def _astype(lw, call, args, layer):
    value = lw.const_value(args[0])
    if value is not None:  # (an fp16 weight widened to fp32 keeps its fp16 data: Graph.constant)
        return lw.graph.constant(value, dtype_of(call))
    if np.dtype(dtype_of(call)) == lw.graph.tensors[args[0]].dtype:
        return args[0]
    return lw.node("CAST", args, call, layer)


# ---------------------------------------------------------------------------
# attribute checks: why lpx cannot run a call as written (None: it can)
# ---------------------------------------------------------------------------
def _conv2d_unsupported(call):
    a = call.attrs
    if (a.data_layout, a.kernel_layout, a.out_layout) != ("NCHW", "OIHW", "NCHW"):
        return f"layout {a.data_layout}/{a.kernel_layout}/{a.out_layout} is not NCHW/OIHW/NCHW"
    return _out_dtype_unsupported(call)


def _out_dtype_unsupported(call):
    out_dtype = str(getattr(call.attrs, "out_dtype", "") or "")
    return None if out_dtype in ("", "void", "float32") else f"out_dtype {out_dtype}"


def _pool_unsupported(call):
    a = call.attrs
    if a.layout != "NCHW" or a.out_layout != "NCHW":
        return f"layout {a.layout}"
    if call.op.name == "relax.nn.avg_pool2d" and a.ceil_mode:
        return "avg_pool2d with ceil_mode"
    return None


def _channel_pool_unsupported(call):
    """Only a window along channels (ONNX LRN's import) runs on lpx."""
    a = call.attrs
    window_on_channels_only = (
        a.layout == "NCDHW" and a.out_layout == "NCDHW" and not a.ceil_mode
        and _ints(a.pool_size)[1:] == [1, 1] and _ints(a.strides) == [1, 1, 1] and _ints(a.dilation) == [1, 1, 1]
        and _ints(a.padding)[1:3] + _ints(a.padding)[4:] == [0, 0, 0, 0])
    return None if window_on_channels_only else "avg_pool3d other than a window over channels"


def _global_pool_unsupported(call):
    a = call.attrs
    if a.layout != "NCHW" or (a.out_layout and a.out_layout != "NCHW"):
        return f"layout {a.layout}"
    return None if shape_of(call)[2:] == (1, 1) else "adaptive_avg_pool2d to more than 1x1"


def _batch_norm_unsupported(call):
    return "batch_norm in training mode (it normalises with the batch's own statistics)" \
        if bool(call.attrs.training) else None


def _layer_norm_unsupported(call):
    rank = len(shape_of(call))
    axes = sorted(int(x) % rank for x in call.attrs.axes)
    return None if axes == list(range(rank - len(axes), rank)) else "layer_norm over non-trailing axes"


def _quant_unsupported(call):
    x, scale, zero_point = call.args
    if not (isinstance(scale, Constant) and isinstance(zero_point, Constant)):
        return "quantisation parameters that are not constants"
    per_tensor = constant_value(scale).size == 1 and constant_value(zero_point).size == 1
    return None if per_tensor or isinstance(x, Constant) else "per-channel quantisation of an activation"


def _clip_unsupported(call):
    try:
        prim(call.args[1]), prim(call.args[2])
    except LoweringError:
        return "clip bounds that are not constants"
    return None


def _clip_attrs(call):
    return {"lo": prim(call.args[1]), "hi": prim(call.args[2])}


RELAX_OPS = {row.op: row for row in [
    RelaxOp("add", elementwise(Opcode.ADD, np.add), 2),
    RelaxOp("subtract", elementwise(Opcode.SUB, np.subtract), 2),
    RelaxOp("multiply", elementwise(Opcode.MUL, np.multiply), 2),
    RelaxOp("divide", elementwise(Opcode.DIV, np.divide), 2),
    RelaxOp("maximum", elementwise(Opcode.MAXIMUM, np.maximum), 2),
    RelaxOp("minimum", elementwise(Opcode.MINIMUM, np.minimum), 2),
    RelaxOp("power", elementwise(Opcode.POW, np.power), 2),
    RelaxOp("nn.relu", elementwise(Opcode.RELU)),
    RelaxOp("nn.leakyrelu", elementwise(Opcode.LEAKY_RELU, attrs_of=lambda call: {"alpha": float(call.attrs.alpha)})),
    RelaxOp("clip", elementwise(Opcode.CLIP, attrs_of=_clip_attrs), 3, _clip_unsupported),
    RelaxOp("nn.gelu", elementwise(Opcode.GELU)),
    RelaxOp("exp", elementwise(Opcode.EXP, np.exp)),
    RelaxOp("erf", elementwise(Opcode.ERF)),
    RelaxOp("tanh", elementwise(Opcode.TANH, np.tanh)),
    RelaxOp("sin", elementwise(Opcode.SIN, np.sin)),
    RelaxOp("cos", elementwise(Opcode.COS, np.cos)),
    RelaxOp("sigmoid", elementwise(Opcode.SIGMOID)),
    RelaxOp("sqrt", elementwise(Opcode.SQRT, np.sqrt)),
    RelaxOp("rsqrt", elementwise(Opcode.RSQRT, lambda x: 1 / np.sqrt(x))),
    RelaxOp("negative", elementwise(Opcode.NEG, np.negative)),
    RelaxOp("nn.max_pool2d", _pool(Opcode.MAXPOOL), 1, _pool_unsupported),
    RelaxOp("nn.avg_pool2d", _pool(Opcode.AVGPOOL), 1, _pool_unsupported),
    RelaxOp("nn.avg_pool3d", _channel_avg_pool3d, 1, _channel_pool_unsupported),
    RelaxOp("nn.adaptive_avg_pool2d", _global_avg_pool, 1, _global_pool_unsupported),
    RelaxOp("mean", _reduce(Opcode.REDUCE_MEAN)),
    RelaxOp("sum", _reduce(Opcode.REDUCE_SUM)),
    RelaxOp("max", _reduce(Opcode.REDUCE_MAX)),
    RelaxOp("nn.softmax", _softmax),
    RelaxOp("nn.layer_norm", _layer_norm, 3, _layer_norm_unsupported, weights=(1, 2)),
    RelaxOp("reshape", _reshape, 2),
    RelaxOp("flatten", _reshape),
    RelaxOp("squeeze", _reshape),
    RelaxOp("expand_dims", _reshape),
    RelaxOp("permute_dims", _permute),
    RelaxOp("concat", _concat),
    RelaxOp("strided_slice", _strided_slice, 5, _strided_slice_unsupported),
    RelaxOp("astype", _astype),
    RelaxOp("broadcast_to", _broadcast_to, 2, _broadcast_to_unsupported),
    RelaxOp("quantize", _quantize, 3, _quant_unsupported, weights=(1, 2)),
    RelaxOp("dequantize", _dequantize, 3, _quant_unsupported, weights=(1, 2)),
    # last: a later single-op pattern wins, and these take their (dequantised) weights with them
    RelaxOp("nn.batch_norm", _batch_norm, 5, _batch_norm_unsupported, weights=(1, 2, 3, 4)),
    RelaxOp("matmul", _matmul, 2, _out_dtype_unsupported),
    RelaxOp("nn.conv2d", _conv2d, 2, _conv2d_unsupported, weights=(1,)),
    RelaxOp("nn.conv1d", _conv1d, 2, _conv1d_unsupported, weights=(1,)),
]}


# ---------------------------------------------------------------------------
# multi-op idioms
# ---------------------------------------------------------------------------
def _hard_swish_pattern():
    """x · clip(x + 3, 0, 6) / 6, as TVM's importer writes ONNX HardSwish."""
    from tvm.relax.dpl import is_const, is_op, wildcard

    x = wildcard()
    gate = is_op("relax.clip")(is_op("relax.add")(x, is_const()), wildcard(), wildcard())
    return is_op("relax.multiply")(x, is_op("relax.divide")(gate, is_const()))


def _hard_swish_lower(lw, func, args, layer):
    return lw.graph.add_node("HARD_SWISH", args[:1], shape_of(func.body), dtype_of(func.body), layer)


def _hard_swish_matches(calls) -> bool:
    """The constants really are 3, (0, 6) and 6 (the pattern only says "a constant")."""
    def scalar(expr):
        try:
            return prim(expr)
        except LoweringError:
            return None
    by_op = {c.op.name: c for c in calls}
    try:
        return (scalar(by_op["relax.add"].args[1]) == 3.0 and scalar(by_op["relax.divide"].args[1]) == 6.0
                and (scalar(by_op["relax.clip"].args[1]), scalar(by_op["relax.clip"].args[2])) == (0.0, 6.0))
    except KeyError:
        return False


def _gelu_pattern():
    """x · 0.5 · (1 + erf(x / √2)), as PyTorch's exporter (and Hugging Face's BERT) writes the erf GELU; the
    division may be a product by 1/√2, and either multiplication and the addition may have their operands
    either way round."""
    from tvm.relax.dpl import is_const, is_op, wildcard

    def either(op, a, b):
        return is_op(op)(a, b) | is_op(op)(b, a)

    x = wildcard()
    scaled = is_op("relax.divide")(x, is_const()) | either("relax.multiply", x, is_const())
    one_plus = either("relax.add", is_op("relax.erf")(scaled), is_const())
    return either("relax.multiply", either("relax.multiply", x, is_const()), one_plus)


def _gelu_lower(lw, func, args, layer):
    return lw.graph.add_node("GELU", args[:1], shape_of(func.body), dtype_of(func.body), layer)


def _gelu_matches(calls) -> bool:
    """The constants really are √2 (or a product by 1/√2), 1 and 0.5 (the pattern only says "a constant")."""
    def constants(op):
        found = []
        for call in calls:
            if call.op.name == op:
                for arg in call.args:
                    try:
                        found.append(prim(arg))
                    except LoweringError:
                        pass
        return sorted(found)
    if sum(c.op.name == "relax.erf" for c in calls) != 1 or constants("relax.add") != [1.0]:
        return False
    divided, multiplied = constants("relax.divide"), constants("relax.multiply")
    if divided:
        return np.isclose(divided, [np.sqrt(2.0)], rtol=1e-6).all() and multiplied == [0.5]
    return len(multiplied) == 2 and np.isclose(multiplied, [0.5, 1 / np.sqrt(2.0)], rtol=1e-6).all()


def _nan_to_num_pattern():
    """where(isnan(x), c, y): PyTorch's safe softmax, as torch.export writes it after every softmax (y is x; in
    a QDQ model, y is x quantised and dequantised)."""
    from tvm.relax.dpl import is_const, is_op, wildcard

    return is_op("relax.where")(is_op("relax.isnan")(wildcard()), is_const(), wildcard())


def _nan_to_num_value(calls):
    (where,) = [c for c in calls if c.op.name == "relax.where"]
    return prim(where.args[1])


def _nan_to_num_matches(calls) -> bool:
    try:
        return np.isfinite(_nan_to_num_value(calls))
    except (LoweringError, ValueError):
        return False


def _nan_to_num_lower(lw, func, args, layer):
    calls = []
    relax.analysis.post_order_visit(func.body, lambda e: calls.append(e) if isinstance(e, relax.Call) else None)
    where = next(c for c in calls if c.op.name == "relax.where")
    isnan = next(c for c in calls if c.op.name == "relax.isnan")
    params = list(func.params)
    tested, chosen = (args[params.index(v)] for v in (isnan.args[0], where.args[2]))
    value = float(_nan_to_num_value(calls))
    if tested == chosen:
        return lw.graph.add_node("NAN_TO_NUM", [tested], shape_of(func.body), dtype_of(func.body), layer, value=value)
    return lw.graph.add_node("NAN_SELECT", [tested, chosen], shape_of(func.body), dtype_of(func.body), layer,
                             value=value)


RELAX_PATTERNS = {row.name: row for row in [
    RelaxPattern("lpx.hard_swish", _hard_swish_pattern, _hard_swish_matches, _hard_swish_lower),
    RelaxPattern("lpx.gelu_erf", _gelu_pattern, _gelu_matches, _gelu_lower),
    RelaxPattern("lpx.nan_to_num", _nan_to_num_pattern, _nan_to_num_matches, _nan_to_num_lower),
]}
