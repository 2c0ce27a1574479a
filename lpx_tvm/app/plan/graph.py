"""The operator graph of one tensor-parallel shard of a Llama-style block, built for planning.

It is the graph the codegen gets from lowering the decoder of :mod:`.llama` (the same operators in the
same order, each layer: RMSNorm written out, Q/K/V products, rotary embeddings as a product with the
rotate-half matrix, the KV cache concatenated with the new K/V, grouped-query attention with the query
heads stacked per K/V head, the output product, RMSNorm, a SwiGLU MLP), at the shard's sizes: ``heads / T``
query heads, ``kv_heads / T`` K/V heads (at least one), ``ffn / T`` MLP columns, with the output and down
products split by rows, their partial sums summed by the all-reduce the compiler emits for the shard's
group of chips (in the graph, as rank 0 runs it). Weights are zero-strided arrays of the storage type: the codegen needs
their shapes, never their values, and a 405B block is not materialised. The KV cache is resident state.

A mixture-of-experts block replaces the MLP by the router's product, the SwiGLU shards of the ``routed``
experts this chip runs for a token (the planner places the experts; a token's top-k experts run on
different chips side by side, one a chip where there are at least k chips) and the shared experts' columns
(DeepSeek's ``n_shared_experts``, split over the chips as a dense MLP is), their sums added before the one
all-reduce that combines the chips'.

A block with multi-head latent attention (DeepSeek-V3's MLA, ``BlockShape.mla``) is built in its decode
form, the up-projections absorbed into the query and the output as DeepSeek's inference code runs it: the
query's and the latent's down-projections split by columns over the chips and all-gathered (a product of
hidden × (q_lora_rank + kv_lora_rank + qk_rope_head_dim)), RMSNorm of the two latents, the query's
up-projection for this chip's heads (its no-rotary and rotary parts), each head's no-rotary query taken into
the latent space by its slice of the K up-projection (a batched product by a constant), rotary embeddings of
the rotary query and the one shared rotary key, the cache (``kv_lora_rank`` latent and ``qk_rope_head_dim``
rotary columns a position, no heads: every chip holds all of it) concatenated with the new position, the
scores as the latent and rotary products summed, softmax, the context in the latent space (the latent cache
is the values), each head's slice of the V up-projection, and the output projection by rows, all-reduced.
A prompt's prefill is built in the same absorbed form (it multiplies more than the expanded form would: an
upper bound on a prefill, never below it).

A sliding-window layer is the same graph at ``context = min(context, window)``: its cache keeps the window's
positions and its attention reads them (the planner sets that context).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...codegen.graph import PRODUCTS, Graph, NodeKind
from ...runtime_sim import Opcode


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
    routed: int = 1  # experts this chip runs for a token (a mixture of experts): their SwiGLUs one after another
    shared_ffn: int = 0  # the shared experts' MLP columns on this chip (0: none)
    mla: tuple = ()  # (q_lora_rank, kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim); (): not MLA
    qk_norm: bool = False  # an RMSNorm of each query and key head (Qwen3, Gemma 3)
    sandwich: bool = False  # an RMSNorm of attention's and the MLP's sums before each residual add (Gemma)


class _Builder:
    def __init__(self, dtype: np.dtype):
        self.g, self.dtype, self.count = Graph(), np.dtype(dtype), 0

    def weight(self, *shape) -> int:
        return self.g.add_tensor(shape, self.dtype, data=np.broadcast_to(np.zeros((), self.dtype), shape))

    def node(self, kind: str, inputs, shape, **attrs) -> int:
        self.count += 1
        if kind in PRODUCTS:
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


def collective_group(s: BlockShape):
    """The group the compiler runs the shard's collectives on (:func:`~lpx_tvm.codegen.parallel.collectives.
    choose`), or None for a shard alone."""
    if s.width == 1 or not s.system:
        return None
    from ...codegen.parallel.collectives import choose
    from ...codegen.target import system_of

    return choose(system_of(s.system), s.width)


def summer(b: _Builder, s: BlockShape, group):
    """``summed(partial)``: the hidden state's partial sums, all-reduced over ``group`` (unchanged alone)."""
    def summed(partial):
        if group is None:
            return partial
        tag = b.count * group.tags()  # (every node its own tags)
        return b.node(NodeKind.ALLREDUCE, [partial], (s.batch, s.tokens, s.hidden), rank=0, ranks=group.ranks,
                      tag=tag, group=group, rotated=False)
    return summed


def ffn_half(b: _Builder, s: BlockShape, x: int, summed) -> int:
    """The FFN half of a block shard on the hidden state ``x``: its RMSNorm, a mixture's router and the
    ``routed`` experts' SwiGLUs with the shared experts' (or the SwiGLU shard), this chip's sums added and then
    the chips' by ``summed`` (the group's all-reduce), a sandwich norm where the model has one, and the residual
    add. Returns the new hidden state."""
    hidden = (s.batch, s.tokens, s.hidden)

    def swiglu(n, columns):
        mlp = (s.batch, s.tokens, columns)
        gate = b.node(NodeKind.MATMUL, [n, b.weight(s.hidden, columns)], mlp)
        silu = b.node("MUL", [gate, b.node("SIGMOID", [gate], mlp)], mlp)
        up = b.node(NodeKind.MATMUL, [n, b.weight(s.hidden, columns)], mlp)
        return b.node(NodeKind.MATMUL, [b.node("MUL", [silu, up], mlp), b.weight(columns, s.hidden)], hidden)

    n = b.rms_norm(x, hidden)
    if s.experts:
        b.node(NodeKind.MATMUL, [n, b.weight(s.hidden, s.experts)], (s.batch, s.tokens, s.experts))
    terms = [swiglu(n, s.ffn) for _ in range(s.routed if s.experts else 1)]
    if s.shared_ffn:
        terms.append(swiglu(n, s.shared_ffn))
    down = terms[0]
    for term in terms[1:]:
        down = b.node("ADD", [down, term], hidden)
    down = summed(down)
    return b.node("ADD", [b.rms_norm(down, hidden) if s.sandwich else down, x], hidden)


def block_graph(shape: BlockShape, dtype, layers: int = 1) -> Graph:
    """``layers`` consecutive block shards; inputs: the hidden state, the rotary tables, the mask and each
    layer's K/V cache (resident state); output: the hidden state after the last block. On ``width`` chips the
    row-split products' partial sums (attention's output projection, the MLP's down projection) are summed by
    the all-reduce the compiler emits for that group of the system (:func:`~lpx_tvm.codegen.parallel.
    collectives.choose`): the graph is rank 0's, and its SENDs and RECVs are scheduled as every rank runs
    them (each RECV one hop after its SEND)."""
    b = _Builder(dtype)
    g, s = b.g, shape
    group = collective_group(s)
    summed = summer(b, s, group)
    hd, kvh, qh = s.head_dim, s.kv_heads, s.heads
    if s.mla:  # one latent "K/V head" all the chip's query heads read
        q_lora, kv_lora, rope_dim, nope, v_dim = s.mla
        kvh = 1
    rep = max(qh // kvh, 1)
    x = g.add_tensor((s.batch, s.tokens, s.hidden), b.dtype)
    rotary = rope_dim if s.mla else hd
    cos, sin = g.add_tensor((s.tokens, rotary), b.dtype), g.add_tensor((s.tokens, rotary), b.dtype)
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
        full_mask = b.weight(1, 1, rep * s.tokens, s.tokens)
    hidden = (s.batch, s.tokens, s.hidden)

    def rope(t, count, dim=hd):
        shape_ = (s.batch, count, s.tokens, dim)
        rot = b.node(NodeKind.MATMUL, [t, b.weight(dim, dim)], shape_)
        a = b.node("MUL", [t, cos], shape_)
        c = b.node("MUL", [rot, sin], shape_)
        return b.node("ADD", [a, c], shape_)

    def cached(new, width):
        """``new`` (batch, 1, tokens, width) after this layer's resident latent cache of ``width`` columns a
        position (MLA's: no heads)."""
        if not s.context:
            return new
        cache = g.add_tensor((s.batch, 1, s.context, width), b.dtype)
        g.inputs.append(cache)
        g.state.add(cache)
        return b.node("CONCAT", [cache, new], (s.batch, 1, keys, width), axis=2)

    def attend(scores, values, width):
        """Softmax of the stacked rows' scores, times the values: (batch, kvh, rep × tokens, width)."""
        scaled = b.node("MUL", [scores, b.weight()], (s.batch, kvh, rep * s.tokens, keys))
        masked = b.node("ADD", [scaled, full_mask], (s.batch, kvh, rep * s.tokens, keys))
        probs = b.node("SOFTMAX", [masked], (s.batch, kvh, rep * s.tokens, keys), axis=3)
        return b.node(NodeKind.MATMUL, [probs, values], (s.batch, kvh, rep * s.tokens, width))

    def latent_attention(n):
        """MLA's decode form (the module docstring): the output projection's partial sums."""
        width = q_lora + kv_lora + rope_dim
        if group is None:
            latent = b.node(NodeKind.MATMUL, [n, b.weight(s.hidden, width)], (s.batch, s.tokens, width))
        else:  # each chip makes its columns of the down-projections; the all-gather gives every chip all
            piece = -(-width // s.width)
            part = b.node(NodeKind.MATMUL, [n, b.weight(s.hidden, piece)], (s.batch, s.tokens, piece))
            latent = b.node(NodeKind.ALLGATHER, [part], (s.batch, s.tokens, piece * s.width), axis=2, rank=0,
                            ranks=group.ranks, tag=b.count * group.tags(), group=group)

        def cut(begin, size):
            return b.node("SLICE", [latent], (s.batch, s.tokens, size), begin=(0, 0, begin), step=(1, 1, 1))
        c_q = b.rms_norm(cut(0, q_lora), (s.batch, s.tokens, q_lora)) if q_lora else n
        c_kv = b.rms_norm(cut(q_lora, kv_lora), (s.batch, s.tokens, kv_lora))
        k_rope = cut(q_lora + kv_lora, rope_dim)

        def up(columns):
            proj = b.node(NodeKind.MATMUL, [c_q, b.weight(q_lora or s.hidden, qh * columns)], (s.batch, s.tokens, qh * columns))
            return b.node("TRANSPOSE", [b.alias(proj, (s.batch, s.tokens, qh, columns))],
                          (s.batch, qh, s.tokens, columns), perm=(0, 2, 1, 3))
        q_nope, q_rope = up(nope), rope(up(rope_dim), qh, rope_dim)
        # each head's no-rotary query into the latent space: its slice of the K up-projection, absorbed
        q_latent = b.node(NodeKind.MATMUL, [q_nope, b.weight(qh, nope, kv_lora)], (s.batch, qh, s.tokens, kv_lora))
        k_rope = rope(b.alias(k_rope, (s.batch, 1, s.tokens, rope_dim)), 1, rope_dim)
        c_kv = cached(b.alias(c_kv, (s.batch, 1, s.tokens, kv_lora)), kv_lora)
        k_rope = cached(k_rope, rope_dim)
        stacked = (s.batch, 1, qh * s.tokens)
        scores = b.node("ADD", [
            b.node(NodeKind.MATMUL, [b.alias(q_latent, stacked + (kv_lora,)),
                              b.node("TRANSPOSE", [c_kv], (s.batch, 1, kv_lora, keys), perm=(0, 1, 3, 2))],
                   stacked + (keys,)),
            b.node(NodeKind.MATMUL, [b.alias(q_rope, stacked + (rope_dim,)),
                              b.node("TRANSPOSE", [k_rope], (s.batch, 1, rope_dim, keys), perm=(0, 1, 3, 2))],
                   stacked + (keys,))], stacked + (keys,))
        ctx = attend(scores, c_kv, kv_lora)  # the latent cache is the values
        heads_v = b.node(NodeKind.MATMUL, [b.alias(ctx, (s.batch, qh, s.tokens, kv_lora)), b.weight(qh, kv_lora, v_dim)],
                         (s.batch, qh, s.tokens, v_dim))
        back = b.node("TRANSPOSE", [heads_v], (s.batch, s.tokens, qh, v_dim), perm=(0, 2, 1, 3))
        return b.node(NodeKind.MATMUL, [b.alias(back, (s.batch, s.tokens, qh * v_dim)), b.weight(qh * v_dim, s.hidden)],
                      hidden)

    for _ in range(layers):
        n = b.rms_norm(x, hidden)
        if s.mla:
            out = latent_attention(n)
        else:
            def heads(count, norm=False):
                proj = b.node(NodeKind.MATMUL, [n, b.weight(s.hidden, count * hd)], (s.batch, s.tokens, count * hd))
                split = b.alias(proj, (s.batch, s.tokens, count, hd))
                t = b.node("TRANSPOSE", [split], (s.batch, count, s.tokens, hd), perm=(0, 2, 1, 3))
                return b.rms_norm(t, (s.batch, count, s.tokens, hd)) if norm else t
            q = rope(heads(qh, s.qk_norm), qh)
            k = rope(heads(kvh, s.qk_norm), kvh)
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
            scores = b.node(NodeKind.MATMUL, [stacked, kt], (s.batch, kvh, rep * s.tokens, keys))
            ctx = attend(scores, v, hd)
            back = b.node("TRANSPOSE", [b.alias(ctx, (s.batch, qh, s.tokens, hd))], (s.batch, s.tokens, qh, hd),
                          perm=(0, 2, 1, 3))
            out = b.node(NodeKind.MATMUL, [b.alias(back, (s.batch, s.tokens, qh * hd)), b.weight(qh * hd, s.hidden)], hidden)
        out = summed(out)
        x = b.node("ADD", [b.rms_norm(out, hidden) if s.sandwich else out, x], hidden)
        x = ffn_half(b, s, x, summed)
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
    g.outputs = [b.node(NodeKind.MATMUL, [b.rms_norm(x, shape), b.weight(hidden, vocab)], (1, tokens, vocab))
                 if head else x]
    return g


def fusion_graph(hidden: int, fusion: int, tokens: int, dtype, width: int = 1, system: str = "") -> Graph:
    """A multi-token-prediction module's input (DeepSeek-V3's NextN, ``eh_proj``), for ``tokens`` positions: the
    token's embedding and the target's hidden state come from the host, each is RMSNormed (``enorm``,
    ``hnorm``), the two are concatenated (``fusion`` = 2 × hidden wide) and projected to the hidden size. On
    ``width`` chips of ``system`` each chip makes its ⌈hidden ÷ width⌉ columns and the all-gather the compiler
    emits for the group gives every chip the whole hidden state (as MLA's down-projections are split)."""
    b = _Builder(dtype)
    g = b.g
    half = (1, tokens, fusion // 2)
    embedded, state = g.add_tensor(half, b.dtype), g.add_tensor(half, b.dtype)
    g.inputs = [embedded, state]
    joined = b.node("CONCAT", [b.rms_norm(embedded, half), b.rms_norm(state, half)], (1, tokens, fusion), axis=2)
    group = collective_group(BlockShape(hidden, 1, 1, 1, 1, tokens, 0, 1, system=system, width=width))
    if group is None:
        g.outputs = [b.node(NodeKind.MATMUL, [joined, b.weight(fusion, hidden)], (1, tokens, hidden))]
        return g
    piece = -(-hidden // width)
    part = b.node(NodeKind.MATMUL, [joined, b.weight(fusion, piece)], (1, tokens, piece))
    g.outputs = [b.node(NodeKind.ALLGATHER, [part], (1, tokens, piece * width), axis=2, rank=0, ranks=group.ranks,
                        tag=b.count * group.tags(), group=group)]
    return g
