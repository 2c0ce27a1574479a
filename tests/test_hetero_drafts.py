"""lpx-draft's drafts: the presets each target drafts with (Qwen3-0.6B for Qwen3-235B-A22B, DeepSeek-V3's own
multi-token-prediction module for DeepSeek-V3), their parameters worked out by hand from the config's figures,
a draft of another vocabulary refused by name, and a model LPX cannot hold still drafted on one rack."""

import json
from math import ceil
from pathlib import Path

import aiconfigurator_core  # noqa: F401  (the test extra installs it: these tests always run)
import pytest

from lpx_tvm.app.plan.hetero import DRAFTS, HeteroError, default_draft, hetero_plan
from lpx_tvm.app.plan.model import PlanError, model_spec

CONFIGS = Path(__file__).parent.parent / "lpx_tvm" / "app" / "plan" / "configs"


def config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


# ---- the presets, by hand ---------------------------------------------------------------------------------
def test_qwen3_0_6b_is_the_published_config_and_its_parameters_by_hand():
    """Qwen/Qwen3-0.6B's config.json: hidden 1,024, 28 layers, 16 query heads and 8 K/V heads of 128, a 3,072-wide
    SwiGLU, a 151,936-token vocabulary (Qwen3-235B-A22B's) tied to the LM head. By hand, a layer: Q (1,024 × 16 ×
    128), K and V (1,024 × 8 × 128 each), O (16 × 128 × 1,024), the MLP (3 × 1,024 × 3,072), two RMSNorms
    (1,024 each) and the per-head query and key RMSNorms (128 each); the tied table once and the final norm.
    The card: 0.6B in all, 0.44B without the embedding."""
    c = config("qwen3-0.6b")
    assert "Qwen/Qwen3-0.6B" in c["source"]
    assert (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["num_attention_heads"],
            c["num_key_value_heads"], c["head_dim"], c["vocab_size"], c["tie_word_embeddings"],
            c["max_position_embeddings"], c["rope_theta"]) == (1024, 3072, 28, 16, 8, 128, 151936, True, 40960, 1000000)
    q, kv, o = 1024 * 16 * 128, 2 * 1024 * 8 * 128, 16 * 128 * 1024
    layer = q + kv + o + 3 * 1024 * 3072 + 2 * 1024 + 2 * 128
    assert layer == 15_730_944
    hand = 28 * layer + 151936 * 1024 + 1024
    assert hand == 596_049_920
    assert hand == pytest.approx(0.6e9, rel=0.01) and hand - 151936 * 1024 == pytest.approx(0.44e9, rel=0.01)
    spec = model_spec("qwen3-0.6b")
    assert spec.params() == hand and spec.tied and spec.qk_norm and spec.head_dim == 128
    assert spec.vocab == model_spec("qwen3-235b-a22b").vocab == 151936


def test_deepseek_v3_nextn_is_its_multi_token_prediction_module_by_hand():
    """lmsys/DeepSeek-V3-NextN: DeepSeek-V3's config.json with architectures DeepseekV3ForCausalLMNextN (SGLang's
    export), planned as the module its weights are (model.layers.61): the token's embedding and the target's
    hidden state, each RMSNormed, concatenated and projected (eh_proj, 14,336 × 7,168), one decoder layer (MLA
    and, as layer 61 ≥ first_k_dense_replace 3, 256 routed experts and 1 shared, 2,048 wide each, and the
    router), the final norm and its own LM head; the embedding table, as the target's, looked up on the host.
    With DeepSeek-V3's 671B, the card's 685B."""
    c = config("deepseek-v3-nextn")
    target = config("deepseek-v3")
    assert "lmsys/DeepSeek-V3-NextN" in c["source"] and c["architectures"] == ["DeepseekV3ForCausalLMNextN"]
    assert {k: v for k, v in c.items() if k not in ("name", "source", "architectures")} == \
        {k: v for k, v in target.items() if k not in ("name", "source", "architectures")}
    h, vocab = 7168, 129280
    mla = h * 1536 + 1536 + 1536 * 128 * (128 + 64) + h * (512 + 64) + 512 + 512 * 128 * (128 + 128) + 128 * 128 * h
    moe = 3 * h * 2048 * (256 + 1) + h * 256
    fusion = 2 * h * h + 2 * h  # eh_proj, enorm and hnorm
    hand = vocab * h + fusion + (mla + moe + 2 * h) + h + vocab * h
    spec = model_spec("deepseek-v3-nextn")
    assert (spec.layers, spec.dense_layers, spec.experts, spec.fusion, spec.vocab) == (1, (), 256, 2 * h, vocab)
    assert spec.params() == hand
    assert spec.chip_params() == hand - vocab * h  # the embedding's lookup runs on the host
    assert spec.cache_bytes(4096, 1, "fp8") == (512 + 64) * 4096  # its one layer's latent cache
    assert model_spec("deepseek-v3").params() + hand == pytest.approx(685e9, rel=0.002)
    assert not any("not placed" in note for note in spec.notes)
    assert any("DeepseekV3ForCausalLMNextN" in note and "eh_proj" in note for note in spec.notes)


def test_a_draft_architecture_the_plan_does_not_model_is_refused_by_name():
    eagle = {"name": "eagle", "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 7168,
             "intermediate_size": 12288, "num_hidden_layers": 1, "num_attention_heads": 64,
             "num_key_value_heads": 64, "vocab_size": 163840}
    with pytest.raises(PlanError, match="architecture LlamaForCausalLMEagle3 is a draft model the plan does not"):
        model_spec(eagle)
    nextn = {**config("deepseek-v3-nextn"), "num_nextn_predict_layers": 0}
    with pytest.raises(PlanError, match="DeepseekV3ForCausalLMNextN without num_nextn_predict_layers"):
        model_spec(nextn)
    from lpx_tvm.app.plan.search import plan

    with pytest.raises(PlanError, match="come after a multi-token-prediction module's fusion"):
        plan("deepseek-v3-nextn", "lpx-rack", dtype="fp8", verify=True)  # (its stage's blocks lack the fusion)


# ---- which draft ---------------------------------------------------------------------------------------------
def test_each_target_s_default_draft_and_kimi_k2_s_reason():
    assert default_draft(model_spec("qwen3-235b-a22b")) == "qwen3-0.6b"
    assert default_draft(model_spec("deepseek-v3")) == "deepseek-v3-nextn"
    assert default_draft(model_spec("gpt-oss-120b")) == "gpt-oss-20b"
    assert default_draft(model_spec("llama-3.3-70b")) == "llama-3.2-1b"
    for target, draft in DRAFTS.items():  # every one a preset of the target's vocabulary
        assert model_spec(draft).vocab == model_spec(target).vocab
    with pytest.raises(HeteroError, match=r"no draft for kimi-k2: no MTP layer, .*EAGLE-3 draft \(AQ-MedAI/Kimi-K2"):
        default_draft(model_spec("kimi-k2"))
    with pytest.raises(HeteroError, match="lpx-draft needs --draft MODEL"):
        default_draft(model_spec("llama-2-7b"))  # Llama 2's 32,000 tokens: no preset drafts them


def test_a_draft_of_another_vocabulary_is_refused_by_name():
    report = hetero_plan("qwen3-235b-a22b", "lpx-rack", "gb300:72", dtype="fp8", mode="lpx-draft",
                         draft="llama-3.2-1b")
    assert report["modes"]["lpx-draft"]["error"] == (
        "the draft llama-3.2-1b has a vocabulary of 128,256 tokens, the target qwen3-235b-a22b 151,936: a draft "
        "must propose the target's tokens")
    with pytest.raises(HeteroError, match="deepseek-v3-nextn is a multi-token-prediction module, a draft"):
        hetero_plan("deepseek-v3-nextn", "lpx-rack", "gb300:72", dtype="fp8", mode="gpu-only")


def test_the_modes_with_the_target_on_lpx_say_the_racks_they_need():
    """DeepSeek-V3 beside one rack: its fp8 weights on the chips (by hand: 3 dense layers and 58 of experts, the
    final norm and the LM head; the embedding table's lookup runs on the host) and one sequence's latent cache
    (576 × 61 × 4,096) need 6 racks of 256 × 499,998,720 bytes (670.1 GB and 0.1 GB against 128.0 GB); its FFN
    alone more than one."""
    h = 7168
    mla = h * 1536 + 1536 + 1536 * 128 * (128 + 64) + h * (512 + 64) + 512 + 512 * 128 * (128 + 128) + 128 * 128 * h
    dense_ffn, moe_ffn = 3 * h * 18432, 3 * h * 2048 * 257 + h * 256
    weights = 3 * (mla + 2 * h + dense_ffn) + 58 * (mla + 2 * h + moe_ffn) + h + 129280 * h
    need = weights + 576 * 61 * 4096
    rack = 256 * 499_998_720
    assert ceil(need / rack) == 6
    for mode in ("lpx-only", "lpx-decode"):
        error = hetero_plan("deepseek-v3", "lpx-rack", "gb300:72", dtype="fp8", mode=mode)["modes"][mode]["error"]
        assert error == "needs 6 LPX racks: 670.1 GB of fp8 weights and 0.1 GB of KV cache; lpx-rack holds 128.0 GB"
    assert round(weights / 1e9, 1) == 670.1 and round(rack / 1e9, 1) == 128.0
    ffn = 3 * dense_ffn + 58 * moe_ffn
    error = hetero_plan("deepseek-v3", "lpx-rack", "gb300:72", dtype="fp8", mode="afd")["modes"]["afd"]["error"]
    assert error == (f"needs {ceil(ffn / rack)} LPX racks: the FFN's {ffn / 1e9:.1f} GB of fp8 weights; lpx-rack holds "
                     "128.0 GB")


@pytest.mark.slow
def test_deepseek_v3_drafts_with_its_nextn_on_one_rack_and_verifies_on_the_gpus():
    """DeepSeek-V3 needs 6 racks, but lpx-draft puts only its NextN module on LPX: beside one rack it drafts on
    copies of the module's own plan that the rack's 256 LP30s hold, and each round carries the k + 1 verified
    positions' hidden states (7,168 × 2 bytes each) to LPX over the link (the assumed 100 GB/s a GPU, at most
    6,400 a rack)."""
    from lpx_tvm.app.plan.search import plan

    report = hetero_plan("deepseek-v3", "lpx-rack", "gb300:72", dtype="fp8", mode="lpx-draft", lpx_chip_watts=400)
    r = report["modes"]["lpx-draft"]
    assert "error" not in r, r
    c = r["config"]
    assert c["draft"] == "deepseek-v3-nextn"
    copies = c["draft_chips"] // c["draft_copy_chips"]
    assert copies >= 1 and copies * c["draft_copy_chips"] == c["draft_chips"] == r["lpus"] <= 256
    alone = plan("deepseek-v3-nextn", "lpx-rack", dtype="fp8", context=4096, prompt=512, batches=(1, 4))
    assert c["draft_copy_chips"] in {row["chips"] for row in alone["frontier"]}
    assert r["lpx_racks"] == 1
    k, batch, tp = c["draft_tokens"], c["batch"], c["tp"]
    states_ms = batch * (k + 1) * 7168 * 2 / min(tp * 100e9, 6400e9) * 1e3
    assert c["hidden_states_ms"] == pytest.approx(states_ms)
    a = 0.7
    tokens = (1 - a ** (k + 1)) / (1 - a)
    round_ms = k * c["draft_step_us"] / 1e3 + c["verify_ms"] + 2 * 5 / 1e3 + states_ms
    assert r["tokens_per_s_per_user"] == pytest.approx(1e3 * tokens / round_ms)
