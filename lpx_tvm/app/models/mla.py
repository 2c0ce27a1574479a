"""A small DeepSeek-V3 multi-head latent attention (MLA) block with seeded random weights, in its two forms.

The attention is transformers' own ``DeepseekV3Attention`` (nothing downloaded): the query through a low rank
(``q_a_proj`` ─► RMSNorm ─► ``q_b_proj``), one down-projection of the hidden state to the latent and the
shared rotary key (``kv_a_proj_with_mqa``, ``kv_lora_rank + qk_rope_head_dim`` columns), the latent's RMSNorm,
its up-projection to every head's no-rotary key and value (``kv_b_proj``), rotary embeddings on the rotary
parts (interleaved pairs, as DeepSeek lays them out), the softmax scale ``(nope + rope) ** -0.5`` and
``o_proj``.

- :func:`mla_prefill` is the plain form as transformers runs it over a prompt (causal): the latent is expanded
  to every head's K and V. It also returns the latent cache the prompt leaves (each position's normalised
  latent, then its rotated rotary key), which the decode form reads.
- :func:`mla_decode` is the decode form with the up-projections absorbed, as DeepSeek's inference code runs a
  step: one new token against the cache of ``kv_lora_rank + qk_rope_head_dim`` values a position (no heads).
  Each head's no-rotary query is taken into the latent space by its slice of ``kv_b_proj`` (W_UK), so the
  scores are the query's latent and rotary parts against the cache as it lies; the context is a latent (the
  cache is the values) and each head's slice of ``kv_b_proj`` (W_UV) takes it to the head's value before
  ``o_proj``. It returns the output and the new position's cache entry.

:func:`export_mla` writes either form with ``torch.onnx`` (dynamo, fixed shapes).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class MlaShape:
    """The block's sizes (DeepSeek-V3's names; its published ones are 7168, 128, 1536, 512, 64, 128, 128)."""

    hidden: int = 256
    heads: int = 4
    q_lora_rank: int = 64
    kv_lora_rank: int = 32
    qk_rope_head_dim: int = 16
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32
    max_positions: int = 128

    @property
    def latent(self) -> int:
        """Cache values a position: the latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def deepseek_config(shape: MlaShape = MlaShape()):
    """A one-layer ``transformers.DeepseekV3Config`` of ``shape`` (eager attention)."""
    import transformers

    config = transformers.DeepseekV3Config(
        hidden_size=shape.hidden, num_attention_heads=shape.heads, num_key_value_heads=shape.heads,
        q_lora_rank=shape.q_lora_rank, kv_lora_rank=shape.kv_lora_rank, qk_rope_head_dim=shape.qk_rope_head_dim,
        qk_nope_head_dim=shape.qk_nope_head_dim, v_head_dim=shape.v_head_dim, num_hidden_layers=1,
        max_position_embeddings=shape.max_positions)
    config._attn_implementation = "eager"
    return config


def random_mla_attention(shape: MlaShape = MlaShape(), seed: int = 0):
    """transformers' ``DeepseekV3Attention`` of ``shape`` with seeded random weights.

    Parameters
    ----------
    shape : MlaShape
    seed : int
        ``torch.manual_seed``: the projections are drawn at std ``1 / sqrt(fan_in)``, the RMSNorm scales
        about 1 (not all 1, so a norm whose scale were dropped would show).

    Returns
    -------
    transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention
        In inference mode.
    """
    import torch
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    config = deepseek_config(shape)
    torch.manual_seed(seed)
    attention = DeepseekV3Attention(config, layer_idx=0).train(False)
    with torch.no_grad():
        for name, parameter in attention.named_parameters():
            if parameter.dim() == 2:
                parameter.normal_(0.0, parameter.shape[1] ** -0.5)
            else:  # the norms' scales
                parameter.uniform_(0.5, 1.5)
    return attention


@functools.lru_cache(maxsize=None)
def _classes():
    """The two forms' torch modules, defined on first use (the module imports without torch)."""
    import torch
    from transformers import DynamicCache
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    class Prefill(torch.nn.Module):
        def __init__(self, attention):
            super().__init__()
            self.attention, self.rotary = attention, hf.DeepseekV3RotaryEmbedding(attention.config)

        def forward(self, hidden_states, position_ids):
            seq = hidden_states.shape[1]
            position_embeddings = self.rotary(hidden_states, position_ids)
            mask = torch.full((seq, seq), torch.finfo(hidden_states.dtype).min).triu(1)[None, None]
            cache = DynamicCache(config=self.attention.config)
            out, _ = self.attention(hidden_states, position_embeddings, mask, cache=cache)
            layer = cache.layers[0]  # the latent [B, 1, S, kv_lora] and the rotated rotary key [B, 1, S, rope]
            return out, torch.cat([layer.keys, layer.values], dim=-1)[:, 0]

    class Decode(torch.nn.Module):
        def __init__(self, attention):
            super().__init__()
            a = attention
            self.attention, self.rotary = a, hf.DeepseekV3RotaryEmbedding(a.config)
            heads, nope, v, rank = a.num_heads, a.qk_nope_head_dim, a.v_head_dim, a.kv_lora_rank
            w = a.kv_b_proj.weight.detach().view(heads, nope + v, rank)
            self.register_buffer("w_uk", w[:, :nope].clone())  # [heads, nope, rank]: q_nope ─► the latent space
            self.register_buffer("w_uv", w[:, nope:].transpose(1, 2).contiguous())  # [heads, rank, v]
            self.apply_rotary = (hf.apply_rotary_pos_emb_interleave if a.config.rope_interleave
                                 else hf.apply_rotary_pos_emb)

        def forward(self, hidden_states, position_ids, past_latent):
            a = self.attention
            batch = hidden_states.shape[0]
            rank, rope = a.kv_lora_rank, a.qk_rope_head_dim
            q = a.q_b_proj(a.q_a_layernorm(a.q_a_proj(hidden_states)))
            q = q.view(batch, 1, a.num_heads, a.qk_head_dim).transpose(1, 2)  # [B, heads, 1, nope + rope]
            q_nope, q_rot = torch.split(q, [a.qk_nope_head_dim, rope], dim=-1)
            latent, k_rot = torch.split(a.kv_a_proj_with_mqa(hidden_states), [rank, rope], dim=-1)
            latent = a.kv_a_layernorm(latent)
            cos, sin = self.rotary(hidden_states, position_ids)
            q_rot, k_rot = self.apply_rotary(q_rot, k_rot.view(batch, 1, 1, rope), cos, sin)
            new = torch.cat([latent, k_rot.view(batch, 1, rope)], dim=-1)  # [B, 1, rank + rope]
            cache = torch.cat([past_latent, new], dim=1)[:, None]  # [B, 1, P + 1, rank + rope]: one head for all
            query = torch.cat([torch.matmul(q_nope, self.w_uk), q_rot], dim=-1)  # [B, heads, 1, rank + rope]
            scores = torch.matmul(query, cache.transpose(2, 3)) * a.scaling
            probs = torch.softmax(scores, dim=-1)
            context = torch.matmul(probs, cache[..., :rank])  # [B, heads, 1, rank]: the latent cache is the values
            heads = torch.matmul(context, self.w_uv)  # [B, heads, 1, v]
            return a.o_proj(heads.transpose(1, 2).reshape(batch, 1, a.num_heads * a.v_head_dim)), new

    return Prefill, Decode


def mla_prefill(attention):
    """The plain (prefill) form as a torch module: ``forward(hidden_states [B, S, hidden], position_ids [B, S])``
    ─► ``(output [B, S, hidden], latent cache [B, S, kv_lora_rank + qk_rope_head_dim])``, causal over the S
    positions, transformers' attention as it runs (its cache written and returned).

    Parameters
    ----------
    attention : DeepseekV3Attention
        From :func:`random_mla_attention`.

    Returns
    -------
    torch.nn.Module
    """
    return _classes()[0](attention).train(False)


def mla_decode(attention):
    """The decode form, up-projections absorbed, as a torch module: ``forward(hidden_states [B, 1, hidden],
    position_ids [B, 1], past_latent [B, P, kv_lora_rank + qk_rope_head_dim])`` ─► ``(output [B, 1, hidden],
    new_latent [B, 1, kv_lora_rank + qk_rope_head_dim])``; the token attends to the P cached positions and
    itself.

    Parameters
    ----------
    attention : DeepseekV3Attention
        Its projections and norms are shared; W_UK and W_UV (per-head slices of ``kv_b_proj``) are derived
        once, as constants.

    Returns
    -------
    torch.nn.Module
    """
    return _classes()[1](attention).train(False)


def export_mla(module, args, names, outputs):
    """``module`` on ``args`` as an ONNX model, by ``torch.onnx`` (dynamo, the shapes of ``args`` fixed).

    Parameters
    ----------
    module : torch.nn.Module
        :func:`mla_prefill` or :func:`mla_decode`
    args : tuple of torch.Tensor
    names, outputs : list of str
        The graph's input and output names.

    Returns
    -------
    onnx.ModelProto
    """
    import torch

    with torch.no_grad():
        program = torch.onnx.export(module.train(False), args, input_names=names, output_names=outputs,
                                    dynamo=True, optimize=True, verbose=False)
    return program.model_proto
