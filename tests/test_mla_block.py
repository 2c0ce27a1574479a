"""A DeepSeek-V3 multi-head latent attention block (transformers' ``DeepseekV3Attention``, seeded random weights,
nothing downloaded) exported by ``torch.onnx``, in its plain (prefill) form and its decode form with the
up-projections absorbed (:mod:`lpx_tvm.app.models.mla`), compiled for lpx and checked against ONNX Runtime.

Both forms are one lpx program each. The one op left on the host is the widening of ``position_ids`` (int64, which
lpx does not store) to float32 for the rotary angles: one element a token, before the program. The frontend's
rewrites that put the rest on lpx (the importer's index arithmetic folded, a Gather at a constant index as a slice,
the keys' ScatterND fills as a concat) are checked on small graphs of their own at the end.
"""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import make_model, ort_reference, run_on_lpx, tensor_info
import lpx_tvm

torch = pytest.importorskip("torch", reason="needs the optional dependency torch (lpx-tvm[hf])")
pytest.importorskip("transformers", reason="needs the optional dependency transformers (lpx-tvm[hf])")
pytest.importorskip("onnxscript", reason="needs the optional dependency onnxscript (torch.onnx's exporter)")

from lpx_tvm.app.models.mla import MlaShape, export_mla, mla_decode, mla_prefill, random_mla_attention  # noqa: E402

SHAPE = MlaShape()  # hidden 256, 4 heads, q_lora 64, kv_lora 32, rope 16, nope 32, v 32
PAST = 16  # the prompt's positions in the cache the decode step reads
HOST = {"relax.astype": 1}  # position_ids, int64 ─► float32 (lpx stores no int64)


@pytest.fixture(scope="module")
def block():
    """(the attention, a 17-token hidden state, its positions), drawn once."""
    attention = random_mla_attention(SHAPE, seed=0)
    torch.manual_seed(1)
    return attention, torch.randn(1, PAST + 1, SHAPE.hidden), torch.arange(PAST + 1)[None]


@pytest.fixture(scope="module")
def decode(block):
    """The absorbed decode step exported (fixed shapes: 1 token over 16 cached positions) and its feeds: the
    latent cache the prompt leaves (transformers' prefill), the 17th token at position 16."""
    attention, x, positions = block
    with torch.no_grad():
        _, past = mla_prefill(attention)(x[:, :PAST], positions[:, :PAST])
    args = (x[:, PAST:], positions[:, PAST:], past)
    model = export_mla(mla_decode(attention), args, ["hidden_states", "position_ids", "past_latent"],
                       ["output", "new_latent"])
    return model, {name: a.numpy() for name, a in zip(["hidden_states", "position_ids", "past_latent"], args)}


def test_the_absorbed_decode_step_is_transformers_attention_at_the_last_position(block):
    """The decode form (W_UK in the query, W_UV after the latent context) gives what transformers' plain form
    gives the 17th token over all 17, and the cache entry its prefill writes for that position."""
    attention, x, positions = block
    with torch.no_grad():
        full, cache = mla_prefill(attention)(x, positions)
        out, new = mla_decode(attention)(x[:, PAST:], positions[:, PAST:], cache[:, :PAST])
        moved, _ = mla_decode(attention)(x[:, PAST:], positions[:, PAST:] + 1, cache[:, :PAST])
    assert cache.shape == (1, PAST + 1, SHAPE.latent)
    np.testing.assert_allclose(out.numpy(), full[:, PAST:].numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(new.numpy(), cache[:, PAST:].numpy(), rtol=1e-4, atol=1e-5)
    assert float((moved - out).abs().max()) > 1e-3  # (the position reaches the output: a wrong one would show)


def test_the_absorbed_decode_step_is_one_lpx_program_and_matches_onnx_runtime(decode):
    model, feeds = decode
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("MatMul") == 8 and ops.count("Softmax") == 1  # q_a, q_b, kv_a, W_UK, scores, context, W_UV, o
    compiled = lpx_tvm.compile(model, config="tsp")
    out, new = run_on_lpx(compiled, list(feeds.values()), programs=1, host_ops=HOST)
    want_out, want_new = ort_reference(model, feeds)
    np.testing.assert_allclose(out, want_out, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(new, want_new, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_the_plain_prefill_form_as_transformers_writes_it_is_one_lpx_program_and_matches_onnx_runtime(block):
    """16 positions, causal: the exported graph fills each head's key by two ScatterND (``new_empty`` and two
    ``copy_``) and takes the cache by a Gather; the frontend makes them a concat and a slice, so nothing of it
    stays on the host."""
    attention, x, positions = block
    model = export_mla(mla_prefill(attention), (x[:, :PAST], positions[:, :PAST]), ["hidden_states", "position_ids"],
                       ["output", "latent"])
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("ScatterND") == 2 and ops.count("Gather") == 1
    feeds = {"hidden_states": x[:, :PAST].numpy(), "position_ids": positions[:, :PAST].numpy()}
    compiled = lpx_tvm.compile(model, config="tsp")
    out, latent = run_on_lpx(compiled, list(feeds.values()), programs=1, host_ops=HOST)
    want_out, want_latent = ort_reference(model, feeds)
    np.testing.assert_allclose(out, want_out, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(latent, want_latent, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("chips", [4, 16])
def test_the_absorbed_decode_step_runs_tensor_parallel_on_the_lpx_node_chips_asked(decode, chips):
    """The tensor strategy splits the three projections from the hidden state (q_a, q_b, kv_a) by columns and
    all-gathers them; the latent attention has one K/V head (the cache), which does not divide over 4 chips, so
    every chip runs the attention and o_proj whole (the strategy's rule for K/V heads that do not divide over the
    chips: the heads are not split, and there is no all-reduce)."""
    model, feeds = decode
    compiled = lpx_tvm.compile(model, system="lpx-node", parallel="tensor", chips=chips)
    out, new = run_on_lpx(compiled, list(feeds.values()), programs=1, host_ops=HOST)
    (sim,) = compiled.simulators.values()
    assert len(sim.sims) == chips and sorted(set(sim.program.chips)) == list(range(chips))
    assert sim.program.parallel == "tensor"
    assert f"{chips}-way tensor parallel" in sim.program.notes and "3 all-gathers, 0 all-reduces" in sim.program.notes
    want_out, want_new = ort_reference(model, feeds)
    np.testing.assert_allclose(out, want_out, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(new, want_new, rtol=1e-4, atol=1e-5)


# ---- the frontend's rewrites, on graphs of their own --------------------------------------------------------------


def _ints(name, values):
    return numpy_helper.from_array(np.asarray(values, np.int64), name)


def _scatter_model(rows, into_input: bool):
    """``y = ScatterND(data, rows, u) * 2`` with ``data`` [8, 4] (an input, or 0.5s from ConstantOfShape)."""
    nodes = [helper.make_node("ScatterND", ["data", "rows", "u"], ["s"]),
             helper.make_node("Mul", ["s", "two"], ["y"])]
    inits = [_ints("rows", np.reshape(rows, (-1, 1))), numpy_helper.from_array(np.float32(2), "two")]
    inputs = [tensor_info("u", [len(rows), 4])]
    if into_input:
        inputs.insert(0, tensor_info("data", [8, 4]))
    else:
        inits.append(_ints("shape", [8, 4]))
        nodes.insert(0, helper.make_node("ConstantOfShape", ["shape"], ["data"],
                                         value=helper.make_tensor("v", TensorProto.FLOAT, [1], [0.5])))
    return make_model(nodes, inputs, [tensor_info("y", [8, 4])], inits)


@pytest.mark.parametrize("rows", [[0, 1, 2], [3, 4], [5, 6, 7], [-3, -2]])
@pytest.mark.parametrize("into_input", [True, False])
def test_a_scatter_of_a_run_of_rows_runs_on_lpx(rng, rows, into_input):
    model = _scatter_model(rows, into_input)
    feeds = {"u": rng.standard_normal((len(rows), 4)).astype(np.float32)}
    if into_input:
        feeds = {"data": rng.standard_normal((8, 4)).astype(np.float32), **feeds}
    compiled = lpx_tvm.compile(model, config="tiny")
    (out,) = run_on_lpx(compiled, list(feeds.values()), programs=1)
    np.testing.assert_allclose(out, ort_reference(model, feeds)[0], rtol=1e-6)


def test_a_scatter_of_rows_that_are_not_a_run_stays_on_the_host_and_is_named(rng):
    model = _scatter_model([1, 3], into_input=True)
    feeds = {"data": rng.standard_normal((8, 4)).astype(np.float32), "u": rng.standard_normal((2, 4)).astype(np.float32)}
    compiled = lpx_tvm.compile(model, config="tiny")
    wrap = {"relax.shape_to_tensor": 1, "relax.strided_slice": 1, "relax.less": 1, "relax.add": 1, "relax.where": 1}
    (out,) = run_on_lpx(compiled, list(feeds.values()), programs=1, host_ops={"relax.scatter_nd": 1, **wrap})
    np.testing.assert_allclose(out, ort_reference(model, feeds)[0], rtol=1e-6)


@pytest.mark.parametrize("index, shape", [(0, [2, 5]), (-1, [2, 5]), ([1, 2], [2, 2, 5]), ([2, 0], [2, 2, 5])])
def test_a_gather_at_constant_indices_is_a_slice_on_lpx_where_they_are_a_run(rng, index, shape):
    """``x[:, i]`` and ``x[:, 1:3]`` run on lpx (the importer's wrap of a negative index left unused); indices out
    of order stay a gather on the host, behind that wrap (the dim taken from the shape by a second take)."""
    model = make_model([helper.make_node("Gather", ["x", "i"], ["g"], axis=1),
                        helper.make_node("Mul", ["g", "two"], ["y"])],
                       [tensor_info("x", [2, 4, 5])], [tensor_info("y", shape)],
                       [_ints("i", index), numpy_helper.from_array(np.float32(2), "two")])
    x = rng.standard_normal((2, 4, 5)).astype(np.float32)
    compiled = lpx_tvm.compile(model, config="tiny")
    run = index != [2, 0]
    wrap = {"relax.shape_to_tensor": 1, "relax.less": 1, "relax.add": 1, "relax.where": 1}
    (out,) = run_on_lpx(compiled, [x], programs=1, host_ops=None if run else {"relax.take": 2, **wrap})
    np.testing.assert_allclose(out, ort_reference(model, {"x": x})[0], rtol=1e-6)
