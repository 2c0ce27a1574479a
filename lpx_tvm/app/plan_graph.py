"""The operator graph of one tensor-parallel shard of a Llama-style block, built for planning.

It is the graph the codegen gets from lowering the decoder of :mod:`.llama` (the same operators in the
same order, each layer: RMSNorm written out, Q/K/V products, rotary embeddings as a product with the
rotate-half matrix, the KV cache concatenated with the new K/V, grouped-query attention with the query
heads stacked per K/V head, the output product, RMSNorm, a SwiGLU MLP), at the shard's sizes: ``heads / T``
query heads, ``kv_heads / T`` K/V heads (at least one), ``ffn / T`` MLP columns, with the output and down
products split by rows, their partial sums summed by the all-reduce the compiler emits for the shard's
group of chips (in the graph, as rank 0 runs it). Weights are zero-strided arrays of the storage type: the codegen needs
their shapes, never their values, and a 405B block is not materialised. The KV cache is resident state.

A mixture-of-experts block replaces the MLP by the router's product and one expert's SwiGLU shard (the
planner places the experts; a token's top-k experts run on different chips side by side).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..codegen.graph import Graph
from ..runtime_sim import Opcode


@dataclass(frozen=True)
class BlockShape:
    """One shard of one block: what a chip of a T-wide tensor-parallel group computes for ``tokens`` new
    tokens of ``batch`` sequences against a cache of ``context`` positions (0 for a prefill)."""

    hidden: int
    heads: int  # query heads on this chip
    kv_heads: int  # K/V heads on this chip
    head_dim: int
    ffn: int  # MLP columns on this chip (one expert's, for a mixture of experts)
    tokens: int
    context: int
    batch: int = 1
    experts: int = 0  # router outputs (0: a dense MLP)
    system: str = ""  # the system whose chips the shard's all-reduces cross (none: a shard alone)
    width: int = 1  # the chips of the tensor-parallel group


class _Builder:
    def __init__(self, dtype: np.dtype):
        self.g, self.dtype, self.count = Graph(), np.dtype(dtype), 0

    def weight(self, *shape) -> int:
        return self.g.add_tensor(shape, self.dtype, data=np.broadcast_to(np.zeros((), self.dtype), shape))

    def node(self, kind: str, inputs, shape, **attrs) -> int:
        self.count += 1
        if kind in ("matmul",):
            attrs = {"act": Opcode.NOP, "act_args": (0.0, 0.0), **attrs}
        return self.g.add_node(kind, inputs, shape, self.dtype, f"block/{kind.lower()}_{self.count}", **attrs)

    def alias(self, tid: int, shape) -> int:
        return self.g.add_tensor(shape, self.dtype, alias_of=self.g.base(tid))

    def rms_norm(self, x: int, shape) -> int:
        stat = shape[:-1] + (1,)
        sq = self.node("MUL", [x, x], shape)
        mean = self.node("REDUCE_MEAN", [sq], stat, axes=(len(shape) - 1,))
        eps = self.node("ADD", [mean, self.weight()], stat)
        root = self.node("SQRT", [eps], stat)
        inv = self.node("DIV", [self.weight(), root], stat)
        scaled = self.node("MUL", [x, inv], shape)
        return self.node("MUL", [scaled, self.weight(shape[-1])], shape)


def block_graph(shape: BlockShape, dtype, layers: int = 1) -> Graph:
    """``layers`` consecutive block shards; inputs: the hidden state, the rotary tables, the mask and each
    layer's K/V cache (resident state); output: the hidden state after the last block. On ``width`` chips the
    row-split products' partial sums (attention's output projection, the MLP's down projection) are summed by
    the all-reduce the compiler emits for that group of the system (:func:`~lpx_tvm.codegen.parallel.
    collectives.choose`): the graph is rank 0's, and its SENDs and RECVs are scheduled as every rank runs
    them (each RECV one hop after its SEND)."""
    b = _Builder(dtype)
    g, s = b.g, shape
    group = None
    if s.width > 1 and s.system:
        from ..codegen.parallel.collectives import choose
        from ..runtime_sim.system import load_system

        group = choose(load_system(s.system), s.width)

    def summed(partial):
        if group is None:
            return partial
        tag = b.count * group.tags()  # (every node its own tags)
        return b.node("allreduce", [partial], (s.batch, s.tokens, s.hidden), rank=0, ranks=group.ranks,
                      tag=tag, group=group, rotated=False)
    hd, kvh, qh = s.head_dim, s.kv_heads, s.heads
    rep = max(qh // kvh, 1)
    x = g.add_tensor((s.batch, s.tokens, s.hidden), b.dtype)
    cos, sin = g.add_tensor((s.tokens, hd), b.dtype), g.add_tensor((s.tokens, hd), b.dtype)
    g.inputs = [x, cos, sin]
    keys = s.context + s.tokens if s.context else s.tokens
    if s.context:
        # the cache's mask from the host; several new tokens (a speculative step's) mask each other causally
        rows = 1 if s.tokens == 1 else rep * s.tokens
        mask = g.add_tensor((1, 1, rows, s.context), b.dtype)
        g.inputs.append(mask)
        full_mask = b.node("CONCAT", [mask, b.weight(1, 1, rows, s.tokens)], (1, 1, rows, keys), axis=3)
    else:
        # the causal mask is a constant of a prefill graph, one row per stacked query row
        full_mask = b.weight(1, 1, max(qh // kvh, 1) * s.tokens, s.tokens)
    hidden = (s.batch, s.tokens, s.hidden)
    for _ in range(layers):
        n = b.rms_norm(x, hidden)

        def heads(count):
            proj = b.node("matmul", [n, b.weight(s.hidden, count * hd)], (s.batch, s.tokens, count * hd))
            split = b.alias(proj, (s.batch, s.tokens, count, hd))
            return b.node("TRANSPOSE", [split], (s.batch, count, s.tokens, hd), perm=(0, 2, 1, 3))

        def rope(t, count):
            shape_ = (s.batch, count, s.tokens, hd)
            rot = b.node("matmul", [t, b.weight(hd, hd)], shape_)
            a = b.node("MUL", [t, cos], shape_)
            c = b.node("MUL", [rot, sin], shape_)
            return b.node("ADD", [a, c], shape_)
        q = rope(heads(qh), qh)
        k = rope(heads(kvh), kvh)
        v = heads(kvh)
        if s.context:
            cache_k = g.add_tensor((s.batch, kvh, s.context, hd), b.dtype)
            cache_v = g.add_tensor((s.batch, kvh, s.context, hd), b.dtype)
            g.inputs += [cache_k, cache_v]
            g.state |= {cache_k, cache_v}
            k = b.node("CONCAT", [cache_k, k], (s.batch, kvh, keys, hd), axis=2)
            v = b.node("CONCAT", [cache_v, v], (s.batch, kvh, keys, hd), axis=2)
        kt = b.node("TRANSPOSE", [k], (s.batch, kvh, hd, keys), perm=(0, 1, 3, 2))
        stacked = b.alias(q, (s.batch, kvh, rep * s.tokens, hd))
        scores = b.node("matmul", [stacked, kt], (s.batch, kvh, rep * s.tokens, keys))
        scaled = b.node("MUL", [scores, b.weight()], (s.batch, kvh, rep * s.tokens, keys))
        masked = b.node("ADD", [scaled, full_mask], (s.batch, kvh, rep * s.tokens, keys))
        probs = b.node("SOFTMAX", [masked], (s.batch, kvh, rep * s.tokens, keys), axis=3)
        ctx = b.node("matmul", [probs, v], (s.batch, kvh, rep * s.tokens, hd))
        back = b.node("TRANSPOSE", [b.alias(ctx, (s.batch, qh, s.tokens, hd))], (s.batch, s.tokens, qh, hd),
                      perm=(0, 2, 1, 3))
        out = b.node("matmul", [b.alias(back, (s.batch, s.tokens, qh * hd)), b.weight(qh * hd, s.hidden)], hidden)
        x = b.node("ADD", [summed(out), x], hidden)
        n = b.rms_norm(x, hidden)
        if s.experts:
            b.node("matmul", [n, b.weight(s.hidden, s.experts)], (s.batch, s.tokens, s.experts))
        mlp = (s.batch, s.tokens, s.ffn)
        gate = b.node("matmul", [n, b.weight(s.hidden, s.ffn)], mlp)
        silu = b.node("MUL", [gate, b.node("SIGMOID", [gate], mlp)], mlp)
        up = b.node("matmul", [n, b.weight(s.hidden, s.ffn)], mlp)
        down = b.node("matmul", [b.node("MUL", [silu, up], mlp), b.weight(s.ffn, s.hidden)], hidden)
        x = b.node("ADD", [summed(down), x], hidden)
    g.outputs = [x]
    return g


def head_graph(hidden: int, vocab: int, tokens: int, dtype, after: bool = False, head: bool = True) -> Graph:
    """The final RMSNorm and this chip's columns of the LM head, for ``tokens`` positions. With ``after``, the
    residual add that ends a block comes first (its input is then on the chip when the head starts, as in a
    pipeline's last stage); without ``head``, that add alone."""
    b = _Builder(dtype)
    g = b.g
    shape = (1, tokens, hidden)
    x = g.add_tensor(shape, b.dtype)
    g.inputs = [x]
    if after:
        x = b.node("ADD", [x, b.weight(hidden)], shape)
    g.outputs = [b.node("matmul", [b.rms_norm(x, shape), b.weight(hidden, vocab)], (1, tokens, vocab))
                 if head else x]
    return g
