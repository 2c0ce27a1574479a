"""lower: a Relax function offloaded to lpx ─► LPX operator graph.

One table maps each Relax op to a lowering rule. Composite functions are inlined;
constant sub-expressions (a reshaped bias, a transposed weight) are folded here
in numpy; batch norm becomes a per-channel scale and shift, which ``fuse`` then
folds into the convolution before it. After this step nothing refers to TVM.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.ir.prim.expr import FloatImm, IntImm

# TVM 0.27 names: constants are tvm.ir.Constant (data in .value), prim values are IntImm/FloatImm
Constant = tvm.ir.Constant
PRIM_TYPES = (IntImm, FloatImm)


def constant_value(expr) -> np.ndarray:
    """The numpy data of a Relax constant."""
    return expr.value.numpy()

from ..runtime_sim import Opcode
from .graph import Graph


class LoweringError(ValueError):
    """A Relax construct the LPX codegen cannot lower."""


def _shape_of(expr) -> tuple:
    sinfo = expr.ty
    if not isinstance(sinfo, relax.TensorType) or sinfo.shape is None:
        raise LoweringError(f"expected a tensor with a known shape, got {sinfo}")
    try:
        return tuple(int(d) for d in sinfo.shape.values)
    except TypeError:
        raise LoweringError(f"dynamic shape {sinfo.shape} cannot run on lpx") from None


def _ints(values) -> list:
    return [int(v) for v in values]


def _prim(expr) -> float:
    """A relax.PrimValue or scalar constant as a Python number."""
    if isinstance(expr, PRIM_TYPES):
        return float(expr.value)
    if isinstance(expr, Constant):
        return float(constant_value(expr))
    raise LoweringError(f"expected a constant scalar, got {type(expr).__name__}")


class _Lowerer:
    def __init__(self, func_name: str):
        self.graph = Graph()
        self.func_name = func_name
        self.counter = 0

    # ---- expression walking -------------------------------------------
    def function(self, func: relax.Function, args: list) -> object:
        env = dict(zip(func.params, args))
        return self.expr(func.body, env)

    def expr(self, expr, env):
        if isinstance(expr, relax.SeqExpr):
            for block in expr.blocks:
                for binding in block.bindings:
                    env[binding.var] = self.expr(binding.value, env)
            return self.expr(expr.body, env)
        if isinstance(expr, relax.Var):
            return env[expr]
        if isinstance(expr, PRIM_TYPES + (relax.ShapeExpr,)):  # before Constant: IntImm subclasses it in 0.27
            return expr
        if isinstance(expr, Constant):
            return self.graph.constant(constant_value(expr))
        if isinstance(expr, relax.Tuple):
            return tuple(self.expr(f, env) for f in expr.fields)
        if isinstance(expr, relax.TupleGetItem):
            return self.expr(expr.tuple_value, env)[expr.index]
        if isinstance(expr, relax.Function):
            return expr
        if isinstance(expr, relax.Call):
            callee = expr.op
            if isinstance(callee, relax.Var):  # call of a composite function bound in this body
                return self.function(env[callee], [self.expr(a, env) for a in expr.args])
            if isinstance(callee, relax.Function):
                return self.function(callee, [self.expr(a, env) for a in expr.args])
            rule = RULES.get(callee.name)
            if rule is None:
                raise LoweringError(f"{callee.name} has no LPX lowering")
            self.counter += 1
            layer = f"{self.func_name}/{callee.name.removeprefix('relax.')}_{self.counter}"
            return rule(self, expr, [self.expr(a, env) for a in expr.args], layer)
        raise LoweringError(f"cannot lower {type(expr).__name__}")

    # ---- helpers for rules --------------------------------------------
    def const_value(self, tid):
        t = self.graph.tensors[self.graph.base(tid)]
        return None if t.data is None else t.data.reshape(self.graph.tensors[tid].shape)

    def node(self, kind, inputs, call, layer, **attrs) -> int:
        sinfo = call.ty
        return self.graph.add_node(kind, inputs, _shape_of(call), sinfo.dtype, layer, **attrs)

    def alias(self, tid, shape) -> int:
        t = self.graph.tensors[tid]
        if t.data is not None:
            return self.graph.constant(t.data.reshape(shape))
        return self.graph.add_tensor(shape, t.dtype, alias_of=tid)


# ---------------------------------------------------------------------------
# rules: (lowerer, call, lowered args, layer name) -> tensor id
# ---------------------------------------------------------------------------
def _elementwise(opcode: Opcode, numpy_fn):
    def rule(lw: _Lowerer, call, args, layer):
        tensors = [a for a in args if isinstance(a, int)]
        values = [lw.const_value(a) for a in tensors]
        if all(v is not None for v in values) and numpy_fn is not None:
            return lw.graph.constant(np.asarray(numpy_fn(*values)).astype(call.ty.dtype))
        attrs = {}
        if opcode == Opcode.CLIP:
            attrs["lo"], attrs["hi"] = _prim(call.args[1]), _prim(call.args[2])
        return lw.node(opcode.name, tensors, call, layer, **attrs)
    return rule


def _conv2d(lw, call, args, layer):
    a = call.attrs
    if a.data_layout != "NCHW" or a.kernel_layout != "OIHW":
        raise LoweringError(f"conv2d layout {a.data_layout}/{a.kernel_layout} is not NCHW/OIHW")
    return lw.node("conv2d", args, call, layer, strides=_ints(a.strides), padding=_ints(a.padding),
                   dilation=_ints(a.dilation), groups=int(a.groups), act=Opcode.NOP, act_args=(0.0, 0.0))


def _matmul(lw, call, args, layer):
    return lw.node("matmul", args, call, layer, act=Opcode.NOP, act_args=(0.0, 0.0))


def _batch_norm(lw, call, args, layer):
    x, gamma, beta, mean, var = args
    values = [lw.const_value(t) for t in (gamma, beta, mean, var)]
    if any(v is None for v in values):
        raise LoweringError("batch_norm needs constant parameters")
    gamma, beta, mean, var = values
    axis = int(call.attrs.axis)
    scale = gamma / np.sqrt(var + np.float32(call.attrs.epsilon))
    shift = beta - mean * scale
    shape = _shape_of(call.args[0])
    bshape = [1] * len(shape)
    bshape[axis] = shape[axis]
    g = lw.graph
    s = g.constant(scale.astype(np.float32).reshape(bshape))
    t = g.constant(shift.astype(np.float32).reshape(bshape))
    scaled = g.add_node("MUL", [x, s], shape, "float32", layer)
    # inference-mode batch_norm returns the moving statistics unchanged
    return (g.add_node("ADD", [scaled, t], shape, "float32", layer), g.constant(mean), g.constant(var))


def _pool(opcode):
    def rule(lw, call, args, layer):
        a = call.attrs
        if a.layout != "NCHW" or a.out_layout != "NCHW":
            raise LoweringError("pooling must be NCHW")
        in_shape, out_shape = _shape_of(call.args[0]), _shape_of(call)
        kh, kw = _ints(a.pool_size)
        sh, sw = _ints(a.strides)
        dh, dw = _ints(a.dilation)
        pt, pl, pb, pr = _ints(a.padding)
        # ceil_mode: grow the bottom/right padding until the floor formula gives the ceil size
        pb += max(0, (out_shape[2] - 1) * sh + (kh - 1) * dh + 1 - (in_shape[2] + pt + pb))
        pr += max(0, (out_shape[3] - 1) * sw + (kw - 1) * dw + 1 - (in_shape[3] + pl + pr))
        include = int(bool(getattr(a, "count_include_pad", False)))
        return lw.node(opcode.name, args, call, layer, window=(kh, kw, sh, sw, pt, pl, pb, pr, dh, dw, include))
    return rule


def _channel_avg_pool3d(lw, call, args, layer):
    """avg_pool3d with a (k, 1, 1) window (ONNX LRN): a 2-D AVGPOOL over [N·C, 1, D, H·W]."""
    a = call.attrs
    n, c, d, h, w = _shape_of(call.args[0])
    k = int(a.pool_size[0])
    front, back = int(a.padding[0]), int(a.padding[3])
    flat = lw.alias(args[0], (n * c, 1, d, h * w))
    include = int(bool(a.count_include_pad))
    pooled = lw.graph.add_node("AVGPOOL", [flat], (n * c, 1, _shape_of(call)[2], h * w), call.ty.dtype, layer,
                               window=(k, 1, 1, 1, front, 0, back, 0, 1, 1, include))
    return lw.alias(pooled, _shape_of(call))


def _adaptive_avg_pool(lw, call, args, layer):
    out = _shape_of(call)
    if out[2:] != (1, 1) or call.attrs.layout != "NCHW":
        raise LoweringError("adaptive_avg_pool2d runs on lpx only as a global pool")
    return lw.node("REDUCE_MEAN", args, call, layer, axes=(2, 3))


def _reduce(opcode):
    def rule(lw, call, args, layer):
        rank = len(_shape_of(call.args[0]))
        axes = range(rank) if call.attrs.axis is None else [int(x) % rank for x in call.attrs.axis]
        return lw.node(opcode.name, args, call, layer, axes=tuple(sorted(axes)))
    return rule


def _softmax(lw, call, args, layer):
    rank = len(_shape_of(call))
    return lw.node("SOFTMAX", args, call, layer, axis=int(call.attrs.axis) % rank)


def _layer_norm(lw, call, args, layer):
    rank = len(_shape_of(call))
    axes = sorted(int(x) % rank for x in call.attrs.axes)
    if axes != list(range(rank - len(axes), rank)):
        raise LoweringError("layer_norm must normalise trailing axes")
    return lw.node("LAYERNORM", args, call, layer, eps=float(call.attrs.epsilon), n_axes=len(axes))


def _reshape(lw, call, args, layer):
    return lw.alias(args[0], _shape_of(call))


def _permute(lw, call, args, layer):
    rank = len(_shape_of(call))
    perm = list(range(rank))[::-1] if call.attrs.axes is None else _ints(call.attrs.axes)
    value = lw.const_value(args[0])
    if value is not None:
        g = lw.graph
        tid = g.constant(np.ascontiguousarray(value.transpose(perm)))
        if args[0] in g.quantized:  # a transposed quantised weight (Gemm's transB) keeps its integers
            g.quantized[tid] = tuple(np.ascontiguousarray(part.transpose(perm)) for part in g.quantized[args[0]])
        return tid
    return lw.node("TRANSPOSE", args[:1], call, layer, perm=tuple(perm))


def _scalar(lw, tid, what: str) -> float:
    value = lw.const_value(tid)
    if value is None or value.size != 1:
        raise LoweringError(f"{what} must be one constant number on lpx (per-tensor quantisation)")
    return float(value.reshape(()))


def _axis_params(data: np.ndarray, scale, zero_point, axis: int) -> tuple:
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
    s, z = _axis_params(data, scale, zero_point, axis)
    info = np.iinfo(np.dtype(dtype))
    return np.clip(np.rint(data.astype(np.float32) / s) + z, info.min, info.max).astype(dtype)


def _dequantize(lw, call, args, layer):
    x, scale, zero_point = args
    data = lw.const_value(x)
    if data is not None:  # a weight: fold to float, and keep the integers for int8 kernels
        s, z = _axis_params(data, lw.const_value(scale), lw.const_value(zero_point), int(call.attrs.axis))
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
                                                int(call.attrs.axis), str(call.ty.dtype)))
    return lw.node("QUANTIZE", [x], call, layer, scale=_scalar(lw, scale, "quantize scale"),
                   zero_point=_scalar(lw, zero_point, "quantize zero point"))


def _concat(lw, call, args, layer):
    rank = len(_shape_of(call))
    return lw.node("CONCAT", list(args[0]), call, layer, axis=int(call.attrs.axis) % rank)


def _astype(lw, call, args, layer):
    if np.dtype(call.ty.dtype) == lw.graph.tensors[args[0]].dtype:
        return args[0]
    return lw.node("CAST", args, call, layer)


RULES = {
    "relax.nn.conv2d": _conv2d,
    "relax.matmul": _matmul,
    "relax.nn.batch_norm": _batch_norm,
    "relax.add": _elementwise(Opcode.ADD, np.add),
    "relax.subtract": _elementwise(Opcode.SUB, np.subtract),
    "relax.multiply": _elementwise(Opcode.MUL, np.multiply),
    "relax.divide": _elementwise(Opcode.DIV, np.divide),
    "relax.maximum": _elementwise(Opcode.MAXIMUM, np.maximum),
    "relax.minimum": _elementwise(Opcode.MINIMUM, np.minimum),
    "relax.power": _elementwise(Opcode.POW, np.power),
    "relax.nn.relu": _elementwise(Opcode.RELU, None),
    "relax.clip": _elementwise(Opcode.CLIP, None),
    "relax.nn.gelu": _elementwise(Opcode.GELU, None),
    "relax.exp": _elementwise(Opcode.EXP, None),
    "relax.erf": _elementwise(Opcode.ERF, None),
    "relax.tanh": _elementwise(Opcode.TANH, None),
    "relax.sigmoid": _elementwise(Opcode.SIGMOID, None),
    "relax.sqrt": _elementwise(Opcode.SQRT, np.sqrt),
    "relax.rsqrt": _elementwise(Opcode.RSQRT, None),
    "relax.negative": _elementwise(Opcode.NEG, np.negative),
    "relax.nn.max_pool2d": _pool(Opcode.MAXPOOL),
    "relax.nn.avg_pool2d": _pool(Opcode.AVGPOOL),
    "relax.nn.adaptive_avg_pool2d": _adaptive_avg_pool,
    "relax.nn.avg_pool3d": _channel_avg_pool3d,
    "relax.mean": _reduce(Opcode.REDUCE_MEAN),
    "relax.sum": _reduce(Opcode.REDUCE_SUM),
    "relax.max": _reduce(Opcode.REDUCE_MAX),
    "relax.nn.softmax": _softmax,
    "relax.nn.layer_norm": _layer_norm,
    "relax.reshape": _reshape,
    "relax.flatten": _reshape,
    "relax.squeeze": _reshape,
    "relax.expand_dims": _reshape,
    "relax.permute_dims": _permute,
    "relax.concat": _concat,
    "relax.astype": _astype,
    "relax.quantize": _quantize,
    "relax.dequantize": _dequantize,
}


def lower(func: relax.Function, name: str = "lpx") -> Graph:
    """Lower one offloaded Relax function to an LPX operator graph.

    Parameters
    ----------
    func : relax.Function
        A function whose body calls composite functions (as produced by
        ``partition_for_lpx``) or plain Relax ops from :data:`RULES`.
    name : str
        Prefix for layer names in reports.
    """
    lw = _Lowerer(name)
    g = lw.graph
    params = []
    for p in func.params:
        tid = g.add_tensor(_shape_of(p), p.ty.dtype)
        g.inputs.append(tid)
        params.append(tid)
    result = lw.function(func, params)
    outputs = list(result) if isinstance(result, tuple) else [result]
    for out in outputs:
        if not isinstance(out, int):
            raise LoweringError("an lpx function must return tensors")
    g.outputs = outputs
    return g
