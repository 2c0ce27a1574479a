"""Attention over a long prompt in blocks of queries, so that its scores fit SRAM beside the weights.

``softmax(q kᵀ · s + mask) v`` makes a ``[heads, L, L]`` score tensor: 100 MB in fp16 for 12 heads at
L = 2,048, which does not fit a chip beside the model's weights, so the scores' ops stayed on the host.
Every op between the two products works row by row (a softmax over the keys, elementwise ops whose other
operand is a constant or broadcasts along the queries), so the chain splits exactly by query rows: block
``b`` is ``softmax(q[b] kᵀ · s + mask[b]) v``, and the blocks' results are concatenated along the queries.
The numbers are the same (no online softmax is needed: each block still sees every key); only one block's
scores are live at a time.

The rewrite is on Relax, before partitioning: the slices and the concatenation are ops lpx runs (SLICE,
CONCAT), so the whole attention stays in one lpx program.
"""

from __future__ import annotations

from math import prod

import numpy as np
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .codegen.relax_ops import Constant, LoweringError, constant_value, shape_of

_ROW_WISE = ("relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.astype")


def _shape(expr) -> tuple | None:
    """The static shape of a tensor expression, or None."""
    try:
        return shape_of(expr)
    except LoweringError:
        return None


def _chains(func, limit_bytes: int) -> dict:
    """The final product's var ─► (first product, [(row-wise call, the argument it takes the chain in)],
    final product, the scores' shape) of each attention whose scores take more than ``limit_bytes``
    (counted in fp32, as the partitioner counts them)."""
    bindings = {b.var: b.value for block in func.body.blocks for b in block.bindings}
    users = {}
    for var, value in bindings.items():
        if isinstance(value, relax.Call):
            for arg in value.args:
                if isinstance(arg, relax.Var):
                    users.setdefault(arg, []).append(var)
    matmul = tvm.ir.Op.get("relax.matmul")
    found = {}
    for var, value in bindings.items():
        if not (isinstance(value, relax.Call) and value.op.same_as(matmul)):
            continue
        scores = _shape(var)
        if scores is None or len(scores) < 3 or prod(scores) * 4 <= limit_bytes:
            continue
        chain, current = [], var
        while len(users.get(current, ())) == 1:
            user = users[current][0]
            call = bindings[user]
            if call.op.same_as(matmul) and call.args[0].same_as(current):
                if _shape(user) is not None and _shape(user)[-2] == scores[-2]:
                    found[user] = (value, chain, call, scores)
                break
            if not _row_wise(call, current, scores):
                break
            chain.append((call, next(k for k, a in enumerate(call.args) if a.same_as(current))))
            current = user
        # (a chain that does not end in a product, or has a second reader, is left whole)
    return found


def _row_wise(call, current, scores) -> bool:
    """Does ``call`` (reading ``current``, of shape ``scores``) work on each query row on its own?"""
    if call.op.same_as(tvm.ir.Op.get("relax.nn.softmax")):
        return int(call.attrs.axis) % len(scores) == len(scores) - 1
    if call.op.name not in _ROW_WISE or _shape(current) != scores:
        return False
    # every other operand broadcasts against the scores: a query axis of 1 or of all the queries (then sliced
    # per block)
    others = [_shape(a) for a in call.args if not a.same_as(current)]
    return all(shape is not None and (len(shape) < 2 or shape[-2] in (1, scores[-2])) for shape in others)


@mutator
class _QueryBlocks(PyExprMutator):
    def __init__(self, mod, chains: dict, rows: int):
        super().__init__(mod)
        self.chains, self.rows = chains, rows

    def visit_var_binding_(self, binding):
        if binding.var not in self.chains:
            super().visit_var_binding_(binding)
            return
        first, chain, last, scores = self.chains[binding.var]
        queries = scores[-2]
        q, keys, values = (self.visit_expr(a) for a in (first.args[0], first.args[1], last.args[1]))
        operands = [[None if k == position else self.visit_expr(a) for k, a in enumerate(call.args)]
                    for call, position in chain]
        pieces = []
        for r0 in range(0, queries, self.rows):
            r1 = min(r0 + self.rows, queries)
            current = self.builder_.emit(relax.op.matmul(self._rows(q, r0, r1, queries), keys))
            for (call, position), args in zip(chain, operands):
                args = [current if k == position else self._rows(a, r0, r1, queries) for k, a in enumerate(args)]
                current = self.builder_.emit(relax.Call(call.op, args, call.attrs, call.ty_args))
            pieces.append(self.builder_.emit(relax.op.matmul(current, values)))
        joined = relax.op.concat(pieces, axis=len(scores) - 2)
        # the function's result leaves the dataflow block: it must be an output var, not a dataflow one
        out = self.builder_.emit(joined) if isinstance(binding.var, relax.DataflowVar) \
            else self.builder_.emit_output(joined)
        self.set_var_remap(binding.var, out)

    def _rows(self, x, r0: int, r1: int, queries: int):
        """Query rows ``r0:r1`` of ``x`` where it has all of them (the queries, a mask); else ``x`` whole."""
        shape = _shape(x)
        if shape is None or len(shape) < 2 or shape[-2] != queries:
            return x
        if isinstance(x, Constant):  # a mask: its rows, as a constant of their own
            return relax.const(np.ascontiguousarray(constant_value(x)[..., r0:r1, :]))
        return self.builder_.emit(relax.op.strided_slice(x, axes=[len(shape) - 2], begin=[r0], end=[r1],
                                                         strides=[1]))


def attention_in_query_blocks(mod, sram_bytes: int):
    """Compute each long attention of ``mod`` in blocks of query rows (see the module docstring).

    Parameters
    ----------
    mod : tvm.IRModule
        An imported model (before partitioning).
    sram_bytes : int
        The chip's SRAM: an attention whose scores take more than an eighth of it is blocked, each block's
        scores taking at most a sixteenth.

    Returns
    -------
    tvm.IRModule
        ``mod`` rewritten, or ``mod`` itself when no attention is that long.
    """
    limit = sram_bytes // 8
    chains = _chains(mod["main"], limit)
    if not chains:
        return mod
    # a power of two of query rows whose scores (fp32, as counted) take at most limit / 2, for the longest
    per_row = max(prod(scores) // scores[-2] * 4 for _, _, _, scores in chains.values())
    rows = max(1, 2 ** (limit // 2 // per_row).bit_length() // 2)
    blocked = _QueryBlocks(mod, chains, rows)
    body = blocked.visit_expr(mod["main"])
    out = blocked.builder_.get()
    out["main"] = body
    return relax.transform.DeadCodeElimination()(out)
