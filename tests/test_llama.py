"""Llama-style prefill/decode ONNX graphs (lpx_tvm.app.models.llama): ONNX Runtime against an independent numpy
forward pass, the static cache against a full prefill, fp16 against fp32, and the graphs on lpx."""

import json

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from lpx_tvm.app.models import llama as L

TINY = L.PRESETS["llama-tiny"]
ALLOWED_OPS = {"Gather", "MatMul", "Add", "Mul", "ReduceMean", "Sqrt", "Reciprocal", "Sigmoid", "Softmax",
               "Reshape", "Transpose", "Concat", "Cast", "Identity"}


def weights_of(model):
    return {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}


def run(model, feeds):
    return dict(zip(L.output_names(L.config_of(model)), L.ort_session(model).run(None, feeds)))


def cosine(a, b):
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


# ---------------------------------------------------------------------------
# an independent numpy Llama (float64): slicing rotate_half, np.repeat for GQA, explicit causal mask
# ---------------------------------------------------------------------------
def numpy_llama(w, c, ids):
    """Logits [seq, vocab] and per-layer (K, V) [kv_heads, seq, head_dim] of a prompt at positions 0..seq-1."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    seq, d, heads, kv = len(ids), c.hidden_size // c.num_heads, c.num_heads, c.num_kv_heads
    inv_freq = 1.0 / c.rope_theta ** (np.arange(0, d, 2) / d)
    angles = np.arange(seq)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(np.concatenate([angles, angles], -1)), np.sin(np.concatenate([angles, angles], -1))

    def rms(x, g):
        return x / np.sqrt(np.mean(x ** 2, axis=-1, keepdims=True) + c.rms_norm_eps) * g

    def rotate_half(t):
        return np.concatenate([-t[..., d // 2:], t[..., :d // 2]], axis=-1)

    def softmax(s):
        e = np.exp(s - s.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    x = w["model.embed_tokens.weight"][np.asarray(ids)]
    presents = []
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"]).reshape(seq, heads, d).transpose(1, 0, 2)
        k = (h @ w[p + "self_attn.k_proj.weight"]).reshape(seq, kv, d).transpose(1, 0, 2)
        v = (h @ w[p + "self_attn.v_proj.weight"]).reshape(seq, kv, d).transpose(1, 0, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        presents.append((k, v))
        k_all, v_all = np.repeat(k, heads // kv, axis=0), np.repeat(v, heads // kv, axis=0)  # HF repeat_kv
        scores = q @ k_all.transpose(0, 2, 1) / np.sqrt(d)
        scores = np.where(np.tril(np.ones((seq, seq), bool)), scores, -np.inf)
        attn = (softmax(scores) @ v_all).transpose(1, 0, 2).reshape(seq, heads * d)
        x = x + attn @ w[p + "self_attn.o_proj.weight"]
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        gate = h @ w[p + "mlp.gate_proj.weight"]
        x = x + (gate / (1 + np.exp(-gate)) * (h @ w[p + "mlp.up_proj.weight"])) @ w[p + "mlp.down_proj.weight"]
    head = w["model.embed_tokens.weight"].T if c.tie_word_embeddings else w["lm_head.weight"]
    return rms(x, w["model.norm.weight"]) @ head, presents


VARIANTS = {
    "gqa-untied": TINY,
    "gqa-tied": TINY.replace(tie_word_embeddings=True),
    "mqa": TINY.replace(num_kv_heads=1),
    "mha": TINY.replace(num_kv_heads=4, num_layers=1),
}


# ---------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("hidden_size", 0), ("num_layers", -1), ("num_heads", 3), ("num_kv_heads", 3), ("intermediate_size", 1.5),
    ("vocab_size", True), ("max_context", 0), ("rope_theta", 0.0), ("rms_norm_eps", -1e-5),
    ("tie_word_embeddings", "yes"), ("dtype", "bf16"),
])
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"LlamaConfig\.{field}\b"):
        TINY.replace(**{field: value})


def test_odd_head_dim_is_rejected():
    with pytest.raises(ValueError, match="head_dim .* must be even"):
        TINY.replace(hidden_size=60, num_heads=4, num_kv_heads=2)  # head_dim 15


def test_presets_and_sizes():
    assert TINY.head_dim == 16 and TINY.num_rep == 2
    assert L.get_config("llama-small") is L.PRESETS["llama-small"]
    with pytest.raises(ValueError, match="unknown llama config"):
        L.get_config("llama-huge")
    # parameters of llama-tiny counted by hand: embed 256*64, per layer q,o 64*64 each, k,v 64*32 each,
    # gate/up/down 64*128 each, two norms of 64; final norm 64; untied head 64*256
    per_layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64
    assert TINY.parameter_count() == 2 * 256 * 64 + 2 * per_layer + 64
    assert TINY.weight_bytes() == 4 * TINY.parameter_count()
    assert TINY.replace(tie_word_embeddings=True).parameter_count() == TINY.parameter_count() - 256 * 64
    assert sum(v.size for v in L.llama_weights(TINY).values()) == TINY.parameter_count()


def test_gpt2_small_sized_preset_outgrows_one_chip_by_arithmetic():
    c = L.PRESETS["llama-gpt2s"]
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.vocab_size, c.max_context) == \
        (768, 12, 12, 12, 50257, 1024)
    assert c.dtype == "fp16" and not c.tie_word_embeddings and c.intermediate_size == 2048
    h, v, ffn = 768, 50257, 2048
    by_hand = 2 * v * h + 12 * (4 * h * h + 3 * h * ffn + 2 * h) + h  # 162,148,608 parameters
    assert c.parameter_count() == by_hand
    assert c.weight_bytes() == 2 * by_hand > 230_686_720  # > 220 MiB, the tsp chip's SRAM


# ---------------------------------------------------------------------------
# the graphs
# ---------------------------------------------------------------------------
def test_graphs_are_valid_static_and_use_plain_ops():
    c = TINY
    prefill, decode = L.build_prefill(c, 8), L.build_decode(c)
    for model in (prefill, decode):
        onnx.checker.check_model(model, full_check=True)
        assert {n.op_type for n in model.graph.node} <= ALLOWED_OPS
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
        for value in list(inferred.graph.input) + list(inferred.graph.output) + list(inferred.graph.value_info):
            dims = value.type.tensor_type.shape.dim
            assert all(dim.HasField("dim_value") and dim.dim_value > 0 for dim in dims), value.name
        assert L.config_of(model) == c
    kv, d = c.num_kv_heads, c.head_dim
    shapes = lambda values: {v.name: [x.dim_value for x in v.type.tensor_type.shape.dim] for v in values}
    assert shapes(prefill.graph.input) == {"input_ids": [1, 8], "rope_cos": [8, d], "rope_sin": [8, d]}
    assert shapes(prefill.graph.output) == {"logits": [1, 8, 256], **{n: [1, kv, 8, d] for n in L.present_names(c)}}
    assert shapes(decode.graph.input) == {"input_ids": [1, 1], "rope_cos": [1, d], "rope_sin": [1, d],
                                          "attention_mask": [1, 1, 1, 64],
                                          **{n: [1, kv, 64, d] for n in L.cache_names(c)}}
    assert shapes(decode.graph.output) == {"logits": [1, 1, 256], **{n: [1, kv, 1, d] for n in L.present_names(c)}}
    assert [o.name for o in decode.graph.output] == L.output_names(c)
    # same seed, same weights in both graphs; another seed, others
    wp, wd = weights_of(prefill), weights_of(decode)
    for name in L.llama_weights(c):
        np.testing.assert_array_equal(wp[name], wd[name])
    assert not np.array_equal(weights_of(L.build_decode(c, seed=1))["lm_head.weight"], wd["lm_head.weight"])


def test_host_helpers():
    c = TINY
    cos, sin = L.rope_tables(c, [0, 3])
    assert cos.shape == sin.shape == (2, 16) and cos.dtype == np.float32
    np.testing.assert_array_equal(cos[0], 1)
    np.testing.assert_array_equal(sin[0], 0)
    np.testing.assert_allclose(cos[1, [0, 8]], np.cos(3.0), rtol=1e-6)  # frequency 1, repeated in both halves
    np.testing.assert_allclose(sin[1, [7, 15]], np.sin(3.0 / 10000 ** (14 / 16)), rtol=1e-5)
    mask = L.decode_mask(c, 5)
    assert mask.shape == (1, 1, 1, 64) and (mask[..., :5] == 0).all() and (mask[..., 5:] == L.MASK_VALUE).all()
    with pytest.raises(ValueError, match="position 64"):
        L.decode_mask(c, 64)
    cache = L.initial_cache(c)
    assert list(cache) == L.cache_names(c) and cache["past_key_values.1.value"].shape == (1, 2, 64, 16)
    new = {n: np.full((1, 2, 3, 16), k + 1, np.float32) for k, n in enumerate(L.present_names(c))}
    L.write_cache(cache, new, 4)
    key = cache["past_key_values.0.key"]
    assert (key[:, :, 4:7] == 1).all() and (key[:, :, :4] == 0).all() and (key[:, :, 7:] == 0).all()
    assert (cache["past_key_values.1.value"][:, :, 4:7] == 4).all()
    with pytest.raises(ValueError, match="capacity"):
        L.write_cache(cache, new, 62)
    with pytest.raises(ValueError, match="max_context"):
        L.build_prefill(c, 65)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_matches_independent_numpy_llama(variant):
    c = VARIANTS[variant]
    ids = np.random.default_rng(7).integers(0, c.vocab_size, 12)
    model = L.build_prefill(c, len(ids), seed=3)
    out = run(model, L.prefill_feeds(c, ids))
    logits, presents = numpy_llama(weights_of(model), c, ids)
    assert np.abs(logits).max() > 0.5 and logits.std() > 0.3  # O(1), not washed out
    np.testing.assert_allclose(out["logits"][0], logits, rtol=1e-4, atol=1e-4 * np.abs(logits).max())
    for i, (k, v) in enumerate(presents):
        np.testing.assert_allclose(out[f"present.{i}.key"][0], k, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(out[f"present.{i}.value"][0], v, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("variant", ["gqa-untied", "gqa-tied", "mqa"])
def test_static_cache_decode_matches_full_prefill(variant):
    """prefill(prompt) + k decode steps == one prefill of prompt + generated tokens, position by position:
    the cache, the mask and the rotary positions are right."""
    c, prompt, k = VARIANTS[variant], [5, 17, 200, 3, 99, 42, 8], 6
    got = L.generate_reference(c, prompt, k, seed=2)
    assert len(got["tokens"]) == k + 1 and got["positions"] == list(range(7, 13))
    assert got["step_logits"].shape == (k, c.vocab_size) and got["logits"].shape == (k + 1, c.vocab_size)
    assert got["tokens"] == [int(np.argmax(row)) for row in got["logits"]]
    full_len = len(prompt) + k  # the last chosen token is never fed
    full = run(L.build_prefill(c, full_len, seed=2), L.prefill_feeds(c, got["sequence"][:full_len]))
    scale = np.abs(full["logits"]).max()
    np.testing.assert_allclose(got["logits"], full["logits"][0, len(prompt) - 1:], rtol=1e-4, atol=1e-5 * scale)
    np.testing.assert_allclose(got["prefill_logits"], full["logits"][0, :len(prompt)], rtol=1e-4, atol=1e-5 * scale)
    for name, cache in got["cache"].items():  # every written slot holds the full prefill's K/V, the rest zeros
        present = full[name.replace("past_key_values.", "present.")]
        np.testing.assert_allclose(cache[:, :, :full_len], present, rtol=1e-4, atol=1e-5)
        assert not cache[:, :, full_len:].any()


def test_decode_ignores_masked_cache_slots():
    """Garbage in the slots the mask marks empty changes nothing."""
    c = TINY
    got = L.generate_reference(c, [1, 2, 3], 1)
    cache = {n: v.copy() for n, v in got["cache"].items()}
    for v in cache.values():
        v[:, :, 4:] = 1e3
    decode = L.build_decode(c)
    clean = run(decode, L.decode_feeds(c, got["tokens"][-1], 4, got["cache"]))
    dirty = run(decode, L.decode_feeds(c, got["tokens"][-1], 4, cache))
    np.testing.assert_allclose(dirty["logits"], clean["logits"], rtol=1e-6, atol=1e-6)


def test_fp16_graphs_run_in_ort_and_agree_with_fp32():
    prompt = [9, 8, 7, 6, 5, 4, 3, 2]
    fp32 = L.generate_reference(TINY, prompt, 4)
    half = TINY.replace(dtype="fp16")
    assert half.weight_bytes() == TINY.weight_bytes() // 2
    model = L.build_decode(half)
    params = set(L.llama_weights(half))
    assert {i.data_type for i in model.graph.initializer if i.name in params} == {onnx.TensorProto.FLOAT16}
    assert all(v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16 for v in model.graph.output)
    fp16 = L.generate_reference(half, prompt, 4)
    assert fp16["cache"]["past_key_values.0.key"].dtype == np.float16
    assert fp16["tokens"] == fp32["tokens"]
    for row16, row32 in zip(fp16["logits"], fp32["logits"]):
        assert cosine(row16, row32) > 0.999
    assert cosine(fp16["prefill_logits"], fp32["prefill_logits"]) > 0.999


def test_generate_reference_rejects_overflowing_requests():
    with pytest.raises(ValueError, match="max_context"):
        L.generate_reference(TINY, list(range(60)), 5)
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        L.generate_reference(TINY, [1, 256], 1)


def test_save_llama(tmp_path):
    paths = L.save_llama("llama-tiny", tmp_path, prompt_len=5, seed=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "decode.onnx", "prefill.onnx", "weights.bin"]
    # one copy of the weights for both graphs, beside them: the graphs hold none of their bytes
    assert paths["weights"].stat().st_size >= TINY.weight_bytes()
    assert max(paths["prefill"].stat().st_size, paths["decode"].stat().st_size) < TINY.weight_bytes() // 10
    prefill, decode = onnx.load(paths["prefill"]), onnx.load(paths["decode"])
    assert L.config_of(prefill) == L.config_of(decode) == TINY
    assert prefill.graph.input[0].type.tensor_type.shape.dim[1].dim_value == 5
    assert json.loads(paths["config"].read_text())["seed"] == 4
    np.testing.assert_array_equal(weights_of(decode)["lm_head.weight"], L.llama_weights(TINY, 4)["lm_head.weight"])


# ---------------------------------------------------------------------------
# TVM and lpx
# ---------------------------------------------------------------------------
class LpxSession:
    """An ONNX-Runtime-like session on lpx (inputs by position: TVM renames ``past_key_values.0.key``)."""

    def __init__(self, model):
        import lpx_tvm

        self.order = [i.name for i in model.graph.input]
        self.compiled = lpx_tvm.compile(model, config="tsp")

    def run(self, _names, feeds):
        return self.compiled(*[feeds[n] for n in self.order])


def test_graphs_import_into_tvm():
    import lpx_tvm

    for model in (L.build_prefill(TINY, 6), L.build_decode(TINY)):
        mod = lpx_tvm.from_onnx(model)
        assert len(mod["main"].params) == len(model.graph.input)


def test_decode_runs_on_lpx_and_matches_ort():
    from lpx_tvm.runtime import total_offloaded_calls

    c = TINY
    state = L.generate_reference(c, [3, 1, 4, 1, 5, 9, 2, 6], 2)
    feeds = L.decode_feeds(c, state["tokens"][-1], 10, state["cache"])
    decode = L.build_decode(c)
    session = LpxSession(decode)
    report = session.compiled.report
    print(f"\nllama-tiny decode on tsp: {report.summary()}")
    assert report.offloaded_pct > 99.0 and report.lpx_functions >= 1
    assert not {"relax.matmul", "relax.nn.softmax", "relax.sigmoid"} & set(report.host_ops)
    before = total_offloaded_calls()
    got = session.run(None, feeds)
    assert total_offloaded_calls() > before, "nothing ran on the lpx simulator"
    want = L.ort_session(decode).run(None, feeds)
    for name, g, w in zip(L.output_names(c), got, want):
        assert g.shape == w.shape, name
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * max(np.abs(w).max(), 1e-3), err_msg=name)


@pytest.mark.slow
def test_greedy_generation_on_lpx_matches_ort():
    from lpx_tvm.runtime import total_offloaded_calls

    before = total_offloaded_calls()
    got = L.generate_reference(TINY, [10, 20, 30, 40], 3, session_factory=LpxSession)
    assert total_offloaded_calls() - before >= 4  # one prefill, three decode steps
    want = L.generate_reference(TINY, [10, 20, 30, 40], 3)
    assert got["tokens"] == want["tokens"]
    np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-4, atol=1e-4 * np.abs(want["logits"]).max())


@pytest.mark.parametrize("build", [lambda c: L.build_decode(c), lambda c: L.build_prefill(c, 8)],
                         ids=["decode", "prefill"])
def test_a_graph_past_protobuf_s_2_gb_is_refused_before_its_weights_are_drawn(build):
    """Llama 3.2 1B's sizes in fp16: (128,256·2048 + 16·60,821,504 + 2048) parameters · 2 bytes = 2.47 GB."""
    config = L.PRESETS["llama-gpt2s"].replace(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                                                  intermediate_size=8192, vocab_size=128256,
                                                  tie_word_embeddings=True)
    assert config.weight_bytes() == (128256 * 2048 + 16 * 60821504 + 2048) * 2
    with pytest.raises(ValueError, match=r"1\.24 B parameters holds 2\.47 GB of weights, past ONNX's 2 GB.*"
                                         r"external=True"):
        build(config)


def test_the_1b_preset_is_llama_3_2_1b_s_blocks_with_a_32k_vocabulary():
    """Embedding 32,000·2048, 16 layers of 60,821,504 (q and o 2048², k and v 2048·512, three 2048·8192 MLP
    matrices, two norms), the final norm; tied: 1,038,682,112 parameters, 2.08 GB in fp16."""
    config = L.PRESETS["llama-1b"]
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (32, 8, 64)
    assert config.parameter_count() == 32000 * 2048 + 16 * 60821504 + 2048 == 1038682112
    assert config.weight_bytes() == 2 * 1038682112
