"""Weights held apart from the graphs: a decoder's prefill and decode graphs built with external-data
initializers (no weight bytes inside), fed to ONNX Runtime and bound into TVM from one set of arrays; fp16
weights an fp32 graph widens, stored on the chips as the very fp16 bytes. Values against ONNX Runtime."""

import os

import numpy as np
import onnx
import pytest

import lpx_tvm
from lpx_tvm.app.models import llama as L
from lpx_tvm.frontend import FrontendError
from lpx_tvm.runtime import offload_counts
from lpx_tvm.runtime_sim.program import decode

# weights of 64 KiB and more in fp16 (256 x 512 x 2 bytes = 256 KiB): the ones the frontend keeps narrow
SMALL = L.LlamaConfig(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=512,
                      vocab_size=512, max_context=16)
PROMPT = [3, 141, 59, 265, 358, 97]


def _fp16_weights():
    return L.llama_weights(SMALL.replace(dtype="fp16"), seed=5)


def _logits_on(compiled, feeds, graph):
    order = [i.name for i in graph.graph.input]
    return compiled(*[feeds[n] for n in order])[0]


def test_an_external_graph_holds_no_weight_bytes_and_names_where_they_are():
    weights = _fp16_weights()
    graph = L.build_prefill(SMALL, len(PROMPT), weights=weights, external=True)
    external = [i for i in graph.graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL]
    assert {i.name for i in external} == set(weights)
    assert all(not i.raw_data for i in external)
    locations = {i.name: {e.key: e.value for e in i.external_data} for i in external}
    assert {loc["location"] for loc in locations.values()} == {L.WEIGHTS_FILE}
    assert [int(locations[n]["length"]) for n in weights] == [w.nbytes for w in weights.values()]
    offsets = [int(locations[n]["offset"]) for n in weights]
    assert offsets == sorted(offsets) and all(o % 4096 == 0 for o in offsets)
    # the graph's own bytes: its nodes and small constants, a sliver of the 1.7 MB of weights
    assert graph.ByteSize() < sum(w.nbytes for w in weights.values()) // 20


@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
@pytest.mark.slow
def test_fp16_weights_an_fp32_graph_widens_run_on_lpx_as_onnx_runtime_runs_them(dtype):
    """The same arrays feed ORT and TVM. On fp16 chips every product's weight is stored as the fp16 bytes
    drawn (not rounded from an fp32 copy); on fp32 chips, as their exact widening."""
    weights = _fp16_weights()
    graph = L.build_prefill(SMALL, len(PROMPT), weights=weights, external=True)
    (session,) = L.ort_sessions(graph, weights=weights)
    feeds = L.prefill_feeds(SMALL, PROMPT)
    want = session.run(None, feeds)[0]
    before = offload_counts()
    compiled = lpx_tvm.compile(graph, weights=weights, dtype=dtype)
    got = _logits_on(compiled, feeds, graph)
    assert compiled.report.lpx_functions == 1 and "relax.matmul" not in compiled.report.host_ops
    assert sum((offload_counts() - before).values()) == 1  # it ran on lpx
    (blob,) = compiled.programs.values()
    stored = {c.data.tobytes() for c in decode(blob).constants}
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    assert (q.tobytes() if dtype == "fp16" else q.astype(np.float32).tobytes()) in stored
    cos = float(got.ravel() @ want.ravel() / np.linalg.norm(got) / np.linalg.norm(want))
    if dtype == "fp32":  # the same arithmetic up to the order of the sums
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    else:  # fp16 activations on the chip, fp32 in ORT
        assert cos > 0.9999 and np.abs(got - want).max() < 0.02 * np.abs(want).max()


def test_the_programs_hold_the_callers_fp16_weights_themselves_not_a_copy():
    """From the arrays given to the program's constants no weight is copied, widened or rounded: the
    constants of the compiled (not yet encoded) program are the arrays, and the q/k/v/o and MLP weights of
    both layers are among them."""
    weights = _fp16_weights()
    graph = L.build_decode(SMALL, weights=weights, external=True)
    programs, _ = lpx_tvm.compile_programs(graph, dtype="fp16", weights=weights)
    (program,) = programs.values()
    products = [n for n in weights if n.endswith("proj.weight")]
    held = [n for n in products if any(np.shares_memory(c.data, weights[n]) for c in program.constants)]
    assert held == products and len(products) == 14


def test_decode_and_prefill_graphs_share_one_set_of_arrays_in_onnx_runtime():
    weights = _fp16_weights()
    prefill = L.build_prefill(SMALL, len(PROMPT), weights=weights, external=True)
    decode_graph = L.build_decode(SMALL, weights=weights, external=True)
    sessions = L.ort_sessions(prefill, decode_graph, weights=weights)
    for session in sessions:
        fed = session.weights
        assert set(fed) == set(weights) and all(fed[n] is weights[n] for n in weights)
    # the external pair gives what graphs holding the same fp16 weights inside give
    inside = [L.ort_sessions(L.build_prefill(SMALL, len(PROMPT), weights=weights))[0],
              L.ort_sessions(L.build_decode(SMALL, weights=weights))[0]]
    cache = L.initial_cache(SMALL)
    np.testing.assert_array_equal(sessions[0].run(None, L.prefill_feeds(SMALL, PROMPT))[0],
                                  inside[0].run(None, L.prefill_feeds(SMALL, PROMPT))[0])
    step = L.decode_feeds(SMALL, 7, len(PROMPT), cache)
    np.testing.assert_array_equal(sessions[1].run(None, step)[0], inside[1].run(None, step)[0])


def test_external_weights_that_are_not_given_or_do_not_match_are_named():
    weights = _fp16_weights()
    graph = L.build_decode(SMALL, weights=weights, external=True)
    with pytest.raises(FrontendError, match=r"'model.embed_tokens.weight' is held as external data \(weights.bin\)"):
        lpx_tvm.compile(graph)
    wrong = dict(weights, **{"model.norm.weight": weights["model.norm.weight"].astype(np.float32)})
    with pytest.raises(FrontendError, match=r"weights\['model.norm.weight'\] is float32 \[256\]; the graph's "
                                            r"initializer is float16 \[256\]"):
        lpx_tvm.compile(graph, weights=wrong)
    with pytest.raises(ValueError, match="'model.embed_tokens.weight' is held as external data: pass its array"):
        L.ort_sessions(graph)
    with pytest.raises(ValueError, match="external=True keeps the weights apart"):
        L.build_decode(SMALL, external=True)
    inside = L.build_decode(SMALL, weights=weights)
    with pytest.raises(FrontendError, match=r"weights were given \(21 arrays\), but no initializer of the model is "
                                            "held as external data"):
        lpx_tvm.compile(inside, weights=weights)


@pytest.mark.slow
def test_an_unaligned_weight_is_bound_once_copied():
    """TVM binds 64-byte aligned arrays in place; another is copied once, with the same values."""
    weights = _fp16_weights()
    name = "model.layers.1.mlp.down_proj.weight"
    raw = np.empty(weights[name].nbytes + 2, np.uint8)[2:].view(np.float16).reshape(weights[name].shape)
    raw[...] = weights[name]
    assert raw.ctypes.data % 64
    graph = L.build_prefill(SMALL, len(PROMPT), weights=weights, external=True)
    feeds = L.prefill_feeds(SMALL, PROMPT)
    runs = []
    for given in (weights, dict(weights, **{name: raw})):
        compiled = lpx_tvm.compile(graph, weights=given)
        assert compiled.report.lpx_functions == 1 and not compiled.report.host_ops.get("relax.matmul")
        before = offload_counts()
        runs.append(_logits_on(compiled, feeds, graph))
        assert sum((offload_counts() - before).values()) == 1  # the whole prefill: one lpx program, run once
    aligned, unaligned = runs
    np.testing.assert_array_equal(unaligned, aligned)


@pytest.mark.slow
def test_a_saved_decoder_keeps_one_weights_file_that_generate_maps_in_place(tmp_path):
    """save_llama writes the two graphs without their weights and one weights file; generate maps it (no
    copy) and decodes as it does from the preset in memory, in fp32 and through ORT's quantiser in int8."""
    from lpx_tvm.app.llm.generate import _open_decoder, generate

    paths = L.save_llama("llama-tiny", tmp_path, prompt_len=6, seed=0)
    decoder = _open_decoder(tmp_path, 6, 0, None)
    assert set(decoder.weights) == set(L.llama_weights(L.PRESETS["llama-tiny"]))
    assert all(isinstance(w, np.memmap) and os.path.samefile(w.filename, paths["weights"])
               for w in decoder.weights.values())
    for dtype in ("fp32", "int8"):
        saved, preset = (generate(m, tokens=3, prompt_len=6, dtype=dtype) for m in (str(tmp_path), "llama-tiny"))
        assert saved["agree"] and saved["tokens"] == preset["tokens"]
        assert saved["per_token_cycles"] == preset["per_token_cycles"]


def test_a_saved_decoder_whose_weights_file_is_missing_or_short_is_named(tmp_path):
    from lpx_tvm.app.llm.generate import generate

    paths = L.save_llama("llama-tiny", tmp_path, prompt_len=4)
    size = paths["weights"].stat().st_size
    with open(paths["weights"], "r+b") as fh:
        fh.truncate(size - 8192)
    with pytest.raises(ValueError, match=r"lm_head.weight: \d+ bytes at \d+ run past the end of .*weights.bin"):
        generate(str(tmp_path), tokens=1)
    paths["weights"].unlink()
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight: its weights file .*weights.bin is missing"):
        generate(str(tmp_path), tokens=1)
