"""lpx-tvm plan on the models LPX is bought for, from their config.json files as published: each preset reads,
its parameters and KV cache worked out by hand from the config's numbers (and the published totals), multi-head
latent attention, shared experts, dense first layers and sliding windows priced, and a key the plan does not
model refused by name."""

import json
from math import ceil
from pathlib import Path

import pytest

from lpx_tvm.app.plan.search import PlanError, model_spec, plan
from lpx_tvm.app.plan.model import block_cost, floor_cycles, shard_shape
from lpx_tvm.runtime_sim import load_config
from lpx_tvm.runtime_sim.system import load_system

CONFIGS = Path(__file__).parent.parent / "lpx_tvm" / "app" / "plan" / "configs"
PUBLISHED = {"deepseek-v3": "deepseek-ai/DeepSeek-V3", "kimi-k2": "moonshotai/Kimi-K2-Instruct",
             "gpt-oss-120b": "openai/gpt-oss-120b", "gpt-oss-20b": "openai/gpt-oss-20b",
             "qwen3-235b-a22b": "Qwen/Qwen3-235B-A22B", "llama-3.3-70b": "meta-llama/Llama-3.3-70B-Instruct",
             "gemma-3-27b": "google/gemma-3-27b-it", "qwen3-0.6b": "Qwen/Qwen3-0.6B"}


def config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


@pytest.mark.parametrize("name", PUBLISHED)
def test_each_published_preset_reads_and_names_its_repository(name):
    data = config(name)
    assert data["name"] == name and PUBLISHED[name] in data["source"]
    spec = model_spec(name)
    assert spec.name == name and spec.layers == (data.get("text_config") or data)["num_hidden_layers"]


# ---- parameters, by hand from the config's numbers --------------------------------------------------------
def mla_attention(c: dict) -> int:
    """MLA's projections: q down (hidden × q_lora) and up (q_lora × heads × (nope + rope)), the joint K/V
    down-projection (hidden × (kv_lora + rope)), its up-projection (kv_lora × heads × (nope + v)), the output
    (heads × v × hidden), and the two latents' RMSNorms."""
    h, q, kv, rope, nope, v, heads = (c["hidden_size"], c["q_lora_rank"], c["kv_lora_rank"], c["qk_rope_head_dim"],
                                      c["qk_nope_head_dim"], c["v_head_dim"], c["num_attention_heads"])
    return h * q + q + q * heads * (nope + rope) + h * (kv + rope) + kv + kv * heads * (nope + v) + heads * v * h


def deepseek_style(c: dict) -> tuple:
    """(total, active): first_k_dense_replace dense layers (SwiGLU of intermediate_size), the rest routed
    experts (SwiGLU of moe_intermediate_size each), the shared ones and the router; embedding and LM head."""
    h, layers, dense = c["hidden_size"], c["num_hidden_layers"], c["first_k_dense_replace"]
    expert = 3 * h * c["moe_intermediate_size"]
    router = h * c["n_routed_experts"]
    attention = mla_attention(c) + 2 * h
    dense_layer = attention + 3 * h * c["intermediate_size"]
    moe = attention + expert * (c["n_routed_experts"] + c["n_shared_experts"]) + router
    moe_active = attention + expert * (c["num_experts_per_tok"] + c["n_shared_experts"]) + router
    embeddings = 2 * c["vocab_size"] * h + h
    return (dense * dense_layer + (layers - dense) * moe + embeddings,
            dense * dense_layer + (layers - dense) * moe_active + embeddings)


def gqa_moe(c: dict, experts_key: str, ffn_key: str) -> tuple:
    """(total, active) of a grouped-query-attention mixture (every layer's MLP its experts)."""
    h, hd = c["hidden_size"], c["head_dim"]
    attention = h * hd * 2 * (c["num_attention_heads"] + c["num_key_value_heads"]) + 2 * h
    expert, router = 3 * h * c[ffn_key], h * c[experts_key]
    embeddings = 2 * c["vocab_size"] * h + h
    return (c["num_hidden_layers"] * (attention + expert * c[experts_key] + router) + embeddings,
            c["num_hidden_layers"] * (attention + expert * c["num_experts_per_tok"] + router) + embeddings)


@pytest.mark.parametrize("name, count, total, active, tolerance", [
    # DeepSeek-V3's card: 671B total, 37B activated (without the 14B multi-token-prediction module)
    ("deepseek-v3", deepseek_style, 671e9, 37e9, 0.03),
    # Kimi K2's card: 1T total (1.04T on its model page), 32B activated
    ("kimi-k2", deepseek_style, 1.0e12, 32e9, 0.04),
    # Qwen3-235B-A22B: 235B total, 22B activated
    ("qwen3-235b-a22b", lambda c: gqa_moe(c, "num_experts", "moe_intermediate_size"), 235e9, 22e9, 0.02),
])
def test_mixture_parameters_by_hand_match_the_published_totals(name, count, total, active, tolerance):
    c = config(name)
    hand_total, hand_active = count(c)
    assert hand_total == pytest.approx(total, rel=tolerance)
    assert hand_active == pytest.approx(active, rel=tolerance)
    spec = model_spec(name)
    assert spec.params() == pytest.approx(hand_total, rel=1e-4)
    active_chip = sum(spec.layer_params(i, active=True) for i in range(spec.layers)) + spec.vocab * spec.hidden * 2
    assert active_chip + spec.hidden == pytest.approx(hand_active, rel=1e-4)


@pytest.mark.parametrize("name, total, active", [("gpt-oss-120b", 116.83e9, 5.13e9), ("gpt-oss-20b", 20.91e9, 3.61e9)])
def test_gpt_oss_parameters_by_hand_match_the_model_card(name, total, active):
    """OpenAI's model card: 116.83B and 20.91B in all, 5.13B and 3.61B active a token, counting the LM head
    but not the embedding table among the active. Its experts are intermediate_size wide (no
    moe_intermediate_size); the card's counts hold biases and sinks too (under 0.1%)."""
    c = config(name)
    hand_total, hand_active = gqa_moe(c, "num_local_experts", "intermediate_size")
    assert hand_total == pytest.approx(total, rel=0.005)
    assert hand_active - c["vocab_size"] * c["hidden_size"] == pytest.approx(active, rel=0.01)
    assert model_spec(name).params() == pytest.approx(hand_total, rel=1e-4)


def test_gemma_3_reads_its_text_config_with_the_defaults_transformers_fills_in():
    """google/gemma-3-27b-it publishes a multimodal config: the decoder is its text_config, which leaves out the
    vocabulary (262,208), the tied embeddings and the pattern (5 sliding layers, then a full one) that
    Gemma3TextConfig fills in. 62 layers: full at 6, 12, ..., 60 (10), the other 52 a 1,024-position window.
    ~27.0B in the decoder (the card's 27B holds the 0.4B image encoder too)."""
    spec = model_spec("gemma-3-27b")
    assert spec.sliding == tuple(i for i in range(62) if (i + 1) % 6) and len(spec.sliding) == 52
    assert spec.window == 1024 and spec.vocab == 262208 and spec.tied
    h = 5376
    # four RMSNorms a layer (Gemma's sandwich), and the query's and the key's per-head RMSNorms (128 each)
    layer = h * 128 * 2 * (32 + 16) + 3 * h * 21504 + 4 * h + 2 * 128
    assert spec.params() == 62 * layer + 262208 * h + h
    assert spec.params() == pytest.approx(27e9, rel=0.01)
    assert any("image encoder" in note for note in spec.notes)


def test_llama_3_3_70b_is_llama_3_70b_s_shape():
    a, b = model_spec("llama-3.3-70b"), model_spec("llama-3-70b")
    assert (a.hidden, a.layers, a.heads, a.kv_heads, a.ffn, a.vocab) == (b.hidden, b.layers, b.heads, b.kv_heads,
                                                                          b.ffn, b.vocab)
    assert a.params() == pytest.approx(70.6e9, rel=0.005)


# ---- the KV cache ---------------------------------------------------------------------------------------
def test_mla_caches_its_latent_and_rotary_key_per_token_per_layer_with_no_heads():
    """DeepSeek-V3 caches kv_lora_rank + qk_rope_head_dim = 512 + 64 values a position a layer (its 128 heads
    share them): 576 × 61 = 35,136 bytes a token in fp8, 70,272 in fp16; a 4,096-position cache 143,917,056
    bytes in fp8 (a 128-head GQA cache of 192-wide K and 128-wide V would be 4,096 × 128 × 320 × 61)."""
    spec = model_spec("deepseek-v3")
    assert spec.cache_bytes(1, 1, "fp8") == (512 + 64) * 61 == 35_136
    assert spec.cache_bytes(1, 1, "fp16") == 70_272
    assert spec.cache_bytes(4096, 2, "fp8") == 2 * 4096 * 35_136
    with pytest.raises(PlanError, match=r"143,917,056 of KV cache for 4096 positions"):
        plan("deepseek-v3", "lpx-rack", dtype="fp8")
    assert model_spec("kimi-k2").cache_bytes(1, 1, "fp8") == 576 * 61


def test_sliding_layers_cache_the_window_full_ones_the_context():
    """gpt-oss-120b: 36 layers alternating, 18 with a 128-position window, 8 K/V heads of 64 (2 × 8 × 64 =
    1,024 values a position). At a 4,096-position context, in fp8: 1,024 × (18 × 128 + 18 × 4,096); at 100
    positions (under the window) every layer 100. Gemma 3 27B: 16 K/V heads of 128 (4,096 values), 52
    layers at 1,024, 10 at the context."""
    spec = model_spec("gpt-oss-120b")
    assert spec.sliding == tuple(range(0, 36, 2)) and spec.window == 128
    assert spec.cache_bytes(4096, 1, "fp8") == 1024 * (18 * 128 + 18 * 4096)
    assert spec.cache_bytes(100, 1, "fp8") == 1024 * 36 * 100
    assert model_spec("gemma-3-27b").cache_bytes(8192, 1, "fp16") == 2 * 4096 * (52 * 1024 + 10 * 8192)


# ---- the blocks, compiled -------------------------------------------------------------------------------
TINY_MLA = {"hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
            "intermediate_size": 96, "vocab_size": 128, "q_lora_rank": 48, "kv_lora_rank": 32,
            "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 4,
            "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 32,
            "first_k_dense_replace": 1, "num_nextn_predict_layers": 1}
TINY_SLIDING = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "intermediate_size": 128, "vocab_size": 128, "sliding_window": 16,
                "layer_types": ["sliding_attention", "full_attention"]}


def test_an_mla_block_keeps_its_latent_cache_whole_on_every_chip():
    """The absorbed decode form caches (kv_lora + rope) = 40 fp32 values a position on each chip of the group,
    however many heads the chip has: 32 more positions are 32 × 40 × 4 = 5,120 more resident bytes, at 1 chip
    and at 2. A GQA block's grows by its chip's K/V heads' 2 × 1 × 16 × 32 × 4 = 4,096."""
    chip = load_config("tiny")
    spec = model_spec(TINY_MLA)
    for width, system in ((1, ""), (2, "tiny-fc-8")):
        costs = [block_cost(chip, shard_shape(spec, width, 1, context, system=system)[0], "fp32")
                 for context in (32, 64)]
        assert costs[1].resident_bytes - costs[0].resident_bytes == 32 * (32 + 8) * 4
    gqa = model_spec(TINY_SLIDING)
    costs = [block_cost(chip, shard_shape(gqa, 2, 1, context, system="tiny-fc-8")[0], "fp32") for context in (32, 64)]
    assert costs[1].resident_bytes - costs[0].resident_bytes == 2 * 1 * 16 * 32 * 4


def test_dense_first_layers_are_dense_and_expert_layers_carry_the_shared_expert():
    """DeepSeek-V3 64 wide: layers 0-2 a dense MLP of 18,432 ÷ 64 = 288 columns; from layer 3, 256 experts 4 a
    chip (one run for a token), each 2,048 wide, and the shared expert's 2,048 ÷ 64 = 32 columns."""
    spec = model_spec("deepseek-v3")
    assert spec.dense_layers == (0, 1, 2)
    dense, _, _ = shard_shape(spec, 64, 1, 4096, layer=2)
    moe, held, _ = shard_shape(spec, 64, 1, 4096, layer=3)
    assert (dense.experts, dense.ffn, dense.shared_ffn) == (0, 288, 0)
    assert (moe.experts, moe.ffn, moe.shared_ffn, moe.routed, held) == (256, 2048, 32, 1, 4)
    assert moe.heads == 2 and moe.mla == (1536, 512, 64, 128, 128)
    # at 4 chips a token's 8 experts are 2 a chip, one after another
    assert shard_shape(spec, 4, 1, 4096, layer=3)[0].routed == 2
    # a batch's picks spread over the chips: 4 tokens × 8 = 32 picks over 64 chips is 1 a chip, 32 tokens' 256
    # are 4 a chip (the 4 it holds), 64 tokens' 512 still 4; over 4 chips, 4 tokens' 32 picks are 8 a chip
    assert [shard_shape(spec, 64, b, 4096, layer=3)[0].routed for b in (4, 32, 64)] == [1, 4, 4]
    assert shard_shape(spec, 4, 4, 4096, layer=3)[0].routed == 8
    # Mixtral 8 wide: each expert whole on one chip, so one run a chip at any batch
    assert shard_shape(model_spec("mixtral-8x7b"), 8, 16, 4096)[0].routed == 1


def test_a_sliding_layer_attends_to_the_window_not_the_context():
    """A sliding layer's shard at a 64-position context is the full-attention layer's shard at the 16-position
    window. A model of sliding layers only then plans the same token time at a 64-position context as at 16
    (its window), where a model of full layers only does not; mixing one of each lands between the two."""
    spec = model_spec(TINY_SLIDING)
    sliding, _, _ = shard_shape(spec, 1, 1, 64, layer=0)
    full, _, _ = shard_shape(spec, 1, 1, 64, layer=1)
    assert sliding == shard_shape(spec, 1, 1, 16, layer=1)[0] and (sliding.context, full.context) == (16, 64)

    def token_us(layer_types, context):
        return plan({**TINY_SLIDING, "layer_types": layer_types}, "tiny-fc-8", dtype="fp32", context=context,
                    prompt=8, mapping=(1, 1))["per_token_us"]
    slides, fulls = ["sliding_attention"] * 2, ["full_attention"] * 2
    assert token_us(slides, 64) == token_us(slides, 16) == token_us(fulls, 16)
    assert token_us(slides, 64) < token_us(["sliding_attention", "full_attention"], 64) < token_us(fulls, 64)


def test_an_mla_mixture_with_shared_experts_and_dense_first_layers_plans():
    report = plan(TINY_MLA, "tiny-fc-8", dtype="fp32", context=32, prompt=8, mapping=(1, 2))
    assert report["mapping"]["experts"] == ("4 experts over 2 chips: 2 a chip, 1 shared split over all; the MLA latent "
                                            "cache on each of the 2 chips")
    assert any("multi-token-prediction" in note for note in report["notes"])
    assert any("balanced routing" in note for note in report["notes"])


def test_the_floor_by_hand_for_deepseek_v3_on_eight_lpx_racks():
    """lp30 (as tests/test_plan.py's Llama floor): 15,360 B a cycle into the planes, 153,600 B a cycle from
    SRAM, a hop 350 cycles, 14 B a cycle a link, 4 links a pair; an lpx-rack's nodes are 16 chips, so a group
    of up to 16 is 1 hop across and a wider one 2; a stage handed to the next rack takes 1,600 cycles. In fp8
    a token reads, per layer, the attention's weights (MLA, all of it), a dense layer's MLP or the top 8 and the
    shared expert and the router; the latent cache, 576 × 4,096 bytes, read whole by every chip; two
    all-reduces of 7,168 bytes and MLA's all-gather of 1,536 + 512 + 64 = 2,112. The floor is the best width."""
    c = config("deepseek-v3")
    spec = model_spec("deepseek-v3")
    h = 7168
    attention = mla_attention(c) + 2 * h
    dense_layer = attention + 3 * h * 18432
    moe_layer = attention + 3 * h * 2048 * (8 + 1) + h * 256
    total = deepseek_style(c)[0] - 129280 * h + 576 * 61 * 4096  # the chips' weights (no embedding) and cache

    def at(width):
        stages = ceil(total / (width * 499_998_720))
        if stages > 61 or stages * width > 2048:
            return None
        hops = 0 if width == 1 else (1 if width <= 16 else 2)

        def collective(nbytes):
            return 0 if width == 1 else hops * 350 + ceil(nbytes / width / (4 * 14))
        return (3 * ceil(dense_layer / width / 15_360) + 58 * ceil(moe_layer / width / 15_360)
                + 61 * ceil(576 * 4096 / 153_600)
                + 61 * (2 * collective(h) + collective(2112))
                + ceil(h * 129280 / width / 15_360)
                + (stages - 1) * 350 + (stages - 1) // (256 // width) * (1600 - 350))
    hand = min(cycles for cycles in (at(2 ** k) for k in range(8)) if cycles is not None)
    floor = floor_cycles(spec, load_system("lpx-system-8"), "fp8", 4096, 2048)
    assert floor["cycles"] == hand
    assert floor["parts"]["KV cache"] == 61 * 16


# ---- what the plan does not model is named ----------------------------------------------------------------
@pytest.mark.parametrize("extra, message", [
    ({"shared_expert_intermediate_size": 5632}, "unknown config key shared_expert_intermediate_size"),
    ({"layer_types": ["linear_attention", "full_attention"], "sliding_window": 16},
     "layer_types linear_attention is not modelled"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping 50.0 is not modelled"),
    ({"moe_layer_freq": [0, 1]}, r"moe_layer_freq \[0, 1\] is not modelled"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "sliding_attention layers but no sliding_window"),
    ({"kv_lora_rank": 32}, "kv_lora_rank.* without qk_rope_head_dim"),
])
def test_a_key_that_changes_cost_and_is_not_modelled_is_named(extra, message):
    base = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 128, "vocab_size": 128, "num_local_experts": 4, "num_experts_per_tok": 2}
    with pytest.raises(PlanError, match=message):
        model_spec({**base, **extra})


def test_verify_is_refused_where_a_stage_is_not_one_kind_of_block():
    with pytest.raises(PlanError, match="--verify compiles a stage as one kind"):
        plan(TINY_SLIDING, "tiny-fc-8", dtype="fp32", context=64, prompt=8, mapping=(1, 1), verify=True)


def test_the_chips_hold_a_copy_of_the_cache_a_chip_where_its_heads_do_not_split():
    """On a group wider than the K/V heads each chip holds one head (replicated), and MLA's latent is whole on
    every chip. Llama-3-70B, 8 K/V heads of 128 over 80 layers, fp8, one position: 2 · 8 · 128 · 80 = 163,840
    bytes held once at 4 or 8 wide (2 or 1 heads a chip), 8 times at 64 wide; DeepSeek-V3's 35,136 once a chip."""
    llama = model_spec("llama-3-70b")
    assert [llama.cache_bytes(1, 1, "fp8", w) for w in (1, 4, 8, 64)] == [163_840] * 3 + [8 * 163_840]
    assert model_spec("deepseek-v3").cache_bytes(1, 1, "fp8", 16) == 16 * 35_136
