"""Weights the host holds, named by the programs (``compile(..., weights=w, hold_weights=True)``): the encoded
programs carry none of the bytes, they run as ONNX Runtime does, and a decoder's decode program keeps every
weight on the chip, and at the SRAM address, where its prefill program put it."""

import gc

import numpy as np
import pytest

import lpx_tvm
from lpx_tvm.app.models import llama as L
from lpx_tvm.runtime import offload_counts
from lpx_tvm.runtime_sim import ProgramFormatError
from lpx_tvm.runtime_sim.program import decode
from lpx_tvm.runtime_sim.system_sim import decode_system, is_system_program
from conftest import ort_reference

SMALL = L.LlamaConfig(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=512,
                      vocab_size=512, max_context=16)
PROMPT = [3, 141, 59, 265, 358, 97]
# the chips' weights: every projection (q, k, v, o, gate, up, down) of both layers and the untied head; the
# norms are widened to fp32 for the vector unit and the embedding is gathered on the host
PRODUCTS = [n for n in L.llama_weights(SMALL) if n.endswith("proj.weight")] + ["lm_head.weight"]


@pytest.fixture(scope="module")
def weights():
    return L.llama_weights(SMALL.replace(dtype="fp16"), seed=5)


def _placements(compiled) -> dict:
    """``{(weight name, byte offset): (chip, SRAM address, bytes)}`` of every constant its programs name."""
    out = {}
    for blob in compiled.programs.values():
        if is_system_program(blob):
            system = decode_system(blob)
            parts = zip(system.chips, system.programs)
        else:
            parts = [(0, decode(blob))]
        for chip, program in parts:
            for const in program.constants:
                if const.held:
                    out[const.held[1:]] = (chip, const.ref.addr, const.ref.nbytes)
    return out


@pytest.mark.slow
def test_held_programs_carry_no_weight_bytes_and_run_as_onnx_runtime_does(weights):
    graph = L.build_prefill(SMALL, len(PROMPT), weights=weights, external=True)
    feeds = L.prefill_feeds(SMALL, PROMPT)
    (session,) = L.ort_sessions(graph, weights=weights)
    want = session.run(None, feeds)[0]
    order = [i.name for i in graph.graph.input]
    before = offload_counts()
    held = lpx_tvm.compile(graph, weights=weights, dtype="fp16", hold_weights=True)
    got = held(*[feeds[n] for n in order])[0]
    assert sum((offload_counts() - before).values()) == 1  # it ran on lpx
    (blob,) = held.programs.values()
    on_chip = sum(weights[n].nbytes for n in PRODUCTS)  # 2,621,440 bytes
    assert held.held_bytes == on_chip
    assert len(blob) < on_chip // 20  # the instructions and the small constants, not the weights
    named = _placements(held)
    assert {name for name, _ in named} == set(PRODUCTS) and all(offset == 0 for _, offset in named)
    # the same arithmetic as a program that carries the bytes, and ONNX Runtime's up to fp16 activations
    inline = lpx_tvm.compile(graph, weights=weights, dtype="fp16")
    assert len(next(iter(inline.programs.values()))) > on_chip
    np.testing.assert_array_equal(got, inline(*[feeds[n] for n in order])[0])
    assert np.abs(got - want).max() < 0.02 * np.abs(want).max()


def test_a_held_program_outside_its_model_and_an_export_of_one_are_refused_by_name(weights, tmp_path):
    graph = L.build_decode(SMALL, weights=weights, external=True)
    compiled = lpx_tvm.compile(graph, weights=weights, dtype="fp16", hold_weights=True)
    with pytest.raises(ValueError, match="read the weights passed to compile.*without hold_weights to export"):
        compiled.export_library(tmp_path / "decode.so")
    (blob,) = compiled.programs.values()
    blob = bytes(blob)
    del compiled
    gc.collect()
    with pytest.raises(ProgramFormatError, match=r"is held by the host as 'model\.layers\.0\.self_attn\.q_proj"
                                                 r"\.weight' \(weight set [0-9a-f]{16}\), and this process holds "
                                                 "no such set"):
        decode(blob)


def test_hold_weights_needs_the_arrays_it_holds(weights):
    graph = L.build_decode(SMALL, weights=weights, external=True)
    with pytest.raises(ValueError, match="hold_weights holds the arrays passed as weights=...; none were given"):
        lpx_tvm.compile(L.build_decode(SMALL, weights=weights), hold_weights=True)
    first = lpx_tvm.compile(graph, weights=weights, dtype="fp16", hold_weights=True)
    other = dict(weights, **{"lm_head.weight": weights["lm_head.weight"].copy()})
    with pytest.raises(ValueError, match=r"the other model holds 'lm_head.weight', and weights\['lm_head.weight'\] "
                                         "is not that array"):
        lpx_tvm.compile(graph, weights=other, dtype="fp16", hold_weights=first.held)
    with pytest.raises(ValueError, match="hold_weights must be True, False or another model's held weights"):
        lpx_tvm.compile(graph, weights=weights, dtype="fp16", hold_weights="yes")


@pytest.mark.parametrize("system", [None, "tiny-4"])
@pytest.mark.slow
def test_decode_keeps_every_weight_where_the_prefill_put_it(weights, system):
    """One chip: the same addresses though the two programs' small constants differ (the prefill's causal mask).
    Four chips: a pipeline balanced afresh puts the decode's stages elsewhere (layer 0's o_proj on chip 0,
    not 1); over the prefill's held weights each stays on its chip."""
    options = dict(dtype="fp16", system=system)
    prefill = lpx_tvm.compile(L.build_prefill(SMALL, len(PROMPT), weights=weights, external=True),
                              weights=weights, hold_weights=True, **options)
    decode_graph = L.build_decode(SMALL, weights=weights, external=True)
    names = L.cache_names(SMALL)
    decoded = lpx_tvm.compile(decode_graph, weights=weights, state=names, hold_weights=prefill.held, **options)
    first, then = _placements(prefill), _placements(decoded)
    assert set(first) == set(then) == {(n, 0) for n in PRODUCTS}
    assert then == first
    chips = {chip for chip, _, _ in first.values()}
    assert chips == ({0} if system is None else {0, 1, 2, 3})
    assert prefill.held.shared == sum(weights[n].nbytes for n in PRODUCTS) and prefill.held.moved == 0
    if system is not None:  # afresh, the decode pipeline would have put some of them elsewhere
        afresh = _placements(lpx_tvm.compile(decode_graph, weights=weights, state=names, hold_weights=True,
                                             **options))
        assert {key for key in afresh if afresh[key] != first[key]} >= {("model.layers.0.self_attn.o_proj.weight", 0)}


@pytest.mark.slow
def test_generate_reports_the_decode_program_over_the_prefills_resident_weights():
    from lpx_tvm.app.llm.generate import generate

    report = generate("llama-small", tokens=2, system="tiny-4", dtype="fp16", prompt_len=6)
    assert report["agree"] and len(report["tokens"]) == 3
    # 4 layers of q and o 256x256, k and v 256x128, gate, up and down 256x512, and the 256x1024 head, in fp16
    on_chips = 2 * (4 * (2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 512) + 256 * 1024)
    assert report["resident_weights"] == {"held_by_name_bytes": on_chips, "shared_bytes": on_chips,
                                          "moved_bytes": 0}


@pytest.mark.slow
def test_a_tied_heads_transpose_is_made_once_and_named_by_both_programs(weights):
    """A tied head reads the embedding table transposed, which the lowering folds into a new array. Over held
    weights that array is made once, held with them, and both the prefill and the decode name it: neither
    program carries its 512 x 256 fp16 bytes, the chip keeps it at one address, and the logits are those of a
    program that carries them."""
    tied = SMALL.replace(tie_word_embeddings=True)
    table = weights["model.embed_tokens.weight"]
    tied_weights = {n: a for n, a in weights.items() if n != "lm_head.weight"}
    prefill_graph = L.build_prefill(tied, len(PROMPT), weights=tied_weights, external=True)
    prefill = lpx_tvm.compile(prefill_graph, weights=tied_weights, dtype="fp16", hold_weights=True)
    decoded = lpx_tvm.compile(L.build_decode(tied, weights=tied_weights, external=True), weights=tied_weights,
                              state=L.cache_names(tied), dtype="fp16", hold_weights=prefill.held)
    on_chip = sum(weights[n].nbytes for n in PRODUCTS)  # the projections and a head of the table's size
    assert prefill.held_bytes == decoded.held_bytes == on_chip
    first, then = _placements(prefill), _placements(decoded)
    (head,) = [key for key in first if key[0] not in weights]
    assert then == first and first[head][2] == table.nbytes
    derived = prefill.held.derived(table, ("transpose", 1, 0), lambda v: None)
    np.testing.assert_array_equal(derived, table.T)
    assert prefill.held.moved == 0 and all(len(b) < table.nbytes for b in decoded.programs.values())
    feeds = L.prefill_feeds(tied, PROMPT)
    args = [feeds[i.name] for i in prefill_graph.graph.input]
    inline = lpx_tvm.compile(prefill_graph, weights=tied_weights, dtype="fp16")
    before = offload_counts()
    got = prefill(*args)
    assert sum((offload_counts() - before).values()) == 1  # the whole prefill: one lpx program, run once
    before = offload_counts()
    carried = inline(*args)
    assert sum((offload_counts() - before).values()) == 1
    np.testing.assert_array_equal(got[0], carried[0])
    # ONNX Runtime on the same graphs with the weights inside, up to fp16 activations; then one decode step
    # over the prefill's caches (lpx's own on the chip, ORT's on the host), its head the held transpose too
    want = ort_reference(L.build_prefill(tied, len(PROMPT), weights=tied_weights), feeds)
    assert np.abs(got[0] - want[0]).max() < 0.02 * np.abs(want[0]).max()
    token, position = int(np.argmax(want[0][0, -1])), len(PROMPT)
    for name, new in zip(L.cache_names(tied), got[1:], strict=True):
        decoded.write_state(name, new, (slice(None), slice(None), slice(0, position)))
    before = offload_counts()
    (step, *_) = decoded(**L.decode_feeds(tied, token, position, L.initial_cache(tied)))
    assert sum((offload_counts() - before).values()) == 1  # the decode step: one lpx program, run once
    cache = L.write_cache(L.initial_cache(tied), want[1:], 0)
    (want_step, *_) = ort_reference(L.build_decode(tied, weights=tied_weights),
                                    L.decode_feeds(tied, token, position, cache))
    assert np.abs(step - want_step).max() < 0.02 * np.abs(want_step).max()


def test_a_streamed_weight_is_held_by_name_block_by_block(rng, tmp_path):
    """A 4.4 MB weight is more than the tiny chip's 4 MiB of SRAM, so its product streams it in column blocks
    from host memory. Held, each block is named as rows a pitch apart in the caller's array (program format 10):
    the program carries none of the weight's bytes (a 2.2 GB decoder's head was copied whole into its program).
    The weight comes from its file, as a user's model's external data does: mapped, not loaded."""
    import onnx
    from onnx import helper

    from conftest import make_model, tensor_info
    from lpx_tvm.frontend import mapped_external_data
    from lpx_tvm.runtime_sim.program import encode

    w = (rng.standard_normal((1088, 1024)) * 0.05).astype(np.float32)
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["y"])], [tensor_info("x", [1, 1088])],
                       [tensor_info("y", [1, 1024])], [onnx.numpy_helper.from_array(w, "w")])
    onnx.save_model(model, str(tmp_path / "m.onnx"), save_as_external_data=True, location="m.data")
    graph = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False)
    mapped = mapped_external_data(graph, tmp_path)
    assert isinstance(mapped["w"].base, np.memmap) or isinstance(mapped["w"], np.memmap)
    held = lpx_tvm.compile(graph, config="tiny", weights=mapped, hold_weights=True)
    (blob,) = held.programs.values()
    program = decode(blob)
    assert program.streamed and all(weight.held for weight in program.streamed)
    assert held.held_bytes == 1088 * 1024 * 4
    assert len(blob) < 1088 * 1024 * 4 // 8  # instructions only
    assert sum(weight.host.nbytes for weight in program.streamed) == 1088 * 1024 * 4
    assert {weight.held[3] for weight in program.streamed} == {1024 * 4}  # a row of w apart
    assert encode(program) == blob
    x = rng.standard_normal((1, 1088)).astype(np.float32)
    before = offload_counts()
    (got,) = held(x)
    assert sum((offload_counts() - before).values()) == 1
    np.testing.assert_allclose(got, x @ w, rtol=1e-4, atol=1e-4)
