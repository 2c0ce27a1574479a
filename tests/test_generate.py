"""LLM decode on lpx: the KV cache resident on the chips, prefill and greedy steps equal to ONNX Runtime's."""

from math import ceil

import numpy as np

import pytest

import lpx_tvm
from lpx_tvm.app.models import llama
from lpx_tvm.app.cli import main
from lpx_tvm.app.llm.generate import generate
from lpx_tvm.runtime import total_offloaded_calls
from lpx_tvm.runtime_sim import CallError, Opcode, load_config


def test_the_cache_is_resident_and_never_loaded():
    config = llama.PRESETS["llama-tiny"]
    names = llama.cache_names(config)
    compiled = lpx_tvm.compile(llama.build_decode(config), config="tiny", state=names)
    (sim,) = compiled.simulators.values()
    resident = {index for index, _ in sim.program.state}
    cache_args = {arg for name in names for _, arg in compiled.state_where[name]}  # the program's own inputs
    assert resident == cache_args and len(resident) == 2 * config.num_layers
    assert not any(ins.opcode == Opcode.LOAD and ins.attrs["index"] in resident for ins in sim.program.instructions)
    with pytest.raises(ValueError, match="not inputs of the model"):
        lpx_tvm.compile(llama.build_decode(config), config="tiny", state=["past_key_values.9.key"])


def _ort_greedy(config, prompt, tokens: int) -> list:
    """Greedy decoding in ONNX Runtime alone, on the same seeded graphs, its cache on the host."""
    prefill, decode = llama.ort_sessions(llama.build_prefill(config, len(prompt), 0), llama.build_decode(config, 0))
    cache = llama.initial_cache(config)
    out = prefill.run(None, llama.prefill_feeds(config, prompt))
    llama.write_cache(cache, out[1:], 0)
    chosen = [int(np.argmax(out[0][0, -1]))]
    for step in range(tokens):
        position = len(prompt) + step
        out = decode.run(None, llama.decode_feeds(config, chosen[-1], position, cache))
        llama.write_cache(cache, out[1:], position)
        chosen.append(int(np.argmax(out[0][0, -1])))
    return chosen


@pytest.mark.slow
def test_greedy_decode_on_two_chips_equals_onnx_runtime_and_charges_the_kv_write():
    """llama-tiny pipelined on tiny-2: its tokens are ONNX Runtime's greedy tokens, decoded here by ORT alone
    from the same prompt; the prefill and each of the 4 steps ran on lpx (one lpx program each: 5 calls)."""
    config = llama.PRESETS["llama-tiny"]
    calls = total_offloaded_calls()
    report = generate("llama-tiny", tokens=4, system="tiny-2", parallel="pipeline", prompt_len=6)
    assert report["programs"] == {"prefill": 1, "decode": 1}
    assert total_offloaded_calls() - calls == 1 + 4
    want = _ort_greedy(config, report["prompt"], 4)
    assert report["tokens"] == want
    # a preset's steps are checked by one ORT run over the whole sequence: its choices, position by position,
    # are those of ORT's own step-by-step decode
    assert report["reference"] == "one ONNX Runtime run over the whole sequence"
    assert report["reference_tokens"] == want
    assert len(report["steps"]) == 5 and all(step["cosine"] > 0.99999 for step in report["steps"])
    # a step writes each layer's new K and V (kv_heads × head_dim fp32 each) on the chip holding the layer,
    # over that chip's host link; the chips write at once, so the busiest sets the time, then the DMA latency
    tiny = load_config("tiny")
    written = report["kv_write_bytes_per_chip"]
    assert sum(written.values()) == config.num_layers * 2 * config.num_kv_heads * config.head_dim * 4
    assert report["kv_write_cycles"] == ceil(max(written.values()) / (tiny.host_bytes_per_s / tiny.clock_hz)) + \
        tiny.latency_cycles["MEM"]
    assert report["tokens_per_s_per_user"] == pytest.approx(
        tiny.clock_hz / (report["decode_cycles"] + report["kv_write_cycles"]))  # a step, then its K/V write
    # stage 0 hands stage 1 the hidden state (hidden fp32) and the attention mask over the cache's positions
    # and the new one (max_context + 1 fp32), once a step
    (link,) = report["links"]
    assert (link["from"], link["peer"], link["transfers"]) == (0, 1, 2)
    assert link["bytes"] == config.hidden_size * 4 + (config.max_context + 1) * 4 == 516


@pytest.mark.parametrize("flags, where", [([], "single chip"), (["--system", "tiny-2"], "pipeline"),
                                          (["--system", "tiny-2", "--parallel", "tensor"], "tensor")])
@pytest.mark.slow
def test_the_generate_command(capsys, flags, where):
    """With no flags it runs on one chip, and --system alone pipelines (both failed: --parallel was passed on as
    None, "parallel=None needs a system of chips" and "parallel must be one of ..., got None")."""
    assert main(["generate", "llama-tiny", "--tokens", "2", "--config", "tiny"] + flags) == 0
    out = capsys.readouterr().out
    assert "every token equal to ONNX Runtime" in out and "tokens/s per user" in out and f"({where}, fp32)" in out


def test_gpt2_small_sized_decoder_does_not_fit_one_tsp_chip():
    config = llama.PRESETS["llama-gpt2s"]
    assert config.dtype == "fp16" and config.weight_bytes() > load_config("tsp").sram_bytes


@pytest.mark.parametrize("dtype, itemsize", [("fp32", 4), ("fp16", 2)])
@pytest.mark.slow
def test_tensor_parallel_splits_a_decoders_attention_and_its_cache_by_heads(dtype, itemsize):
    """2-way on tiny chips: each chip holds its kv heads of every cache (half the bytes), writes only those,
    stores its heads' new K/V itself (in fp16 too: the host widens them), and a step costs
    one all-reduce per attention and per MLP; every token equals ONNX Runtime's. The logits are stored as
    each chip's columns, in fp16 too (the host widens them): no all-gather."""
    config = llama.PRESETS["llama-tiny"]
    report = generate("llama-tiny", tokens=3, system="tiny-2", parallel="tensor", prompt_len=6, dtype=dtype)
    assert report["agree"] and all(step["cosine"] > 0.9999 for step in report["steps"])
    assert f"0 all-gathers, {2 * config.num_layers} all-reduces" in report["notes"]
    # a new token's K and V, kv_heads × head_dim each per layer in the cache's type, half of the heads a chip
    half = config.num_layers * 2 * config.num_kv_heads * config.head_dim * itemsize // 2
    assert report["kv_write_bytes_per_chip"] == {0: half, 1: half}


def test_a_split_cache_is_written_with_its_head_axis_whole():
    config = llama.PRESETS["llama-tiny"]
    names = llama.cache_names(config)
    compiled = lpx_tvm.compile(llama.build_decode(config), system="tiny-2", parallel="tensor", state=names)
    views = compiled.state_views(names[0])
    assert [v.shape[1] for v in views] == [config.num_kv_heads // 2] * 2  # each chip its heads
    new = np.arange(config.num_kv_heads * config.head_dim, dtype=np.float32).reshape(1, -1, 1, config.head_dim)
    compiled.write_state(names[0], new, (slice(None), slice(None), slice(3, 4)))
    np.testing.assert_array_equal(np.concatenate([v[:, :, 3:4] for v in views], axis=1), new)
    with pytest.raises(CallError, match="split over chips along axis 1"):
        compiled.write_state(names[0], new[:, :1], (slice(None), 0, slice(3, 4)))


@pytest.mark.parametrize("tokens", [0, -1])
def test_no_tokens_is_named(tokens):
    """(0 decode steps reported a time a token with no cache write in it; -1 was taken as 0.)"""
    with pytest.raises(ValueError, match=f"tokens must be a positive integer, got {tokens}"):
        generate("llama-tiny", tokens=tokens)


def test_generate_of_a_folder_without_the_decoder_files_names_what_is_missing(tmp_path, capsys):
    assert main(["generate", str(tmp_path), "--tokens", "2"]) != 0
    err = capsys.readouterr().err
    assert "is not a decoder folder: it has no prefill.onnx or decode.onnx" in err and "Traceback" not in err


@pytest.mark.slow
def test_generate_s_tokens_are_onnx_runtime_s_own_greedy_decode(tmp_path):
    """The reference here is ONNX Runtime alone: the decoder's two graphs from files, run greedily on the same
    prompt with ORT's own cache, step after step; lpx's tokens (from the simulated chips) must be those."""
    import onnxruntime as ort

    config = llama.PRESETS["llama-tiny"]
    paths = llama.save_llama(config, tmp_path, prompt_len=6)
    report = generate(str(tmp_path), tokens=4, system="tiny-2", parallel="pipeline")
    prefill, decode = (ort.InferenceSession(str(paths[k]), providers=["CPUExecutionProvider"])
                       for k in ("prefill", "decode"))
    names = llama.output_names(config)
    outputs = dict(zip(names, prefill.run(None, llama.prefill_feeds(config, report["prompt"]))))
    cache = llama.write_cache(llama.initial_cache(config), outputs, 0)
    tokens = [int(np.argmax(outputs["logits"][0, -1]))]
    for step in range(4):
        position = 6 + step
        outputs = dict(zip(names, decode.run(None, llama.decode_feeds(config, tokens[-1], position, cache))))
        llama.write_cache(cache, outputs, position)
        tokens.append(int(np.argmax(outputs["logits"][0, -1])))
    assert report["tokens"] == tokens


def test_choosing_a_token_greedy_or_by_a_draw_from_the_top_k():
    """logits [1, 3, 2]: greedy picks 1. At temperature 1 from the top 2, the probabilities of tokens 1 and 2
    are e³/(e³+e²) = 0.731 and 0.269: a draw of 0.5 falls in token 1's share, 0.8 in token 2's."""
    from lpx_tvm.app.llm.generate import _choose

    logits = np.array([1.0, 3.0, 2.0])
    assert _choose(logits, None, 0.0, None) == 1
    share = np.exp(3) / (np.exp(3) + np.exp(2))
    assert share == pytest.approx(0.731, abs=1e-3)
    assert _choose(logits, 0.5, 1.0, 2) == 1
    assert _choose(logits, 0.8, 1.0, 2) == 2
    assert _choose(logits, 0.99, 1.0, 2) == 2  # never token 0: it is outside the top 2


@pytest.mark.slow
def test_a_text_prompt_goes_through_the_folder_s_tokenizer_and_the_text_comes_back(tmp_path):
    """A word-level tokenizer.json (the tokenizers package, written here: nothing downloaded) beside the saved
    decoder: --prompt's words become its ids, and the generated ids come back as its words."""
    tokenizers = pytest.importorskip("tokenizers", reason="needs the optional dependency tokenizers")
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    config = llama.PRESETS["llama-tiny"]
    llama.save_llama(config, tmp_path, prompt_len=3)
    vocab = {f"w{i}": i for i in range(config.vocab_size)}
    tokenizer = tokenizers.Tokenizer(WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    report = generate(str(tmp_path), tokens=2, prompt="w5 w17 w42")
    assert report["prompt"] == [5, 17, 42]
    assert report["text"] == " ".join(f"w{t}" for t in report["tokens"])
    with pytest.raises(ValueError, match="takes 3 prompt tokens, the prompt has 2"):
        generate(str(tmp_path), tokens=1, prompt="w5 w17")
    with pytest.raises(ValueError, match=r"prompt ids must be tokens of the vocabulary \(0 to 255\), got \[256\]"):
        generate("llama-tiny", tokens=1, prompt_ids=[3, 256])
    with pytest.raises(ValueError, match="needs a tokenizer.json"):
        generate("llama-tiny", tokens=1, prompt="hello")


@pytest.mark.slow
def test_sampled_tokens_are_onnx_runtime_s_under_the_same_draws(tmp_path):
    """At temperature 0.8 from the top 20, each step's one seeded uniform draw picks lpx's token; ONNX Runtime
    alone, run here on the saved graphs with the same draws (numpy's generator at the seed + 2, as generate
    documents), picks the same tokens."""
    import onnxruntime as ort

    config = llama.PRESETS["llama-tiny"]
    paths = llama.save_llama(config, tmp_path, prompt_len=4)
    report = generate(str(tmp_path), tokens=3, prompt_ids=[9, 8, 7, 6], temperature=0.8, top_k=20)
    prefill, decode = (ort.InferenceSession(str(paths[k]), providers=["CPUExecutionProvider"])
                       for k in ("prefill", "decode"))
    assert report["reference"] == "ONNX Runtime step by step"  # a folder's graphs, as they came
    assert report["tokens"] == _ort_sampled(config, prefill, decode, [9, 8, 7, 6], 3)
    assert report["sampling"] == {"temperature": 0.8, "top_k": 20}


@pytest.mark.slow
def test_a_presets_sampled_tokens_are_onnx_runtime_s_under_the_same_draws_checked_in_one_run():
    """The same for the preset, whose steps ORT checks in one run over the whole sequence at the end: each
    step's draw still picks ORT's token at that position (ORT alone, step by step, here)."""
    config = llama.PRESETS["llama-tiny"]
    report = generate("llama-tiny", tokens=3, prompt_ids=[9, 8, 7, 6], temperature=0.8, top_k=20)
    prefill, decode = llama.ort_sessions(llama.build_prefill(config, 4, 0), llama.build_decode(config, 0))
    want = _ort_sampled(config, prefill, decode, [9, 8, 7, 6], 3)
    assert report["reference"] == "one ONNX Runtime run over the whole sequence"
    assert report["tokens"] == want and report["reference_tokens"] == want


def _ort_sampled(config, prefill, decode, prompt, steps):
    """ORT's tokens at temperature 0.8 from the top 20, one draw a step from numpy's generator at seed + 2."""
    draws = np.random.default_rng(0 + 2)

    def sample(logits):
        top = np.argsort(-logits.astype(np.float64), kind="stable")[:20]
        p = np.exp((logits[top] - logits[top].max()) / 0.8)
        return int(top[min(np.searchsorted(np.cumsum(p / p.sum()), draws.random(), side="right"), 19)])
    names = llama.output_names(config)
    out = dict(zip(names, prefill.run(None, llama.prefill_feeds(config, prompt))))
    cache = llama.write_cache(llama.initial_cache(config), out, 0)
    tokens = [sample(out["logits"][0, -1])]
    for step in range(steps):
        out = dict(zip(names, decode.run(None, llama.decode_feeds(config, tokens[-1], len(prompt) + step, cache))))
        llama.write_cache(cache, out, len(prompt) + step)
        tokens.append(sample(out["logits"][0, -1]))
    return tokens


def test_the_prefill_and_decode_sessions_hold_each_weight_once_and_answer_as_plain_sessions():
    """ORT sessions of both graphs feed their large weights from one array per weight (each session copied
    them before); their logits are a plain session's to fp32 rounding (ORT packs weights it holds as
    initializers for its kernels, and sums them in another order)."""
    config = llama.PRESETS["llama-tiny"]
    prefill, decode = llama.build_prefill(config, 6), llama.build_decode(config)
    shared_prefill, shared_decode = llama.ort_sessions(prefill, decode)
    common = set(shared_prefill.weights) & set(shared_decode.weights)
    assert common and all(shared_prefill.weights[n] is shared_decode.weights[n] for n in common)
    feeds = llama.prefill_feeds(config, [1, 2, 3, 4, 5, 6])
    np.testing.assert_allclose(shared_prefill.run(None, feeds)[0], llama.ort_session(prefill).run(None, feeds)[0],
                               rtol=1e-5, atol=1e-6)
    step = llama.decode_feeds(config, 7, 6, llama.initial_cache(config))
    np.testing.assert_allclose(shared_decode.run(None, step)[0], llama.ort_session(decode).run(None, step)[0],
                               rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_int8_generate_quantises_both_graphs_and_runs_them_as_onnx_runtime_does():
    """``dtype="int8"`` on a preset: both graphs made QDQ by ORT's quantiser on seeded steps. Their rotary
    embeddings share one dequantised rotate-half matrix, which TVM's pattern fusion lost (the build failed:
    "Var ... is not defined"); each reader now has its own DequantizeLinear."""
    calls = total_offloaded_calls()
    report = generate("llama-tiny", tokens=6, dtype="int8")
    assert "calibrated on a seeded 8-token prompt and 4 decode steps" in report["quantised"]
    assert report["programs"] == {"prefill": 1, "decode": 1}
    assert total_offloaded_calls() - calls == 1 + 6
    miss = next((s for s in report["steps"] if s["token"] != s["reference_token"]), None)
    assert miss is None or miss["reference_margin"] < 0.05, miss  # a near-tie: a step of the logits' scale
    assert min(s["cosine"] for s in report["steps"]) > 0.999


def test_the_reference_step_runs_on_its_own_thread_and_hands_back_its_value_or_its_error():
    """ORT's step runs beside lpx's: on a thread named for it, its value what the waiter gets, and an error in
    it raised to the waiter, not lost in the thread."""
    import threading

    from lpx_tvm.app.llm.generate import _meanwhile

    where = []

    def step(token):
        where.append(threading.current_thread().name)
        return token * 2

    assert _meanwhile(step, 21)() == 42
    assert where == ["ort-reference"]

    def broken(token):
        raise RuntimeError(f"ORT could not run token {token}")

    with pytest.raises(RuntimeError, match="could not run token 7"):
        _meanwhile(broken, 7)()


@pytest.mark.slow
def test_generate_says_how_many_weights_stream_when_the_chips_cannot_hold_them():
    """llama-small's products are 10,485,760 bytes of fp32: 4 layers of q (256×256), k and v (256×128 each), o
    (256×256), gate and up (256×512 each) and down (512×256), and the head (256×1024). The tiny chip holds 4 MiB,
    so at least the rest streams from host memory every step, and the report says how much."""
    from lpx_tvm.app.llm.generate import table

    products = 4 * 4 * (2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 512) + 4 * 256 * 1024
    assert products == 10_485_760
    small = generate("llama-small", tokens=1, config="tiny")
    assert products - 4 * 2**20 <= small["streamed_bytes_per_step"] <= products
    assert f"streamed weights: {small['streamed_bytes_per_step'] / 1e6:.1f} MB" in str(table(small))
    fits = generate("llama-tiny", tokens=1, config="tiny")  # 0.43 MB of weights
    assert "streamed_bytes_per_step" not in fits and "streamed weights" not in str(table(fits))
