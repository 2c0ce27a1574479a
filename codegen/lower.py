"""lower: a Relax function offloaded to lpx ─► LPX operator graph.

The rules come from the TVM side's one table (:mod:`.relax_ops`). Composite
functions are inlined, except the multi-op idioms lpx runs as one operator;
constant sub-expressions (a reshaped bias, a transposed weight) are folded in
numpy; batch norm becomes a per-channel scale and shift, which ``fuse`` then
folds into the convolution before it. After this step nothing refers to TVM.
"""

from __future__ import annotations

from tvm import relax

from .graph import Graph
from .relax_ops import (PRIM_TYPES, RELAX_OPS, RELAX_PATTERNS, Constant, LoweringError, constant_value, dtype_of,
                        shape_of)


def _onnx_tensor(call) -> str | None:
    """The ONNX tensor a Relax call computes, where the frontend's span names it."""
    span = call.span
    return span.source_name.name if span is not None and span.source_name is not None else None


class _Lowerer:
    """Walks a Relax function; the table's rules call back into it to add nodes."""

    def __init__(self, func_name: str):
        self.graph = Graph()
        self.func_name = func_name
        self.counter = 0

    def function(self, func: relax.Function, args: list) -> object:
        env = dict(zip(func.params, args))
        return self.expr(func.body, env)

    def _layer(self, kind: str, made_by=None) -> str:
        """``func/kind_n``, and ``@tensor`` where the ONNX tensor it computes is known (the frontend spans each
        call with it; a composite is named by the last of its calls that has one: its output)."""
        self.counter += 1
        tensor = None
        if isinstance(made_by, relax.Function):
            calls = []
            relax.analysis.post_order_visit(made_by.body, lambda e: calls.append(e) if isinstance(e, relax.Call)
                                            else None)
            tensor = next(filter(None, map(_onnx_tensor, reversed(calls))), None)
        elif made_by is not None:
            tensor = _onnx_tensor(made_by)
        return f"{self.func_name}/{kind}_{self.counter}" + (f"@{tensor}" if tensor else "")

    def expr(self, expr, env):
        if isinstance(expr, relax.SeqExpr):
            for block in expr.blocks:
                for binding in block.bindings:
                    env[binding.var] = self.expr(binding.value, env)
            return self.expr(expr.body, env)
        if isinstance(expr, relax.Var):
            return env[expr]
        if isinstance(expr, PRIM_TYPES + (relax.ShapeExpr,)):  # before Constant: IntImm subclasses it
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
            return self.call(expr, env)
        raise LoweringError(f"cannot lower {type(expr).__name__}")

    def call(self, call, env):
        callee = call.op
        args = [self.expr(a, env) for a in call.args]
        if isinstance(callee, relax.Var):  # a composite function bound in this body
            callee = env[callee]
        if isinstance(callee, relax.Function):
            idiom = RELAX_PATTERNS.get(str(callee.attrs["Composite"])) if callee.attrs and \
                "Composite" in callee.attrs else None
            if idiom is not None:
                return idiom.lower(self, callee, args, self._layer(idiom.name.removeprefix("lpx."), callee))
            return self.function(callee, args)
        row = RELAX_OPS.get(callee.name.removeprefix("relax."))
        if row is None:
            raise LoweringError(f"{callee.name} has no LPX lowering")
        return row.lower(self, call, args, self._layer(row.op.removeprefix("nn."), call))

    # ---- helpers for the rules ----------------------------------------
    def const_value(self, tid):
        """The numpy value of a constant tensor (in its own shape), or None."""
        t = self.graph.tensors[self.graph.base(tid)]
        return None if t.data is None else t.data.reshape(self.graph.tensors[tid].shape)

    def node(self, kind, inputs, call, layer, **attrs) -> int:
        return self.graph.add_node(kind, inputs, shape_of(call), dtype_of(call), layer, **attrs)

    def alias(self, tid, shape) -> int:
        t = self.graph.tensors[tid]
        if t.data is not None:
            return self.graph.constant(t.data.reshape(shape), t.dtype)
        return self.graph.add_tensor(shape, t.dtype, alias_of=tid)


def lower(func: relax.Function, name: str = "lpx") -> Graph:
    """Lower one offloaded Relax function to an LPX operator graph.

    Parameters
    ----------
    func : relax.Function
        A function whose body calls composite functions (as produced by
        ``partition_for_lpx``) or plain Relax ops of the table.
    name : str
        Prefix for layer names in reports.
    """
    lw = _Lowerer(name)
    g = lw.graph
    params = []
    for p in func.params:
        tid = g.add_tensor(shape_of(p), p.ty.dtype)
        g.inputs.append(tid)
        params.append(tid)
    result = lw.function(func, params)
    outputs = list(result) if isinstance(result, tuple) else [result]
    for out in outputs:
        if not isinstance(out, int):
            raise LoweringError("an lpx function must return tensors")
    g.outputs = outputs
    return g
