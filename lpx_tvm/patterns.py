"""The lpx pattern table, its check function, and ``partition_for_lpx``.

Single-op patterns ``lpx.<op>`` come from the TVM side's one table
(``codegen.relax_ops.RELAX_OPS``), multi-op idioms from ``RELAX_PATTERNS``;
fused patterns (conv2d + bias + activation, matmul + bias + activation) come
last because later patterns win. The check function rejects what the codegen
cannot run (dtype, dynamic or empty shape, attributes lpx does not implement,
SRAM fit); a rejected op stays on the host.
"""

from __future__ import annotations

import warnings
from math import prod

import tvm
from tvm import relax
from tvm.relax.backend.pattern_registry import register_patterns
from tvm.relax.dpl import is_const, is_op, wildcard
from tvm.relax.transform import FuseOpsByPattern, MergeCompositeFunctions

from .attention import attention_in_query_blocks
from .codegen.target import DEFAULT_CONFIG, chip_of
from .codegen.relax_ops import PRIM_TYPES, RELAX_OPS, RELAX_PATTERNS, Constant
from .codegen.tile import stream_tile_bytes

SUPPORTED_DTYPES = ("float32",)
NARROW_DTYPES = ("float16",)  # a weight stored in fp16 and widened by the graph: lpx keeps its bytes
QUANT_DTYPES = ("int8", "uint8", "int32")  # only as operands of quantize / dequantize
ACTIVATIONS = ("relu", "clip", "gelu", "leakyrelu")
_LAYOUT_PREPARATION = ("relax.permute_dims", "relax.reshape")
_WEIGHT_PREPARATION = ("relax.dequantize", "relax.astype") + _LAYOUT_PREPARATION


class CapacityWarning(UserWarning):
    """An operator too large for SRAM falls back to the host."""


class PartitionWarning(UserWarning):
    """TVM could not merge the offloaded regions; each offloaded op becomes its own lpx function."""


def _static_type(ty) -> tuple | None:
    """(shape, dtype) of a static, non-empty tensor type; None otherwise."""
    if not isinstance(ty, relax.TensorType) or ty.shape is None or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    try:
        shape = tuple(int(v) for v in ty.shape.values)
    except TypeError:
        return None
    return (shape, ty.dtype) if all(d > 0 for d in shape) and len(shape) <= 8 else None


def _static_tensor(expr) -> tuple | None:
    return _static_type(expr.ty)


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
            if info is None or info[1] not in dtypes:
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


def _is_weight(expr, resolve) -> bool:
    """A constant, or one prepared from constants (dequantised, widened, transposed, reshaped): lowering
    folds it."""
    expr = resolve(expr)
    if isinstance(expr, Constant):
        return True
    if not (isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op)):
        return False
    if expr.op.name == "relax.dequantize":
        return all(isinstance(a, Constant) for a in expr.args)
    if expr.op.name == "relax.astype":  # an fp16 weight widened (the frontend leaves it: _stored_narrow)
        return isinstance(resolve(expr.args[0]), Constant) and _is_narrow_weight(expr, resolve)
    return expr.op.name in _LAYOUT_PREPARATION and _is_weight(expr.args[0], resolve)


def _is_narrow_weight(call, resolve) -> bool:
    source = _static_tensor(resolve(call.args[0]))
    return source is not None and source[1] in NARROW_DTYPES and _static_tensor(call)[1] == "float32"


def _why_not(call, resolve) -> str | None:
    """Why lpx cannot run ``call`` (None: it can)."""
    name = call.op.name.removeprefix("relax.")
    row = RELAX_OPS.get(name)
    if row is None:
        return f"{name} has no lpx lowering"
    dtypes = SUPPORTED_DTYPES + QUANT_DTYPES if name in ("quantize", "dequantize") else SUPPORTED_DTYPES
    if name == "astype" and _is_weight(call, resolve):
        dtypes = SUPPORTED_DTYPES + NARROW_DTYPES
    if not _tensors_ok(list(call.args) + [call], dtypes):
        return "dtype or shape (dynamic, empty or rank > 8)"
    for position in row.weights:
        if not _is_weight(call.args[position], resolve):
            return f"operand {position} is not a constant weight"
    if row.unsupported is not None and (reason := row.unsupported(call)):
        return reason
    return None


def _constants_only(call) -> bool:
    """An op on constants alone: lowering folds it to a constant, so alone it is nothing to offload."""
    return all(isinstance(x, Constant) for x in call.args if not isinstance(x, PRIM_TYPES + (relax.ShapeExpr,)))


def _folds_to_constant(call, resolve) -> bool:
    """A weight-preparation op (dequantise, transpose, reshape of constants): no SRAM of its own."""
    return call.op.name in _WEIGHT_PREPARATION and _is_weight(call, resolve)


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


def _make_check(config, dtype: str = "fp32", idiom=None):
    sram_bytes, tile_bytes = config.sram_bytes, stream_tile_bytes(config)

    def check(context) -> bool:
        bindings = context.matched_bindings
        calls = _calls(context.matched_expr, bindings)
        resolve = lambda e: bindings[e] if isinstance(e, relax.Var) and e in bindings else e
        if idiom is not None and not idiom.matches(calls):
            return False
        if idiom is not None and not _tensors_ok([context.matched_expr], SUPPORTED_DTYPES):
            return False
        if len(calls) == 1 and _constants_only(calls[0]):
            return False
        for call in calls:
            # an idiom lowers whole: its inner ops (isnan's booleans, say) need no lowering of their own
            if idiom is not None and call.op.name.removeprefix("relax.") not in RELAX_OPS:
                continue
            if _why_not(call, resolve) is not None:
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


def _weight():
    """A weight: a constant, integers a QDQ model dequantises, or fp16 the graph widens. A fresh pattern per
    use, because one pattern object used twice in a pattern must match the same expression twice."""
    return (is_const() | is_op("relax.dequantize")(is_const(), is_const(), is_const())
            | is_op("relax.astype")(is_const()))


def _activation(name, inner):
    if name == "clip":
        return is_op("relax.clip")(inner, wildcard(), wildcard())
    return is_op(f"relax.nn.{name}")(inner)


def _single_op_pattern(row):
    operands = [_weight() if i in row.weights else wildcard() for i in range(row.arity)]
    return is_op(f"relax.{row.op}")(*operands)


def pattern_table(config: str = DEFAULT_CONFIG, dtype: str = "fp32") -> list:
    """The lpx fusion patterns, lowest priority first.

    Parameters
    ----------
    config : str
        Chip preset whose SRAM size bounds what a check function accepts.
    dtype : str
        Storage type on lpx; with ``"int8"`` an op without an int8 kernel runs in float between its
        dequantise and quantise.
    """
    chip = chip_of(config)
    check = _make_check(chip, dtype)
    table = [(row.pattern_name, _single_op_pattern(row), check) for row in RELAX_OPS.values()]
    table += [(name, idiom.build(), _make_check(chip, dtype, idiom)) for name, idiom in RELAX_PATTERNS.items()]
    # fused patterns, registered last so they win
    conv = is_op("relax.nn.conv2d")(wildcard(), _weight())
    conv_bias = is_op("relax.add")(conv, is_const() | is_op("relax.reshape")(_weight(), wildcard()))
    dense = is_op("relax.matmul")(wildcard(), _weight() | is_op("relax.permute_dims")(_weight()))
    dense_bias = is_op("relax.add")(dense, _weight())
    fused = [("lpx.dense", dense), ("lpx.conv2d_bias", conv_bias), ("lpx.matmul_bias", dense_bias)]
    for act in ACTIVATIONS:
        fused += [(f"lpx.conv2d_{act}", _activation(act, conv)),
                  (f"lpx.conv2d_bias_{act}", _activation(act, conv_bias)),
                  (f"lpx.matmul_bias_{act}", _activation(act, dense_bias))]
    table += [(name, pattern, check) for name, pattern in fused]
    # tuples, not FusionPattern objects: the registry only clears tuple entries at exit, and a
    # Python check function left in it crashes the interpreter on shutdown (TVM 0.27)
    return [(name, pattern, {}, check) for name, pattern, check in table]


register_patterns(pattern_table())


def partition_for_lpx(mod, config: str = DEFAULT_CONFIG, dtype: str = "fp32"):
    """Group the ops lpx can run into functions with ``Codegen="lpx"``.

    Parameters
    ----------
    mod : tvm.IRModule
        A Relax module with weights bound as constants.
    config : str
        Chip preset; its SRAM size decides what fits.
    dtype : str
        Storage type on lpx (fp32, fp16, bf16, fp8, int8); the chip must run it.

    Returns
    -------
    tvm.IRModule
        The partitioned module; run ``relax.transform.RunCodegen()`` or
        ``tvm.compile(mod, target="lpx")`` next.
    """
    chip = chip_of(config)
    chip.check_dtype(dtype)
    mod = attention_in_query_blocks(mod, chip.sram_bytes)  # a long prompt's scores, a block of queries at a time
    # FuseOpsByPattern tries patterns in list order (first wins); the table lists lowest priority first,
    # the order register_patterns wants, so reverse it here
    table = list(reversed(pattern_table(config, dtype)))
    fused = FuseOpsByPattern(table, bind_constants=True, annotate_codegen=False)(mod)
    try:
        merged = MergeCompositeFunctions()(fused)
    except Exception as err:  # TVM 0.27 raises TypeError on a match_cast binding, say: offload op by op instead
        warnings.warn(f"lpx: TVM could not merge the offloaded regions ({str(err).splitlines()[-1]}); each "
                      "offloaded op becomes its own lpx function", PartitionWarning, stacklevel=2)
        merged = FuseOpsByPattern(table, bind_constants=True, annotate_codegen=True)(mod)
    return _unique_symbols(merged)


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
