"""What a decode mapping costs: the model's shape, the compiler's numbers for one block shard, the network
between the chips, the floor the preset's figures set, and one mapping's figures (:func:`evaluate`).

The numbers come from the compiler, not a roofline. For each tensor-parallel width T one shard of one block
(:mod:`.plan_graph`: the graph lowering produces for the :mod:`.llama` decoder, its two all-reduces as the
compiler emits them for T chips of the system) runs through the real codegen on the chip model (tile, alloc,
list schedule, the timing-only simulator): two consecutive blocks minus one gives a block's cycles in the middle
of a stage, free of the program's host transfers; the LM head's shard likewise. A pipeline of S stages × T
chips then takes, per token:

    L blocks (each with its all-reduces) + (S − 1) stage-to-stage hand-offs + the LM head
      + writing the new K/V into the resident cache

The weights, the KV cache for the context, and the activations are placed by the real allocator: a mapping
whose shard streams weights from the host, or does not fit, is not a mapping. Nothing is materialised: the
weights are zero-strided arrays the codegen never reads.

A mixture of experts places its experts over the T chips of a stage (T/E chips an expert when T ≥ E, else
E/T experts a chip); a token's top-k experts run side by side, and the MLP's all-reduce combines them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import lru_cache
from math import ceil
from numbers import Integral
from pathlib import Path

from ...codegen.parallel.collectives import CollectiveError
from ...codegen.target import Target, system_of
from ...runtime_sim import ChipConfig, DType
from ...runtime_sim.errors import LpxUserError
from ...runtime_sim.system import SystemConfig
from .graph import BlockShape, block_graph, fusion_graph, head_graph


_HF_KEYS = {"hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
            "vocab_size", "rope_theta", "tie_word_embeddings", "num_local_experts", "num_experts_per_tok",
            "head_dim", "max_position_embeddings",
            # mixtures: routed experts by their three names, a shared expert, dense layers among them
            "n_routed_experts", "num_experts", "experts_per_token", "moe_intermediate_size", "n_shared_experts",
            "first_k_dense_replace", "moe_layer_freq", "decoder_sparse_step", "mlp_only_layers",
            # multi-head latent attention
            "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
            # sliding windows, layer by layer
            "sliding_window", "use_sliding_window", "max_window_layers", "layer_types", "sliding_window_pattern",
            "_sliding_window_pattern", "sliding_window_size",
            # read to refuse where set: a tanh of every score or logit the block does not have
            "attn_logit_softcapping", "final_logit_softcapping"}
_HF_IGNORED = {"architectures", "model_type", "torch_dtype", "bos_token_id", "eos_token_id", "pad_token_id",
               "transformers_version", "hidden_act", "initializer_range", "rms_norm_eps", "rope_scaling",
               "use_cache", "attention_bias", "attention_dropout", "mlp_bias", "pretraining_tp",
               "output_router_logits", "router_aux_loss_coef", "router_jitter_noise", "_name_or_path",
               "name", "source",
               # training settings, the reference code's parallelism hint, position-encoding constants, a
               # scale, the activation's name (priced as SiLU's: GELU's tanh form is a few vector ops too)
               "aux_loss_alpha", "seq_aux", "ep_size", "auto_map", "initial_context_length", "rope_local_base_freq",
               "query_pre_attn_scalar", "hidden_activation", "cache_implementation",
               # the router's choice among its scores (the router's product is priced; choosing the top k of E
               # scores, as every mixture here, is not: E is at most 384 scores a token)
               "n_group", "topk_group", "topk_method", "scoring_func", "norm_topk_prob", "routed_scaling_factor",
               # a multimodal config's token ids
               "boi_token_index", "eoi_token_index", "image_token_index", "mm_tokens_per_image"}
# read, and said in the plan (``ModelSpec.notes``), because they are published but not what decoding runs
_HF_NOTED = {
    "num_nextn_predict_layers": "the multi-token-prediction layers ({}) are not placed: they draft tokens for "
                                "speculative decoding, which plain decoding does not run",
    "quantization_config": "the published weights are {}; the plan stores every weight in its --dtype",
    "vision_config": "the image encoder is not planned (a text token's decode does not run it)",
    "swiglu_limit": "the experts' SwiGLU clamp at {} (two vector ops a column) is not in the block",
}
# what Hugging Face's config class fills in where a published file leaves a key out (transformers'
# Gemma3TextConfig and Gemma2Config), for the keys the plan reads
_MODEL_TYPE_DEFAULTS = {"gemma3_text": {"vocab_size": 262208, "tie_word_embeddings": True, "head_dim": 256,
                                        "sliding_window_pattern": 6, "sliding_window": 4096},
                        "gemma2": {"tie_word_embeddings": True, "head_dim": 256}}
# architectures whose attention normalises each query and key head (an RMSNorm of every head's vector)
_QK_NORM = {"qwen3", "qwen3_moe", "gemma3_text"}
# architectures with an RMSNorm after attention and after the MLP as well as before (Gemma's "sandwich")
_SANDWICH = {"gemma2", "gemma3_text"}
# what is known of an architecture and not in its block, said in the plan
_ARCH_NOTES = {"gpt_oss": ("attention sinks (a learned logit a head in each softmax's sum) are not in the block; "
                           "nor are the projections' and experts' biases")}
# a multi-token-prediction module published as a draft model of its own: its config is the target's (SGLang's
# scripts/export_deepseek_nextn.py replaces ``architectures`` alone), and what it runs is the module, not the target
_NEXTN_ARCHITECTURES = {"DeepseekV3ForCausalLMNextN"}
# the words in an architecture's name that say a draft of another shape (EAGLE's fused hidden states, Medusa's
# heads, another family's MTP module): refused by name unless planned above
_DRAFT_WORDS = ("nextn", "eagle", "medusa", "mtp")

# published configs, one file each (``configs/NAME.json``, naming its Hugging Face repository)
_CONFIG_DIR = Path(__file__).with_name("configs")
PRESETS = {p.stem: {k: v for k, v in json.loads(p.read_text()).items() if k not in ("name", "source")}
           for p in sorted(_CONFIG_DIR.glob("*.json"))}


class PlanError(LpxUserError):
    """A model or system the planner cannot plan for, naming what was wrong."""


@dataclass(frozen=True)
class ModelSpec:
    """The architecture a plan needs, from a Hugging Face style config.

    Beside a Llama's sizes: a mixture's ``experts`` (routed), ``top_k``, each expert's MLP width ``moe_ffn``
    (0: ``ffn``), ``shared_experts`` and the ``dense_layers`` (indexes) whose MLP is dense (``ffn`` wide);
    multi-head latent attention's ``mla`` = (q_lora_rank, kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim,
    v_head_dim); the ``sliding`` layers (indexes) that attend to the last ``window`` positions; ``notes``,
    what the config says that the plan reads but does not price (in words, for the report); and ``fusion``, a
    multi-token-prediction module's input (DeepSeek-V3's NextN): the token's embedding and the target's hidden
    state, each RMSNormed, concatenated (``fusion`` = 2 × hidden wide) and projected to the hidden size before
    its first layer (:func:`.graph.fusion_graph`).
    """

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool = False
    experts: int = 0
    top_k: int = 0
    head_size: int = 0  # the config's head_dim, where it is not hidden ÷ heads
    moe_ffn: int = 0
    shared_experts: int = 0
    dense_layers: tuple = ()
    mla: tuple = ()
    window: int = 0
    sliding: tuple = ()
    qk_norm: bool = False
    sandwich: bool = False
    notes: tuple = ()
    fusion: int = 0  # a multi-token-prediction module's input projection (2 × hidden wide; 0: none)

    @property
    def head_dim(self) -> int:
        if self.mla:  # a query and key head: no-rotary and rotary parts
            return self.mla[2] + self.mla[3]
        return self.head_size or self.hidden // self.heads

    @property
    def experts_per_token(self) -> int:
        return self.top_k or 1

    @property
    def expert_ffn(self) -> int:
        return self.moe_ffn or self.ffn

    def is_moe(self, layer: int) -> bool:
        return bool(self.experts) and layer not in self.dense_layers

    def is_sliding(self, layer: int) -> bool:
        return layer in self.sliding

    def kinds(self) -> list:
        """Each layer's kind, ``(mixture of experts, sliding window)``, in order."""
        return [(self.is_moe(i), self.is_sliding(i)) for i in range(self.layers)]

    def layer_context(self, layer: int, context: int) -> int:
        """The positions a layer's cache keeps and its attention reads: a sliding layer's window at most."""
        return min(context, self.window) if self.is_sliding(layer) else context

    def kv_width(self, width: int = 1) -> int:
        """Cache elements a position a layer on one chip of a ``width``-wide group: K and V of its K/V heads (one
        where the heads are fewer than the chips, replicated), or MLA's latent and rotary key (whole on each)."""
        if self.mla:
            return self.mla[1] + self.mla[2]
        return 2 * max(self.kv_heads // width, 1) * self.head_dim

    def attention_params(self) -> int:
        if not self.mla:
            return self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        q_lora, kv_lora, rope, nope, v = self.mla
        q = (self.hidden * q_lora + q_lora + q_lora * self.heads * (nope + rope) if q_lora
             else self.hidden * self.heads * (nope + rope))
        kv = self.hidden * (kv_lora + rope) + kv_lora + kv_lora * self.heads * (nope + v)
        return q + kv + self.heads * v * self.hidden

    def mlp_params(self, layer: int, active: bool = False) -> int:
        """A layer's MLP: dense, or the router, the routed experts (a token's top k where ``active``) and the
        shared ones."""
        if not self.is_moe(layer):
            return 3 * self.hidden * self.ffn
        routed = self.experts_per_token if active else self.experts
        return 3 * self.hidden * self.expert_ffn * (routed + self.shared_experts) + self.hidden * self.experts

    def layer_params(self, layer: int, active: bool = False) -> int:
        norms = 4 if self.sandwich else 2
        qk = 2 * self.head_dim if self.qk_norm else 0  # the query's and the key's per-head RMSNorm weights
        return self.attention_params() + self.mlp_params(layer, active) + norms * self.hidden + qk

    def block_params(self) -> int:
        """The last layer's parameters (every layer's, where they are alike)."""
        return self.layer_params(self.layers - 1)

    def fusion_params(self) -> int:
        """A multi-token-prediction module's input: its projection (``eh_proj``) and its two RMSNorms."""
        return self.fusion * self.hidden + 2 * self.hidden if self.fusion else 0

    def params(self) -> int:
        return sum(self.layer_params(i) for i in range(self.layers)) + self.fusion_params() \
            + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def chip_params(self) -> int:
        """The parameters the chips hold: all but an untied token-embedding table, whose lookup runs on the
        host (as the compiler places it; a tied table is the LM head on the chips)."""
        return self.params() - (0 if self.tied else self.vocab * self.hidden)

    def cache_bytes(self, context: int, batch: int, dtype: str, width: int = 1) -> int:
        """The cache the chips hold for ``batch`` sequences of ``context`` positions, each layer its positions (a
        sliding layer's window at most), on a ``width``-wide group: every chip its share, replicated K/V heads
        and MLA's latent once a chip."""
        positions = sum(self.layer_context(i, context) for i in range(self.layers))
        return width * self.kv_width(width) * positions * batch * DType.from_name(dtype).itemsize


def model_spec(model) -> ModelSpec:
    """A ModelSpec from a preset name, a config.json path, a dict, or a ``LlamaConfig``.

    A Hugging Face config is read as published: a multimodal one's ``text_config`` is the decoder, and a key
    its model type's config class fills in by default is taken from there. Every key is read, known to cost
    nothing (``_HF_IGNORED``), or said in the plan (``_HF_NOTED``); any other is an error naming it.
    """
    from ..models import llama

    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, llama.LlamaConfig):
        return ModelSpec("llama", model.hidden_size, model.num_layers, model.num_heads, model.num_kv_heads,
                         model.intermediate_size, model.vocab_size, model.tie_word_embeddings)
    name, data = str(model), model
    if isinstance(model, dict):
        name = model.get("name", "model")
    elif name in PRESETS:
        data = PRESETS[name]
    elif name in llama.PRESETS:
        return replace(model_spec(llama.PRESETS[name]), name=name)
    else:
        path = Path(name)
        if not path.is_file():
            raise PlanError(f"model {name!r} is neither a preset ({', '.join(list(PRESETS) + list(llama.PRESETS))}) "
                            "nor a config.json file")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise PlanError(f"{path}: not JSON ({err})") from None
        # Hugging Face's layout names the folder (llama-2-70b/config.json); any other file names itself
        name = (path.resolve().parent.name if path.name == "config.json" else path.stem) or path.stem
    notes = []
    if isinstance(data.get("text_config"), dict):  # a multimodal model: its language model decodes
        outer = {k: v for k, v in data.items() if k != "text_config"}
        _check_keys(name, outer, notes)
        data = data["text_config"]
    data = {**_MODEL_TYPE_DEFAULTS.get(data.get("model_type"), {}), **data}
    _check_keys(name, data, notes)
    model_type = data.get("model_type")
    notes += [_ARCH_NOTES[model_type]] if model_type in _ARCH_NOTES else []
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if data.get(key) is not None:
            raise PlanError(f"model {name!r}: {key} {data[key]} is not modelled by the plan (a tanh of every "
                            "attention score or logit the block does not have)")
    try:
        hidden, layers = int(data["hidden_size"]), int(data["num_hidden_layers"])
        heads = int(data["num_attention_heads"])
        kv_heads = int(data.get("num_key_value_heads") or heads)
        ffn, vocab = int(data["intermediate_size"]), int(data["vocab_size"])
    except KeyError as err:
        raise PlanError(f"model {name!r}: config has no {err.args[0]}") from None
    experts = int(_first(data, "n_routed_experts", "num_local_experts", "num_experts") or 0)
    top_k = int(_first(data, "num_experts_per_tok", "experts_per_token") or 0)
    mla = ()
    if data.get("kv_lora_rank"):
        try:
            mla = (int(data.get("q_lora_rank") or 0), int(data["kv_lora_rank"]), int(data["qk_rope_head_dim"]),
                   int(data["qk_nope_head_dim"]), int(data["v_head_dim"]))
        except KeyError as err:
            raise PlanError(f"model {name!r}: multi-head latent attention (kv_lora_rank) without {err.args[0]}") \
                from None
        kv_heads = heads  # (no K/V heads: the latent is every head's)
    window, sliding = _sliding_layers(name, data, layers)
    dense = _dense_layers(name, data, layers) if experts else ()
    fusion = 0
    nextn = _draft_architecture(name, data)
    if nextn:  # the module alone: its layers follow the target's (their indexes say dense or experts)
        count = int(data.get("num_nextn_predict_layers") or 0)
        if count < 1:
            raise PlanError(f"model {name!r}: {nextn} without num_nextn_predict_layers (its layers)")
        if sliding:
            raise PlanError(f"model {name!r}: {nextn} with sliding-window layers is not modelled by the plan")
        dense = tuple(i - layers for i in (_dense_layers(name, data, layers + count) if experts else ())
                      if i >= layers)
        layers, fusion = count, 2 * hidden
        notes = [n for n in notes if not n.startswith("the multi-token-prediction layers")] + [
            f"{nextn}: the target's multi-token-prediction module as a draft, its {count} layer(s) after the "
            "token's embedding and the target's hidden state fused (eh_proj, 2 × hidden → hidden), with its own "
            "LM head; the target's hidden state comes to it from the host"]
    spec = ModelSpec(name, hidden, layers, heads, kv_heads, ffn, vocab, bool(data.get("tie_word_embeddings", False)),
                     experts, top_k, int(data.get("head_dim") or 0), int(data.get("moe_intermediate_size") or 0),
                     int(data.get("n_shared_experts") or 0), dense,
                     mla, window, sliding, model_type in _QK_NORM, model_type in _SANDWICH, tuple(notes), fusion)
    if (spec.hidden % spec.heads and not spec.head_size and not mla) or spec.heads % spec.kv_heads:
        raise PlanError(f"model {name!r}: hidden_size must divide by the heads, and the heads by the KV heads")
    if experts and not 0 < spec.experts_per_token <= experts:
        raise PlanError(f"model {name!r}: {spec.experts_per_token} experts a token of {experts}")
    return spec


def _draft_architecture(name: str, data: dict) -> str:
    """The multi-token-prediction architecture the config names (:data:`_NEXTN_ARCHITECTURES`), or "" for a
    model of its own; another draft architecture (EAGLE, Medusa, another MTP module) is refused by name."""
    for arch in data.get("architectures") or []:
        if arch in _NEXTN_ARCHITECTURES:
            return arch
        if any(word in str(arch).lower() for word in _DRAFT_WORDS):
            raise PlanError(f"model {name!r}: architecture {arch} is a draft model the plan does not model (it "
                            f"plans {', '.join(sorted(_NEXTN_ARCHITECTURES))} and decoders of their own)")
    return ""


def _first(data: dict, *keys):
    return next((data[k] for k in keys if data.get(k) is not None), None)


def _check_keys(name: str, data: dict, notes: list) -> None:
    """Every key of ``data`` read, known to cost nothing, or noted (into ``notes``); else a PlanError."""
    unknown = sorted(set(data) - _HF_KEYS - _HF_IGNORED - set(_HF_NOTED) - {"text_config"})
    if unknown:
        raise PlanError(f"model {name!r}: unknown config key {', '.join(unknown)} (a plan reads "
                        f"{', '.join(sorted(_HF_KEYS))})")
    for key, words in _HF_NOTED.items():
        value = data.get(key)
        if value:
            if isinstance(value, dict):
                value = value.get("quant_method") or value.get("model_type") or "given"
            notes.append(words.format(value))


def _dense_layers(name: str, data: dict, layers: int) -> tuple:
    """The layers of a mixture whose MLP is dense: DeepSeek's first ``first_k_dense_replace`` and those off its
    ``moe_layer_freq``, Qwen's ``mlp_only_layers`` and those off its ``decoder_sparse_step`` (as their
    reference code chooses)."""
    first = int(data.get("first_k_dense_replace") or 0)
    freq, step = data.get("moe_layer_freq", 1), data.get("decoder_sparse_step", 1)
    only = data.get("mlp_only_layers") or []
    for key, value in (("moe_layer_freq", freq), ("decoder_sparse_step", step)):
        if not isinstance(value, int) or value < 1:
            raise PlanError(f"model {name!r}: {key} {value!r} is not modelled by the plan (a positive integer is)")
    return tuple(i for i in range(layers)
                 if i < first or i % freq or (i + 1) % step or i in only)


def _sliding_layers(name: str, data: dict, layers: int) -> tuple:
    """``(window, sliding layer indexes)``: ``layer_types`` where given (sliding_attention or full_attention,
    anything else refused), else as the architecture's config class derives them: a pattern of every Nth
    layer full (Gemma 3), alternate layers (Gemma 2), the layers from ``max_window_layers`` on where
    ``use_sliding_window`` is set (Qwen), else every layer (Mistral). No window, or ``use_sliding_window``
    false: none."""
    window = data.get("sliding_window") or data.get("sliding_window_size")
    types = data.get("layer_types")
    if types is not None:
        if len(types) != layers:
            raise PlanError(f"model {name!r}: layer_types names {len(types)} layers of {layers}")
        other = sorted(set(types) - {"sliding_attention", "full_attention"})
        if other:
            raise PlanError(f"model {name!r}: layer_types {', '.join(other)} is not modelled by the plan "
                            "(it plans sliding_attention and full_attention)")
        sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
        if sliding and not window:
            raise PlanError(f"model {name!r}: layer_types has sliding_attention layers but no sliding_window")
        return (int(window), sliding) if sliding else (0, ())
    if not window or data.get("use_sliding_window") is False:
        return 0, ()
    pattern = data.get("sliding_window_pattern") or data.get("_sliding_window_pattern")
    if pattern:
        sliding = tuple(i for i in range(layers) if (i + 1) % int(pattern))
    elif data.get("model_type") == "gemma2":
        sliding = tuple(range(0, layers, 2))
    elif data.get("use_sliding_window") and data.get("max_window_layers") is not None:
        sliding = tuple(range(int(data["max_window_layers"]), layers))
    else:
        sliding = tuple(range(layers))
    return (int(window), sliding) if sliding else (0, ())


# ---- the compiler's numbers ----------------------------------------------------------------------------
@dataclass(frozen=True)
class ShardCost:
    """What the codegen measured for one program shape: cycles, where they went, what it keeps resident."""

    cycles: int
    breakdown: dict  # cause ─► cycles of the block's critical path (matrix, vector, latency, ...: runtime_sim.critical)
    resident_bytes: int  # weights and cache of one block shard
    activation_bytes: int
    streamed: bool  # some weights would stream from the host: the shard does not fit


def _measure(graph, chip: ChipConfig) -> ShardCost | None:
    """A block shard through the codegen's own stages (tile to emit, as a pipeline stage holds its weights),
    timed by the timing-only simulator; None when it does not fit the chip."""
    from ...codegen import CapacityError, Target, Compilation, run_stages
    from ...codegen.parallel.base import weight_budget
    from ...runtime_sim import Simulator

    budget = weight_budget(graph, chip)
    weights = sum(graph.tensors[k].nbytes for k in range(len(graph.tensors)) if graph.is_constant(k))
    if weights > budget:  # the tiler would stream some of them (or fail to place them): not a mapping either way
        return ShardCost(0, {}, weights, 0, True)
    c = Compilation("block", Target.parse(config=chip), graph=graph, resident_budget=budget)
    try:
        program = run_stages(c, "tile", "emit")
    except CapacityError:
        return None
    stats = Simulator(program, chip, timing_only=True).stats
    resident = sum(const.ref.nbytes for const in program.constants) + sum(r.nbytes for _, r in program.state)
    return ShardCost(stats.cycles, dict(stats.critical), resident, c.addr["high_water"] - resident, bool(program.streamed))


def _as_built(chip: ChipConfig, dtype: str) -> tuple:
    """The chip and storage type a block is built in. int8 is planned as one-byte storage at the int8 matrix
    rate: built in fp8 on a variant of the chip whose fp8 rate is its int8 rate (the QDQ flow's quantise and
    dequantise steps are not modelled)."""
    if dtype != "int8":
        return chip, dtype
    from ...runtime_sim import derive_config

    return derive_config(chip, {"mxm_passes": {"fp8": chip.mxm_passes["int8"]}}, f"{chip.name}+int8-as-fp8"), "fp8"


@lru_cache(maxsize=512)
def _blocks(chip: ChipConfig, shape: BlockShape, dtype: str, layers: int) -> ShardCost | None:
    """``layers`` block shards as one program, on the chip and in the storage type they are built in
    (:func:`_as_built`)."""
    return _measure(block_graph(shape, DType.from_name(dtype).np, layers), chip)


def block_cost(chip: ChipConfig, shape: BlockShape, dtype: str, alone: bool = False) -> ShardCost | None:
    """A block shard's cycles in the middle of a stage (two blocks minus one), or None when it cannot fit.

    With ``alone``, a block that fits only by itself is timed as a whole program (its host transfers and
    pipeline fill included, so an upper bound), as for a prompt's prefill where two blocks' activations
    and weights do not fit one chip."""
    chip, dtype = _as_built(chip, dtype)
    one = _blocks(chip, shape, dtype, 1)
    if one is None or one.streamed:  # a block that streams its weights is no mapping: two would too
        return one
    two = _blocks(chip, shape, dtype, 2)
    if alone and (two is None or two.streamed):  # fits only alone
        return one
    if two is None:
        return None
    per_block = two.cycles - one.cycles
    # a block's causes mid-stage, two blocks' less one's (the host transfers at the ends cancel), where that
    # is not negative (the two critical paths may take different routes), scaled to the block's cycles
    difference = {k: max(two.breakdown.get(k, 0) - one.breakdown.get(k, 0), 0) for k in two.breakdown}
    if not any(difference.values()):
        difference = one.breakdown
    scale = per_block / max(sum(difference.values()), 1)
    breakdown = {k: v * scale for k, v in difference.items() if v}
    return ShardCost(per_block, breakdown, two.resident_bytes - one.resident_bytes, one.activation_bytes,
                     one.streamed or two.streamed)


@lru_cache(maxsize=64)
def head_cost(chip: ChipConfig, hidden: int, vocab: int, tokens: int, dtype: str) -> ShardCost | None:
    """The final RMSNorm and ``vocab`` LM-head columns as a program of their own (its input from the host)."""
    chip, dtype = _as_built(chip, dtype)
    return _measure(head_graph(hidden, vocab, tokens, DType.from_name(dtype).np), chip)


@lru_cache(maxsize=64)
def fusion_cost(chip: ChipConfig, hidden: int, fusion: int, tokens: int, dtype: str, width: int = 1,
                system: str = "") -> ShardCost | None:
    """A multi-token-prediction module's input fusion (:func:`.graph.fusion_graph`) as a program of its own: its
    two inputs from the host (the embedding's row and the target's hidden state), this chip's columns of the
    projection and the group's all-gather. Its output's transfer back to the host is in its cycles, where the
    first block would take it on the chip: a bound above by that much."""
    chip, dtype = _as_built(chip, dtype)
    return _measure(fusion_graph(hidden, fusion, tokens, DType.from_name(dtype).np, width, system), chip)


@lru_cache(maxsize=64)
def head_step_cycles(chip: ChipConfig, hidden: int, vocab: int, tokens: int, dtype: str) -> int | None:
    """What the LM head adds to a pipeline's last stage, its input already on the chip: the residual add
    that ends a block with the head after it, less the add alone (the host transfer of their input cancels).
    None where the head does not fit."""
    chip, dtype = _as_built(chip, dtype)
    np_dtype = DType.from_name(dtype).np
    with_head = _measure(head_graph(hidden, vocab, tokens, np_dtype, after=True), chip)
    if with_head is None or with_head.streamed:
        return None
    alone = _measure(head_graph(hidden, vocab, tokens, np_dtype, after=True, head=False), chip)
    return with_head.cycles - alone.cycles


# ---- the network -----------------------------------------------------------------------------------------
def transfer_cycles(nbytes: int, hops: int, chip: ChipConfig, hop: int) -> int:
    return hops * hop + ceil(nbytes / chip.c2c_bytes_per_cycle)


def stage_hops(system: SystemConfig, stages: int, width: int) -> int:
    """Hops between two consecutive stages: one inside a node (or a fully connected system, or a grid of
    nodes, where each chip is linked to its counterpart in every other node), else the system's worst case
    between nodes."""
    node = system.figures.get("node_chips", system.chips if system.topology == "fully-connected" else 8)
    if stages * width <= node or system.topology in ("fully-connected", "node-grid"):
        return 1
    return int(system.figures.get("max_hops", 3))


def floor_cycles(spec: ModelSpec, system: SystemConfig, dtype: str, context: int, chips: int, batch: int = 1) -> dict:
    """The bound the preset's own figures set on a token's time, at the best tensor-parallel width T.

    Per layer, each chip of T: its share of the weights a token reads through the fastest weight path
    (installing into the matrix planes: planes × install streams × a vector a cycle; a mixture's top-k and
    shared experts, a dense MLP where the layer has one), its share of the K/V cache at the SRAM rate (a
    sliding-window layer's window of it at most; multi-head latent attention's latent cache whole, as every
    chip of the group reads it), and two all-reduces of the hidden state (and MLA's all-gather of its
    down-projections, q_lora_rank + kv_lora_rank + qk_rope_head_dim columns), each the hops across the
    diameter of the group the compiler's collectives use (one all linked, two across a grid of nodes, half a
    ring; a width no collective joins is not a mapping) and its bytes over the links a pair has.
    Then the LM head's share, and a hop between each two of the S stages the weights need (S × T ≤ chips; from
    rack to rack on a system of racks, its rack-to-rack latency). A multi-token-prediction module's input
    fusion adds its projection's share to the weights and its all-gather of the hidden state.
    No unit latency, no dependence: nothing any schedule could remove is left out, nothing else is in.

    Returns
    -------
    dict
        ``cycles``, ``width``, ``stages`` and the per-token ``parts`` (weights, KV cache, collectives, head).
    """
    chip = system.chip
    item = DType.from_name(dtype).itemsize
    install = chip.mxm_planes * chip.mxm_install_streams * chip.lanes  # bytes a cycle into the planes
    sram = chip.sram_bytes_per_cycle
    # the weights one token reads, layer by layer: its experts' only (a mixture's), the shared ones, a dense MLP
    layer_weights = [spec.layer_params(i, active=True) * item for i in range(spec.layers)]
    # the cache each layer reads: a sliding layer's window at most; MLA's latent is read whole by every chip
    # (it has no heads to split), K/V heads by the chips that hold them
    kv = [batch * spec.kv_width() * spec.layer_context(i, context) * item for i in range(spec.layers)]
    hidden = batch * spec.hidden * item
    latent = batch * (spec.mla[0] + spec.mla[1] + spec.mla[2]) * item if spec.mla else 0
    total = spec.chip_params() * item + spec.cache_bytes(context, batch, dtype)
    from ...codegen.parallel.collectives import choose

    best = None
    for width in _widths(spec, chips, system):
        stages = max(1, ceil(total / (width * chip.sram_bytes)))
        if stages * width > chips or stages > spec.layers:
            continue
        try:  # the group the compiler would run the width's collectives on (as the plan's search does)
            group = choose(system if system.simulated else system_of(_group_system(system)), width)
        except CollectiveError:
            continue

        def collective(nbytes):
            return 0 if width == 1 else group.diameter * system.hop_cycles + ceil(
                nbytes / width / (group.links * chip.c2c_bytes_per_cycle))
        readers = 1 if spec.mla else min(width, spec.kv_heads)
        # two all-reduces of the hidden state a layer; MLA's all-gather of its down-projections' columns too
        parts = {"weights": sum(ceil(w / width / install) for w in layer_weights)
                 + ceil(spec.fusion * spec.hidden * item / width / install),
                 "KV cache": sum(ceil(k / readers / sram) for k in kv),
                 "collectives": spec.layers * (2 * collective(hidden) + (collective(latent) if latent else 0))
                 + (collective(hidden) if spec.fusion else 0),
                 "head": ceil(spec.hidden * spec.vocab * item / width / install),
                 "stages": (stages - 1) * system.hop_cycles + _rack_crossings(system, stages, width) * (
                     system.figures.get("rack_hop_cycles", 0) - system.hop_cycles)}
        cycles = sum(parts.values())
        if best is None or cycles < best["cycles"]:
            best = {"cycles": cycles, "width": width, "stages": stages, "parts": parts}
    return best


def _rack_crossings(system: SystemConfig, stages: int, width: int) -> int:
    """Stage boundaries that cross from one rack to the next on a system of racks (``rack_hop_cycles``: the
    hidden state's hand-off there takes that latency instead of a hop): a rack holds its chips ÷ width stages."""
    if "rack_hop_cycles" not in system.figures:
        return 0
    return (stages - 1) // max(system.figures["node_chips"] // width, 1)


# a cause on a block's critical path as the plan's split names it (the rest is latency: results in pipelines)
_SPLIT_OF_BOUND = {"matrix": "matrix", "weight install": "weight install", "vector": "vector", "switch": "vector",
                   "SRAM bandwidth": "SRAM", "host link": "host link", "link": "C2C links"}


# ---- mappings ----------------------------------------------------------------------------------------
@dataclass
class Mapping:
    """One way to lay the model out: S pipeline stages × T tensor-parallel chips, and what it achieves."""

    stages: int
    width: int
    batch: int
    chips: int
    per_token_cycles: int
    ttft_cycles: int
    split: dict
    memory_per_chip: int
    expert_placement: str = ""
    users: int = 1  # in flight: stages × batch when the pipeline is full, fewer when their caches do not fit
    period_cycles: int = 0  # the busiest stage's time a step: how often a step can start (0: no bound)

    def tokens_per_s(self, clock: int) -> float:
        """All users' tokens a second: each user's steps follow each other a step's time apart, and the
        steps of all of them at most one a period (a batch of ``batch`` sequences a step)."""
        steps = min(self.users / self.batch / self.per_token_cycles,
                    1 / self.period_cycles if self.period_cycles else float("inf"))
        return clock * steps * self.batch

    def tokens_per_s_per_user(self, clock: int) -> float:
        return self.tokens_per_s(clock) / self.users


def _group_system(system: SystemConfig) -> str:
    """The system whose links a tensor-parallel group's collectives are compiled over: the system itself
    where its links are listed, else its node's (a large TSP system is nodes of a ``tsp-node``)."""
    return system.name if system.simulated else system.figures.get("node_system", "")


def _widths(spec: ModelSpec, chips: int, system: SystemConfig | None = None) -> list:
    """Tensor-parallel widths that split the heads, K/V heads (or replicate them; MLA's latent is replicated),
    the MLPs (a dense one's columns, the shared experts', an expert's where it is split over several chips)
    and the hidden state evenly; on a system described by its figures, at most a node (its collectives are
    compiled on the node's links)."""
    if system is not None and not system.simulated:
        chips = min(chips, int(system.figures.get("node_chips", 1)) if system.figures.get("node_system") else 1)
    out = []
    width = 1
    while width <= min(chips, spec.heads):
        fits = spec.heads % width == 0 and spec.hidden % width == 0
        if not spec.mla:
            fits &= spec.kv_heads % width == 0 or width % spec.kv_heads == 0
        if not spec.experts or spec.dense_layers or not spec.moe_ffn:  # (a Mixtral's ffn is its experts')
            fits &= spec.ffn % width == 0
        if spec.experts:
            if width > spec.experts:
                fits &= width % spec.experts == 0 and spec.expert_ffn % (width // spec.experts) == 0
            fits &= spec.shared_experts * spec.expert_ffn % width == 0
        if fits:
            out.append(width)
        width *= 2
    return out


def shard_shape(spec: ModelSpec, width: int, batch: int, context: int, rows: int = 1, system: str = "",
                layer: int | None = None) -> tuple:
    """``(BlockShape, experts a chip holds, the experts' placement in words)``: one chip's shard of a block,
    ``width`` chips wide (attention by heads, the MLP by its columns, a mixture's experts spread), its
    all-reduces over the chips of ``system`` the compiler would give them.

    ``layer`` (default: the last) picks the layer's kind: a dense MLP or experts, a sliding window (its cache
    and attention ``min(context, window)`` positions) or the whole context. A step's picks (its ``batch ×
    rows`` tokens' top-k each) are taken to spread evenly over the chips (balanced routing): where experts
    outnumber the chips, ⌈picks ÷ T⌉ distinct experts a chip, at most the experts it holds, one after another
    (a batch's tokens pick different experts: each one installs its weights); where each expert is split over
    several chips, one."""
    layer = spec.layers - 1 if layer is None else layer
    routed, shared = 1, 0
    if spec.is_moe(layer):
        expert_chips = max(width // spec.experts, 1)  # chips an expert is split over
        experts_per_chip = ceil(spec.experts / width)
        ffn_shard = spec.expert_ffn // expert_chips
        picks = batch * rows * spec.experts_per_token
        routed = min(experts_per_chip, ceil(picks / width)) if width < spec.experts else 1
        shared = spec.shared_experts * spec.expert_ffn // width
        placement = (f"{spec.experts} experts over {width} chips: "
                     + (f"each split over {expert_chips}" if width >= spec.experts else f"{experts_per_chip} a chip"))
        if spec.shared_experts:
            placement += f", {spec.shared_experts} shared split over all"
    else:
        experts_per_chip, ffn_shard, placement = 1, spec.ffn // width, ""
    if spec.mla:
        if width > 1:
            placement = "; ".join(filter(None, [placement, f"the MLA latent cache on each of the {width} chips"]))
    elif spec.kv_heads < width:  # K/V heads replicated: each on the chips of the query heads that read it
        placement = "; ".join(filter(None, [placement, f"{spec.kv_heads} K/V heads replicated, each on "
                                            f"{width // spec.kv_heads} chips"]))
    shape = BlockShape(spec.hidden, spec.heads // width, 1 if spec.mla else max(spec.kv_heads // width, 1),
                       spec.head_dim, ffn_shard, rows, spec.layer_context(layer, context), batch,
                       spec.experts if spec.is_moe(layer) else 0, system if width > 1 else "", width, routed, shared,
                       spec.mla, spec.qk_norm, spec.sandwich)
    return shape, experts_per_chip, placement


def _cache_bytes(spec: ModelSpec, shape: BlockShape, item: int) -> int:
    """One chip's cache of one layer for a batch: its K/V heads' (or MLA's whole latent) at the shape's
    context."""
    return shape.batch * spec.kv_width(shape.width) * shape.context * item


def evaluate(spec: ModelSpec, system: SystemConfig, dtype: str, stages: int, width: int, batch: int,
             context: int, prompt: int, ttft: bool = True, rows: int = 1) -> Mapping | None:
    """The figures of one mapping, or None when a shard does not fit its chip. A step decodes ``rows`` tokens a
    sequence (more than one: a speculative step verifying draft tokens).

    A model whose layers differ (dense and mixture-of-experts layers, sliding-window and full attention) has
    each kind's block compiled and timed; the layers spread over the stages as evenly as they go, in order,
    each stage holding its own layers' weights and caches."""
    chip, hop = system.chip, system.hop_cycles
    item = DType.from_name(dtype).itemsize
    if stages > spec.layers:
        return None
    kinds = spec.kinds()
    first = {kind: kinds.index(kind) for kind in kinds}  # each kind's first layer
    shapes = {kind: shard_shape(spec, width, batch, context, rows, _group_system(system), layer)
              for kind, layer in first.items()}
    shape, experts_per_chip, placement = shapes[kinds[-1]]
    # each kind's placement, each part said once, the last layer's kind (a mixture's experts) first
    placement = "; ".join(dict.fromkeys(part for kind in [kinds[-1], *shapes] for part in shapes[kind][2].split("; ")
                                        if part))
    try:
        if width > 1 and shape.system:
            from ...codegen.parallel.collectives import choose

            choose(system_of(shape.system), width)
    except CollectiveError:  # no group of ``width`` chips the compiler could run the collectives on
        return None
    blocks = {}
    for kind, (kind_shape, held, _) in shapes.items():
        cost = block_cost(chip, kind_shape, dtype)
        if cost is None or cost.streamed:
            return None
        # the other experts this chip holds add their weights, not their time (top-k run in parallel)
        extra = (held - kind_shape.routed) * 3 * spec.hidden * kind_shape.ffn * item if kind_shape.experts else 0
        blocks[kind] = (cost, extra, _cache_bytes(spec, kind_shape, item))
    block, extra, _ = blocks[kinds[-1]]
    per_stage = ceil(spec.layers / stages)
    head = head_cost(chip, spec.hidden, ceil(spec.vocab / width), batch * rows, dtype)
    if head is None or head.streamed:
        return None
    fuse = None  # a multi-token-prediction module's input fusion, on the first stage
    if spec.fusion:
        fuse = fusion_cost(chip, spec.hidden, spec.fusion, batch * rows, dtype, width, shape.system)
        if fuse is None or fuse.streamed:
            return None
    # every stage holds its layers' weights and caches; the last one the LM head as well, so it may take fewer.
    # The block is timed for the batch it works on; every user in flight keeps its cache on it. A full pipeline
    # has stages × batch users in flight; when their caches do not fit, fewer batches are in flight (the
    # pipeline idles part of the time), as many as fit
    room = chip.sram_bytes - max(max(c.activation_bytes for c, _, _ in blocks.values()), head.activation_bytes,
                                 fuse.activation_bytes if fuse else 0)
    fewer, more = divmod(spec.layers, stages)
    counts = [fewer + 1] * more + [fewer] * (stages - more)  # layers a stage, in order (the last: the fewer)
    spans = [range(sum(counts[:k]), sum(counts[:k + 1])) for k in range(stages)]
    if len(blocks) == 1 and not fuse:
        for in_flight in range(stages, 0, -1):
            per_block = block.resident_bytes + extra + (in_flight - 1) * _cache_bytes(spec, shape, item)
            regular, last = room // per_block, (room - head.resident_bytes) // per_block
            if last >= 0 and (stages - 1) * regular + last >= spec.layers:
                break
        else:
            return None
        memory = min(per_stage, regular) * per_block + chip.sram_bytes - room
        memory = max(memory, min(last, spec.layers) * per_block + head.resident_bytes + chip.sram_bytes - room)
    else:  # each stage's own layers, the even split the period below takes
        for in_flight in range(stages, 0, -1):
            held = [sum(blocks[kinds[i]][0].resident_bytes + blocks[kinds[i]][1]
                        + (in_flight - 1) * blocks[kinds[i]][2] for i in span) for span in spans]
            held[-1] += head.resident_bytes
            held[0] += fuse.resident_bytes if fuse else 0
            if max(held) <= room:
                break
        else:
            return None
        memory = max(held) + chip.sram_bytes - room
    hidden_bytes = batch * rows * spec.hidden * item
    hops = stage_hops(system, stages, width)
    # a block's two all-reduces (a mixture of experts: the combine) are in its compiled cycles, as the
    # compiler emits them for the group (:mod:`~lpx_tvm.codegen.parallel.collectives`); between the stages
    # one hand-off of the hidden state (each chip of a stage to its counterpart in the next)
    handoff = ceil(hidden_bytes / chip.c2c_bytes_per_cycle)
    serial = (stages - 1) * handoff
    crossings = _rack_crossings(system, stages, width)
    hop_steps = (stages - 1 - crossings) * hops
    serial += crossings * system.figures.get("rack_hop_cycles", 0)
    network = hop_steps * hop + serial
    # users in flight: each stage takes the next user's step once it is done with one's (its buffers are
    # reused, step after step), so the busiest stage sets how often a step can start. The layers spread as
    # evenly as they go, the last stage (with the LM head) holding the fewer
    head_step = head_step_cycles(chip, spec.hidden, ceil(spec.vocab / width), batch * rows, dtype)
    last_step = head.cycles if head_step is None else head_step
    steps = [sum(blocks[kinds[i]][0].cycles for i in span) for span in spans]
    steps[0] += fuse.cycles if fuse else 0
    if len(blocks) == 1 and not fuse:  # (the same sums, as the uniform plan has always written them)
        period = max((fewer + (more > 0)) * block.cycles + (handoff if stages > 1 else 0), fewer * block.cycles + last_step)
    else:
        period = max(max(steps[:-1], default=0) + handoff, steps[-1] + last_step)
    # the new K/V (MLA: latent and rotary key) of every layer of the busiest stage written into the cache
    kv_bytes = per_stage * batch * rows * spec.kv_width(width) * 4  # fp32 from the host
    kv_write = ceil(kv_bytes / chip.host_bytes_per_cycle) + chip.latency_cycles["MEM"]
    compute = sum(blocks[kind][0].cycles for kind in kinds) + head.cycles + (fuse.cycles if fuse else 0)
    per_token = compute + network + kv_write
    split = {"matrix": 0.0, "weight install": 0.0, "vector": 0.0, "SRAM": 0.0, "C2C links": 0.0, "latency": 0.0}
    for breakdown, times in [(blocks[kind][0].breakdown, kinds.count(kind)) for kind in blocks] + [(head.breakdown, 1)] \
            + ([(fuse.breakdown, 1)] if fuse else []):
        for bound, cycles in breakdown.items():
            key = _SPLIT_OF_BOUND.get(bound, "latency")
            split[key] = split.get(key, 0.0) + cycles * times
    scale = compute / max(sum(split.values()), 1)
    split = {k: v * scale for k, v in split.items()}
    split["C2C links"] += serial + hop_steps * hop  # (the stages' hand-offs)
    split["synchronisation"] = 0.0  # the static schedule aligns the chips: no barriers at run time
    split["KV write"] = kv_write
    ttft_cycles = None
    if ttft:  # each kind's prompt as one block (a sliding layer's prefill priced as the full one's: a bound)
        prefills = {kind: block_cost(chip, replace(shapes[kind][0], tokens=prompt, context=0, batch=1), dtype,
                                     alone=True) for kind in blocks}
        if fuse:
            prefills["fusion"] = fusion_cost(chip, spec.hidden, spec.fusion, prompt, dtype, width, shape.system)
        if all(p is not None and not p.streamed for p in prefills.values()):
            pre_bytes = prompt * spec.hidden * item
            ttft_cycles = sum(prefills[kind].cycles for kind in kinds) \
                + (stages - 1) * transfer_cycles(pre_bytes, hops, chip, hop) + head.cycles \
                + (prefills["fusion"].cycles if fuse else 0)
    return Mapping(stages, width, batch, stages * width, per_token, ttft_cycles, split, memory, placement,
                   in_flight * batch, period)


def _check_sizes(**sizes) -> None:
    """Each of ``sizes`` a positive integer (``batches`` and ``mapping``: sequences of them; ``chips``,
    ``mapping``, ``users`` and ``prefill_chips`` may be None), else a :class:`PlanError` naming it."""
    for name, value in sizes.items():
        if value is None and name in ("chips", "mapping", "users", "prefill_chips"):
            continue
        wanted = {"batches": "positive integers", "mapping": "two positive integers"}.get(name, "a positive integer")
        try:
            many = tuple(value) if name in ("batches", "mapping") else (value,)
        except TypeError:  # not a sequence
            many = (None,)
        if any(isinstance(v, bool) or not isinstance(v, Integral) or v < 1 for v in many) \
                or (name == "mapping" and len(many) != 2):
            raise PlanError(f"{name} must be {wanted}, got {value!r}")


def plan_target(system, dtype: str, target=None, gpu=None) -> Target:
    """A plan's one :class:`~lpx_tvm.codegen.Target`: ``target`` as a door parsed it (a GPU pool in it is the
    business of a plan beside GPUs; this one reads the system and dtype), or the ``system`` and ``dtype`` words
    parsed here (the chip is the system's; ``gpu``, a GPU pool beside it). A target without a system is
    refused."""
    if target is None:
        return Target.parse(system=system, dtype=dtype, gpu=gpu)
    if not isinstance(target, Target) or target.system is None:
        raise PlanError(f"a plan's target is an lpx_tvm.codegen.Target with a system, got {target!r}")
    return target
