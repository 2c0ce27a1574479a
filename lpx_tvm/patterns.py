"""The lpx pattern table, its check functions, and ``partition_for_lpx``.

Every Relax op the codegen can lower gets a single-op pattern ``lpx.<op>``;
fused patterns (conv2d + bias + activation, matmul + bias +
activation) come last because later patterns win. A check function rejects what
the codegen cannot run (dtype, dynamic shape, layout, SRAM fit); a rejected op
stays on the host.
"""

from __future__ import annotations

import warnings
from math import prod

import tvm
from tvm import relax
from tvm.relax.backend.pattern_registry import register_patterns
from tvm.relax.dpl import is_const, is_op, wildcard
from tvm.relax.transform import FuseOpsByPattern, MergeCompositeFunctions

from .codegen.lower import PRIM_TYPES, Constant
from .codegen.tile import stream_tile_bytes
from .runtime_sim import load_config

SUPPORTED_DTYPES = ("float32",)
QUANT_DTYPES = ("int8", "uint8", "int32")  # only as operands of quantize / dequantize
# ops with no int8 kernel on lpx: with dtype="int8" they run on the host, with a warning
NO_INT8_KERNEL = ("nn.softmax", "nn.layer_norm", "nn.gelu", "erf", "exp", "tanh", "sigmoid")
UNARY = ("nn.relu", "nn.gelu", "sigmoid", "tanh", "exp", "erf", "sqrt", "rsqrt", "negative")
BINARY = ("add", "subtract", "multiply", "divide", "maximum", "minimum", "power")
SHAPE_OPS = ("reshape", "flatten", "squeeze", "expand_dims", "permute_dims")
REDUCE = ("mean", "sum", "max")
ACTIVATIONS = ("relu", "clip", "gelu")


def _static_tensor(expr) -> tuple | None:
    return _static_type(expr.ty)


def _static_type(ty) -> tuple | None:
    if not isinstance(ty, relax.TensorType) or ty.shape is None or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    try:
        return tuple(int(v) for v in ty.shape.values), ty.dtype
    except TypeError:
        return None


def _tensors_ok(exprs, dtypes=SUPPORTED_DTYPES) -> bool:
    for e in exprs:
        if isinstance(e, PRIM_TYPES + (relax.ShapeExpr,)):
            continue
        if isinstance(e, relax.Tuple):
            if not _tensors_ok(e.fields, dtypes):
                return False
            continue
        types = list(e.ty.fields) if isinstance(e.ty, relax.TupleType) else [e.ty]
        for ty in types:
            info = _static_type(ty)
            if info is None or info[1] not in dtypes or len(info[0]) > 8:
                return False
    return True


def _calls(expr, bindings=None):
    """Every relax.Call in the matched sub-graph, following the variables it binds."""
    out, stack, seen = [], [expr], set()
    while stack:
        e = stack.pop()
        if isinstance(e, relax.Var) and bindings is not None and e in bindings and e not in seen:
            seen.add(e)
            stack.append(bindings[e])
        elif isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op):
            out.append(e)
            stack.extend(e.args)
        elif isinstance(e, relax.TupleGetItem):
            stack.append(e.tuple_value)
        elif isinstance(e, relax.Tuple):
            stack.extend(e.fields)
    return out


def _op_ok(call, resolve=lambda e: e) -> bool:
    name = call.op.name.removeprefix("relax.")
    a = call.attrs
    if name == "nn.conv2d":
        return (a.data_layout == "NCHW" and a.kernel_layout == "OIHW" and a.out_layout == "NCHW"
                and _is_weight(call.args[1], resolve))
    if name in ("quantize", "dequantize"):
        x, scale, zero_point = call.args
        per_tensor = _static_tensor(scale)[0] in ((), (1,)) and _static_tensor(zero_point)[0] in ((), (1,))
        return (isinstance(scale, Constant) and isinstance(zero_point, Constant)
                and (per_tensor or isinstance(x, Constant)))
    if name in ("nn.max_pool2d", "nn.avg_pool2d"):
        return a.layout == "NCHW" and a.out_layout == "NCHW" and (name == "nn.max_pool2d" or not a.ceil_mode)
    if name == "nn.avg_pool3d":  # only a window along the first spatial axis, as ONNX LRN imports
        return (a.layout == "NCDHW" and a.out_layout == "NCDHW" and not a.ceil_mode
                and [int(x) for x in a.pool_size][1:] == [1, 1] and [int(x) for x in a.strides] == [1, 1, 1]
                and [int(x) for x in a.dilation] == [1, 1, 1]
                and [int(x) for x in a.padding][1:3] + [int(x) for x in a.padding][4:] == [0, 0, 0, 0])
    if name == "nn.adaptive_avg_pool2d":
        return a.layout == "NCHW" and _static_tensor(call)[0][2:] == (1, 1)
    if name == "nn.layer_norm":
        rank = len(_static_tensor(call)[0])
        axes = sorted(int(x) % rank for x in a.axes)
        return axes == list(range(rank - len(axes), rank))
    if name == "nn.batch_norm":
        return all(_is_weight(p, resolve) for p in call.args[1:])
    if name in SHAPE_OPS or name in BINARY:
        # an op on constants alone is folded by lowering; keep such ops off the boundary
        return any(not isinstance(x, Constant) for x in call.args if not isinstance(x, relax.ShapeExpr))
    return True


def _is_weight(expr, resolve) -> bool:
    """A constant, or one prepared from constants (dequantised, transposed, reshaped): lowering folds it."""
    expr = resolve(expr)
    if isinstance(expr, Constant):
        return True
    if not (isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op)):
        return False
    if expr.op.name == "relax.dequantize":
        return all(isinstance(a, Constant) for a in expr.args)
    return expr.op.name in ("relax.permute_dims", "relax.reshape") and _is_weight(expr.args[0], resolve)


def _folds_to_constant(call, resolve) -> bool:
    """A weight-preparation op (dequantise, transpose, reshape of constants): no SRAM of its own."""
    return call.op.name in ("relax.dequantize", "relax.permute_dims", "relax.reshape") and _is_weight(call, resolve)


def _bytes(expr) -> int:
    info = _static_tensor(expr)
    return prod(info[0]) * 4 if info else 0


def _streamed_bytes(call, tile_bytes: int, resolve) -> int:
    """Bytes a 2-D constant matmul weight occupies in SRAM: two tiles when it is big enough to be streamed."""
    weight = call.args[1]
    if call.op.name != "relax.matmul" or not _is_weight(weight, resolve) or len(_static_tensor(weight)[0]) != 2:
        return _bytes(weight)
    return min(_bytes(weight), 2 * tile_bytes)


def _working_set(calls, bindings, resolve, tile_bytes: int) -> int:
    """SRAM bytes a matched operator needs at once: its outside inputs and weights (each once), its
    output and any im2col scratch. Results passed between the matched ops are fused away."""
    def intermediate(arg) -> bool:
        return isinstance(arg, relax.Var) and arg in bindings and not _is_weight(arg, resolve)
    seen, working = set(), 0
    for call in calls:
        for position, arg in enumerate(call.args):
            if not isinstance(arg, relax.Expr) or isinstance(arg, PRIM_TYPES + (relax.ShapeExpr, relax.Tuple)) \
                    or intermediate(arg) or arg in seen:
                continue
            seen.add(arg)
            working += _streamed_bytes(call, tile_bytes, resolve) if position == 1 else _bytes(arg)
        if call.op.name == "relax.nn.conv2d":
            w = _static_tensor(call.args[1])[0]
            working += _bytes(call) // max(w[0], 1) * w[1] * w[2] * w[3]
    return working + _bytes(calls[0])


def _make_check(config, dtype: str = "fp32"):
    sram_bytes, tile_bytes = config.sram_bytes, stream_tile_bytes(config)

    def check(context) -> bool:
        bindings = context.matched_bindings
        calls = _calls(context.matched_expr, bindings)
        resolve = lambda e: bindings[e] if isinstance(e, relax.Var) and e in bindings else e
        for call in calls:
            name = call.op.name.removeprefix("relax.")
            dtypes = SUPPORTED_DTYPES + QUANT_DTYPES if name in ("quantize", "dequantize") else SUPPORTED_DTYPES
            if not _tensors_ok(list(call.args) + [call], dtypes) or not _op_ok(call, resolve):
                return False
            if dtype == "int8" and name in NO_INT8_KERNEL:
                warnings.warn(f"lpx int8: {name} has no int8 kernel on lpx; it runs on the host in the model's "
                              "own dtype", Int8FallbackWarning, stacklevel=2)
                return False
        # one operator's working set (weights, inputs, output, im2col scratch) must fit in SRAM
        # weight preparation (dequantise, transpose a constant) folds away when lowered: no SRAM of its own
        calls = [c for c in calls if not _folds_to_constant(c, resolve)] or calls[:1]
        working = _working_set(calls, bindings, resolve, tile_bytes)
        if working > sram_bytes:
            if len(calls) == 1:  # a fused match that does not fit is retried op by op; warn about the op
                warnings.warn(f"lpx: {calls[0].op.name.removeprefix('relax.')} with output "
                              f"{list(_static_tensor(calls[0])[0])} needs {working} bytes of SRAM, the chip has "
                              f"{sram_bytes}; it runs on the host", CapacityWarning, stacklevel=2)
            return False
        return True
    return check


class CapacityWarning(UserWarning):
    """An operator too large for SRAM falls back to the host."""


class Int8FallbackWarning(UserWarning):
    """With dtype="int8", an operator lpx has no int8 kernel for runs on the host."""


def _weight():
    """A weight: a constant, or integers a QDQ model dequantises. A fresh pattern per use, because one
    pattern object used twice in a pattern must match the same expression twice."""
    return is_const() | is_op("relax.dequantize")(is_const(), is_const(), is_const())


def _activation(name, inner):
    if name == "clip":
        return is_op("relax.clip")(inner, wildcard(), wildcard())
    return is_op(f"relax.nn.{name}")(inner)


def pattern_table(config: str = "tsp", dtype: str = "fp32") -> list:
    """The lpx fusion patterns, lowest priority first.

    Parameters
    ----------
    config : str
        Chip preset whose SRAM size bounds what a check function accepts.
    dtype : str
        Storage type on lpx; with ``"int8"`` ops without an int8 kernel stay on the host.
    """
    check = _make_check(load_config(config), dtype)
    table = []
    for op in UNARY:
        table.append((f"lpx.{op.removeprefix('nn.')}", is_op(f"relax.{op}")(wildcard())))
    table.append(("lpx.clip", is_op("relax.clip")(wildcard(), wildcard(), wildcard())))
    for op in BINARY:
        table.append((f"lpx.{op}", is_op(f"relax.{op}")(wildcard(), wildcard())))
    for op in REDUCE:
        table.append((f"lpx.{op}", is_op(f"relax.{op}")(wildcard())))
    for op in SHAPE_OPS:
        pattern = is_op(f"relax.{op}")(wildcard(), wildcard()) if op == "reshape" else is_op(f"relax.{op}")(wildcard())
        table.append((f"lpx.{op}", pattern))
    table += [
        ("lpx.concat", is_op("relax.concat")(wildcard())),
        ("lpx.quantize", is_op("relax.quantize")(wildcard(), is_const(), is_const())),
        ("lpx.dequantize", is_op("relax.dequantize")(wildcard(), is_const(), is_const())),
        ("lpx.max_pool2d", is_op("relax.nn.max_pool2d")(wildcard())),
        ("lpx.avg_pool2d", is_op("relax.nn.avg_pool2d")(wildcard())),
        ("lpx.channel_avg_pool3d", is_op("relax.nn.avg_pool3d")(wildcard())),  # LRN's window over channels
        ("lpx.global_avg_pool2d", is_op("relax.nn.adaptive_avg_pool2d")(wildcard())),
        ("lpx.softmax", is_op("relax.nn.softmax")(wildcard())),
        ("lpx.layer_norm", is_op("relax.nn.layer_norm")(wildcard(), wildcard(), wildcard())),
        # TVM 0.27's FuseOpsByPattern does not match TupleGetItem patterns: offload the whole tuple
        ("lpx.batch_norm", is_op("relax.nn.batch_norm")(wildcard(), *(_weight() for _ in range(4)))),
        ("lpx.matmul", is_op("relax.matmul")(wildcard(), wildcard())),
        ("lpx.conv2d", is_op("relax.nn.conv2d")(wildcard(), _weight())),
    ]
    # fused patterns, registered last so they win
    conv = is_op("relax.nn.conv2d")(wildcard(), _weight())
    conv_bias = is_op("relax.add")(conv, is_const() | is_op("relax.reshape")(_weight(), wildcard()))
    dense = is_op("relax.matmul")(wildcard(), _weight() | is_op("relax.permute_dims")(_weight()))
    dense_bias = is_op("relax.add")(dense, _weight())
    table += [("lpx.dense", dense), ("lpx.conv2d_bias", conv_bias), ("lpx.matmul_bias", dense_bias)]
    for act in ACTIVATIONS:
        table += [(f"lpx.conv2d_{act}", _activation(act, conv)),
                  (f"lpx.conv2d_bias_{act}", _activation(act, conv_bias)),
                  (f"lpx.matmul_bias_{act}", _activation(act, dense_bias))]
    # tuples, not FusionPattern objects: the registry only clears tuple entries at exit, and a
    # Python check function left in it crashes the interpreter on shutdown (TVM 0.27)
    return [(name, pattern, {}, check) for name, pattern in table]


register_patterns(pattern_table())


def partition_for_lpx(mod, config: str = "tsp", dtype: str = "fp32"):
    """Group the ops lpx can run into functions with ``Codegen="lpx"``.

    Parameters
    ----------
    mod : tvm.IRModule
        A Relax module with weights bound as constants.
    config : str
        Chip preset; its SRAM size decides what fits.
    dtype : str
        Storage type on lpx (fp32, fp16, bf16, int8); the chip must run it.

    Returns
    -------
    tvm.IRModule
        The partitioned module; run ``relax.transform.RunCodegen()`` or
        ``tvm.compile(mod, target="lpx")`` next.
    """
    load_config(config).check_dtype(dtype)
    # FuseOpsByPattern tries patterns in list order (first wins); the table lists lowest priority first,
    # the order register_patterns wants, so reverse it here
    table = list(reversed(pattern_table(config, dtype)))
    mod = FuseOpsByPattern(table, bind_constants=True, annotate_codegen=False)(mod)
    mod = MergeCompositeFunctions()(mod)
    return _unique_symbols(mod)


def _unique_symbols(mod):
    """Name each lpx function ``lpx<k>_<content hash>``: short in reports, and a safe key for programs."""
    import tvm_ffi

    k = 0
    for gvar, func in sorted(mod.functions.items(), key=lambda item: item[0].name_hint):
        if isinstance(func, relax.Function) and func.attrs and func.attrs.get("Codegen") == "lpx":
            symbol = str(func.attrs["global_symbol"])
            if not symbol.startswith("lpx"):
                digest = f"{tvm_ffi.structural_hash(func) & 0xFFFFFFFFFFFF:012x}"
                mod[gvar] = func.with_attr("global_symbol", f"lpx{k}_{digest}")
            k += 1
    return mod
