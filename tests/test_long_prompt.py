"""Attention over a long prompt in blocks of queries (``lpx_tvm/attention.py``): the scores of one block at
a time, the whole attention in one lpx program, the numbers ONNX Runtime's."""

import numpy as np
import pytest
from onnx import helper, numpy_helper

import lpx_tvm
from conftest import make_model, ort_run, run_on_lpx, tensor_info
from lpx_tvm.runtime_sim import Opcode


def attention(heads: int, seq: int, dim: int, rng):
    """softmax(q kᵀ / √d + causal mask) v on [heads, seq, dim] inputs."""
    mask = np.triu(np.full((seq, seq), -1e4, np.float32), k=1)
    model = make_model([helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
                        helper.make_node("MatMul", ["q", "kt"], ["s"]),
                        helper.make_node("Mul", ["s", "scale"], ["scaled"]),
                        helper.make_node("Add", ["scaled", "mask"], ["masked"]),
                        helper.make_node("Softmax", ["masked"], ["p"], axis=-1),
                        helper.make_node("MatMul", ["p", "v"], ["y"])],
                       [tensor_info(n, [heads, seq, dim]) for n in "qkv"], [tensor_info("y", [heads, seq, dim])],
                       [numpy_helper.from_array(np.float32(dim ** -0.5), "scale"),
                        numpy_helper.from_array(mask, "mask")])
    feeds = {n: rng.standard_normal((heads, seq, dim)).astype(np.float32) for n in "qkv"}
    return model, feeds


@pytest.mark.slow
def test_scores_beyond_an_eighth_of_sram_are_computed_a_block_of_queries_at_a_time(rng):
    """2 heads × 512 × 512 fp32 scores are 2 MiB, more than an eighth of the tiny chip's 4 MiB: the attention
    runs in blocks of 64 queries (the largest power of two whose scores take at most a sixteenth, 2 × 64 ×
    512 × 4 = 256 KiB), and the 8 blocks are concatenated, all in one program."""
    model, feeds = attention(2, 512, 16, rng)
    compiled = lpx_tvm.compile(model, config="tiny")
    (sim,) = compiled.simulators.values()
    program = sim.program
    slices = [i for i in program.instructions if i.opcode == Opcode.SLICE]
    assert len(slices) == 8 and {i.dsts[0].shape for i in slices} == {(2, 64, 16)}  # q's rows, per block
    assert sum(i.opcode == Opcode.CONCAT for i in program.instructions) == 1
    softmaxes = [i for i in program.instructions if i.opcode == Opcode.SOFTMAX]
    assert softmaxes and max(i.dsts[0].size for i in softmaxes) <= 2 * 64 * 512
    (out,) = run_on_lpx(compiled, list(feeds.values()), programs=1)
    np.testing.assert_allclose(out, ort_run(model, feeds)[0], rtol=1e-5, atol=1e-5)


def test_short_scores_are_left_whole(rng):
    model, feeds = attention(2, 64, 16, rng)
    compiled = lpx_tvm.compile(model, config="tiny")
    (sim,) = compiled.simulators.values()
    assert not any(i.opcode in (Opcode.SLICE, Opcode.CONCAT) for i in sim.program.instructions)


@pytest.mark.slow
def test_a_2048_token_prefill_compiles_onto_one_chip_and_matches_onnx_runtime():
    """One llama-small block (hidden 256, 8 heads of 32) on a 2,048-token prompt: its 8 × 2048 × 2048 scores
    are 128 MiB in fp32 and stayed on the host; now one program on one tsp chip, no weight streamed."""
    from lpx_tvm.app.models.llama import build_prefill_blocks, get_config

    config = get_config("llama-small").replace(num_layers=1, max_context=2048)
    model = build_prefill_blocks(config, 2048)
    compiled = lpx_tvm.compile(model, config="tsp")
    (sim,) = compiled.simulators.values()
    assert not sim.program.streamed
    x = np.random.default_rng(0).standard_normal((1, 2048, 256)).astype(np.float32)
    (out,) = run_on_lpx(compiled, [x], programs=1)
    ref = ort_run(model, {"hidden_states": x})[0]
    assert np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max()
