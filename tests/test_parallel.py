"""Models on systems of chips: pipeline and tensor parallel against ONNX Runtime and the single-chip run, every
transfer scheduled at both ends and checked by the system simulator (predicted cycles = simulated cycles)."""

import numpy as np
import onnxruntime as ort
import pytest

from conftest import mlp_model
import lpx_tvm
from lpx_tvm.app.models import llama
from lpx_tvm.app.tools.zoo import ZOO
from lpx_tvm.codegen import SystemCompileError
from lpx_tvm.runtime import total_offloaded_calls
from lpx_tvm.runtime_sim import decode, reference_arithmetic
from lpx_tvm.runtime_sim.system_sim import SystemSimulator


@pytest.fixture(scope="module")
def bert():
    entry = ZOO["bert_encoder"]
    model = entry.load()
    feeds = entry.feeds(model)
    reference = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    single = lpx_tvm.compile(model, config="tsp")
    args = [feeds[n] for n, _, _ in single.input_signature]
    with reference_arithmetic():  # tile by tile: the same tiles in the same order give the same bits
        return model, args, reference, single(*args)


def _run_on_system(model, args, **options):
    compiled = lpx_tvm.compile(model, **options)
    calls = total_offloaded_calls()
    outputs = compiled(*args)
    assert total_offloaded_calls() > calls  # it really ran on the (simulated) chips
    (sim,) = [s for s in compiled.simulators.values() if isinstance(s, SystemSimulator)]
    return outputs, sim


def _tensor_parallel_matches_ort(model, x, system):
    """Run a one-input model tensor parallel on ``system``, check it against ONNX Runtime; the system sim."""
    reference = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {model.graph.input[0].name: x})[0]
    (out,), sim = _run_on_system(model, [x], system=system, parallel="tensor")
    np.testing.assert_allclose(out, reference, rtol=1e-5, atol=1e-5)
    return sim


@pytest.mark.parametrize("chips", [2, 4, 8])
@pytest.mark.slow
def test_bert_pipeline_equals_the_single_chip_run(bert, chips):
    model, args, reference, single = bert
    with reference_arithmetic():  # (the fast path merges a chip's tiles as its own program allows)
        outputs, sim = _run_on_system(model, args, system="tsp-node", parallel="pipeline", chips=chips)
    assert len(sim.sims) == chips and sim.program.parallel == "pipeline"
    np.testing.assert_array_equal(outputs[0], single[0])
    np.testing.assert_allclose(outputs[0], reference[0], rtol=1e-4, atol=1e-4)
    if chips in (2, 4):  # cut at layer boundaries: each of the chips - 1 links carries the hidden state alone
        hidden_state = 1 * 64 * 256 * 4  # [1, seq 64, hidden 256] fp32
        assert sorted(link["bytes"] for link in sim.stats.links.values()) == [hidden_state] * (chips - 1)


@pytest.mark.parametrize("chips", [2, 4, 8])
@pytest.mark.slow
def test_bert_tensor_parallel_agrees_with_onnx_runtime(bert, chips):
    model, args, reference, single = bert
    outputs, sim = _run_on_system(model, args, system="tsp-node", parallel="tensor", chips=chips)
    assert sim.program.parallel == "tensor"
    # Megatron's split: attention by heads (4 of them) and the MLP, one all-reduce each, where heads divide
    assert ("0 all-gathers, 4 all-reduces" in sim.program.notes) == (chips in (2, 4))
    # each chip holds 1/chips of every split weight: the chips' weights add up to less than chips × one chip's
    held = [sum(c.ref.nbytes for c in chip_sim.program.constants) for chip_sim in sim.sims]
    one_chip = sum(c.ref.nbytes for blob in lpx_tvm.compile(model, config="tsp").programs.values()
                   for c in decode(blob).constants)
    assert max(held) < one_chip and sum(held) < chips * one_chip
    np.testing.assert_allclose(outputs[0], reference[0], rtol=1e-4, atol=1e-4)
    # fp32 sums of a narrower product are blocked differently by numpy's BLAS: equal to rounding, not bitwise
    np.testing.assert_allclose(outputs[0], single[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("parallel", ["pipeline", "tensor"])
@pytest.mark.parametrize("system", ["tiny-2", "tiny-4", "tiny-8"])
@pytest.mark.slow
def test_the_llama_decoder_on_a_ring_of_tiny_chips(system, parallel):
    config = llama.PRESETS["llama-tiny"]
    model = llama.build_decode(config)
    cache = llama.initial_cache(config)
    rng = np.random.default_rng(5)
    for name in cache:  # a cache with something in it, and a mask that lets the first 9 slots count
        cache[name][...] = rng.standard_normal(cache[name].shape).astype(np.float32) * 0.5
    feeds = llama.decode_feeds(config, 17, 9, cache)
    reference = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    names = [i.name for i in model.graph.input]
    outputs, sim = _run_on_system(model, [feeds[n] for n in names], system=system, parallel=parallel)
    assert len(sim.sims) == int(system.split("-")[1])
    for got, want in zip(outputs, reference):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_auto_says_what_it_chose_and_why(bert):
    model, args, reference, _ = bert
    outputs, sim = _run_on_system(model, args, system="tsp-node", parallel="auto", chips=2)
    assert sim.program.notes.startswith(f"auto chose {sim.program.parallel}")
    assert "pipeline" in sim.program.notes and "tensor" in sim.program.notes and "cycles" in sim.program.notes


def test_a_layer_too_big_for_any_chip_is_named(rng):
    from conftest import make_model, tensor_info, weights
    from onnx import helper

    model = make_model([helper.make_node("MatMul", ["x", "w"], ["y"])], [tensor_info("x", [4, 1024])],
                       [tensor_info("y", [4, 1024])], [weights(rng, "w", (1024, 1024))])  # 4 MiB of weights
    with pytest.raises(SystemCompileError, match="4194304 bytes of weights, more than a chip's budget of 2097152"):
        lpx_tvm.compile(model, system="tiny-2", parallel="pipeline")


@pytest.mark.slow
def test_a_pipeline_spreads_the_blocks_over_its_chips():
    """llama-small's 4 blocks on 4 chips: each chip gets matrix work and about a block of weights, not a few
    norm scalars on three chips and the whole model on the fourth."""
    config = llama.PRESETS["llama-small"]
    model = llama.build_decode(config)
    compiled = lpx_tvm.compile(model, system="tsp-node", parallel="pipeline", chips=4)
    (sim,) = [s for s in compiled.simulators.values() if isinstance(s, SystemSimulator)]
    h, kv, f = config.hidden_size, config.num_kv_heads * config.hidden_size // config.num_heads, config.intermediate_size
    block_weights = 4 * (2 * h * h + 2 * h * kv + 3 * h * f)  # fp32 q, o, k, v, gate, up, down
    for k, program in enumerate(sim.program.programs):
        assert any(ins.opcode.name == "MATMUL" for ins in program.instructions)
        weights = sum(c.ref.nbytes for c in program.constants)
        assert 0.5 * block_weights <= weights <= 2 * block_weights + 4 * h * config.vocab_size
        sent = sum(ins.srcs[0].nbytes for ins in program.instructions if ins.opcode.name == "SEND")
        # cut between blocks: only the fp32 hidden state and the mask over the cache and the new token cross
        assert sent == (4 * h + 4 * (config.max_context + 1) if k < 3 else 0)


def test_a_product_pair_splits_columns_then_rows_and_sums_once(rng):
    """Megatron's MLP: the first Gemm's columns and the second's rows split over the chips, the ReLU between
    runs on each chip's slice, and the partial sums meet in one ring all-reduce: no all-gather at all."""
    sim = _tensor_parallel_matches_ort(mlp_model(), rng.standard_normal((4, 64)).astype(np.float32), "tiny-2")
    assert "0 all-gathers, 1 all-reduces" in sim.program.notes
    # each chip holds half of each weight: 32x64/2 + 10x32/2 floats, and the first bias's half
    for chip in sim.program.programs:
        weights = sum(c.ref.nbytes for c in chip.constants)
        assert 4 * (32 * 64 // 2 + 10 * 32 // 2 + 16) <= weights <= 4 * (32 * 64 // 2 + 10 * 32 // 2 + 16 + 10)


@pytest.mark.parametrize("shape", ["chain", "residual"])
def test_row_split_regions_do_not_overlap_or_read_their_own_slices(shape):
    """relu(x·W1)·W2·W3: W2's product is already split by rows, so it cannot also start W3's region.
    t = relu(x·W1); (t + t·W2)·W3: W2 would read t, which exists only as slices. Both once failed."""
    from conftest import make_model, tensor_info
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(0)
    w = {n: rng.standard_normal((16, 16)).astype(np.float32) * 0.3 for n in ("w1", "w2", "w3")}
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["a"]), helper.make_node("Relu", ["a"], ["t1"]),
             helper.make_node("MatMul", ["t1", "w2"], ["t2"])]
    if shape == "chain":
        nodes.append(helper.make_node("MatMul", ["t2", "w3"], ["y"]))
    else:
        nodes += [helper.make_node("Add", ["t1", "t2"], ["h"]), helper.make_node("MatMul", ["h", "w3"], ["y"])]
    model = make_model(nodes, [tensor_info("x", [4, 16])], [tensor_info("y", [4, 16])],
                       [numpy_helper.from_array(v, n) for n, v in w.items()])
    x = rng.standard_normal((4, 16)).astype(np.float32)
    t1 = np.maximum(x @ w["w1"], 0)
    want = t1 @ w["w2"] @ w["w3"] if shape == "chain" else (t1 + t1 @ w["w2"]) @ w["w3"]
    (out,), _ = _run_on_system(model, [x], system="tiny-2", parallel="tensor")
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_columns_that_do_not_split_evenly_are_padded_and_narrowed(rng):
    """1001 output columns over 4 chips: 251 a chip, the last chip's padded with 3 zero columns, all-gathered
    and the real 1001 copied out (an LM head's vocabulary rarely divides by the chip count)."""
    from conftest import make_model, tensor_info, weights
    from onnx import helper

    model = make_model([helper.make_node("MatMul", ["x", "w"], ["y"])], [tensor_info("x", [4, 64])],
                       [tensor_info("y", [4, 1001])], [weights(rng, "w", (64, 1001))])
    sim = _tensor_parallel_matches_ort(model, rng.standard_normal((4, 64)).astype(np.float32), "tiny-4")
    assert "1 all-gathers" in sim.program.notes
    for chip in sim.program.programs:  # a quarter of the weight each, padded: 64 x 251 floats
        assert max(c.ref.nbytes for c in chip.constants) == 64 * 251 * 4


def test_a_split_that_would_leave_a_chip_only_padding_is_not_made(rng):
    """9 columns over 8 chips would give chips 5-7 nothing but zero columns; they would run ahead of the
    others and break the ring's lockstep at the next collective. That product stays whole."""
    from conftest import make_model, tensor_info, weights
    from onnx import helper

    model = make_model([helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("MatMul", ["h", "w2"], ["y"])],
                       [tensor_info("x", [1, 16])], [tensor_info("y", [1, 16])],
                       [weights(rng, "w1", (16, 9)), weights(rng, "w2", (9, 16))])
    sim = _tensor_parallel_matches_ort(model, rng.standard_normal((1, 16)).astype(np.float32), "tiny-8")
    # the first product whole on every chip (no gather); the second split, each chip storing its 2 columns
    assert "0 all-gathers, 0 all-reduces" in sim.program.notes
    assert sim.program.outputs[0] == tuple((c, 0, 1, 2 * c, 2 * c + 2) for c in range(8))


def test_a_consumer_of_a_few_gathered_heads_runs_tensor_parallel_on_one_schedule(rng):
    """A consumer reading a few heads of a gathered tensor needs, on each chip, blocks that arrive at other ring
    steps (each chip's own block is in first). The chips used to be scheduled each on its own, and parted
    ("the chips' schedules part"); now they share one schedule that honours every chip's dependences."""
    from conftest import make_model, tensor_info, weights
    from onnx import helper, numpy_helper

    shape = numpy_helper.from_array(np.array([1, 4, 1, 16], np.int64), "shape")
    model = make_model([helper.make_node("MatMul", ["x", "wq"], ["q"]), helper.make_node("Reshape", ["q", "shape"], ["q4"]),
                        helper.make_node("MatMul", ["q4", "r"], ["qr"]), helper.make_node("Add", ["q4", "qr"], ["y"])],
                       [tensor_info("x", [1, 64])], [tensor_info("y", [1, 4, 1, 16])],
                       [weights(rng, "wq", (64, 64)), weights(rng, "r", (16, 16)), shape])
    x = rng.standard_normal((1, 64)).astype(np.float32)
    (out,), sim = _run_on_system(model, [x], system="tiny-8", parallel="tensor")
    assert sim.program.parallel == "tensor" and len(sim.sims) == 8
    # one schedule: every chip issues its k-th instruction at the same cycle
    cycles = [[ins.cycle for ins in s.program.instructions if ins.opcode.name != "STORE"] for s in sim.sims]
    assert all(c == cycles[0] for c in cycles[1:])
    reference = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0]
    np.testing.assert_allclose(out, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("read_outside", [False, True])
def test_a_model_input_inside_a_megatron_pair_reaches_each_chip_as_its_slice(rng, read_outside):
    """``c`` (a cache, say) scales a column-split product's heads before a row-split one: each chip is given
    its heads of it. Read also by an op outside the pair, it must reach every chip whole, and the pair then
    all-gathers instead."""
    from conftest import make_model, tensor_info, weights
    from onnx import helper, numpy_helper

    heads = numpy_helper.from_array(np.array([1, 4, 8], np.int64), "heads")
    flat = numpy_helper.from_array(np.array([1, 32], np.int64), "flat")
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Reshape", ["h", "heads"], ["h4"]),
             helper.make_node("Mul", ["h4", "c"], ["m"]), helper.make_node("Reshape", ["m", "flat"], ["m2"]),
             helper.make_node("MatMul", ["m2", "w2"], ["y"])]
    outputs = [tensor_info("y", [1, 32])]
    if read_outside:  # y + c, flattened: c read after the pair too
        nodes += [helper.make_node("Reshape", ["c", "flat"], ["c2"]), helper.make_node("Add", ["y", "c2"], ["r"])]
        outputs = [tensor_info("r", [1, 32])]
    model = make_model(nodes, [tensor_info("x", [1, 32]), tensor_info("c", [1, 4, 8])], outputs,
                       [weights(rng, "w1", (32, 32)), weights(rng, "w2", (32, 32)), heads, flat])
    x = rng.standard_normal((1, 32)).astype(np.float32)
    c = rng.standard_normal((1, 4, 8)).astype(np.float32)
    reference = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x, "c": c})
    got, sim = _run_on_system(model, [x, c], system="tiny-2", parallel="tensor")
    for a, b in zip(got, reference):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    split = sim.program.inputs[1] == ((0, 1, 1, 0, 2), (1, 1, 1, 2, 4))
    assert split == (not read_outside)
    assert ("1 all-reduces" in sim.program.notes) == (not read_outside)


def _residual_pair():
    """h = x W1, z = h + x, y = z W2: x reaches the pair whole (its first product reads it whole)."""
    from onnx import helper
    return [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Add", ["h", "x"], ["z"]),
            helper.make_node("MatMul", ["z", "w2"], ["y"])], ["y"]


def _pair_with_an_output_and_its_reshape():
    """m (made on the slices inside the pair) is a model output, and so is a reshape of it."""
    from onnx import helper
    return [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Mul", ["h", "h"], ["m"]),
            helper.make_node("Reshape", ["m", "heads"], ["m2"]), helper.make_node("MatMul", ["m", "w2"], ["y"])], \
        ["y", "m", "m2"]


@pytest.mark.parametrize("build", [_residual_pair, _pair_with_an_output_and_its_reshape])
def test_megatron_pairs_whose_tensors_are_read_whole_elsewhere_still_agree(rng, build):
    from conftest import make_model, tensor_info, weights
    from onnx import numpy_helper

    nodes, names = build()
    shapes = {"y": [1, 32], "m": [1, 32], "m2": [1, 4, 8]}
    model = make_model(nodes, [tensor_info("x", [1, 32])], [tensor_info(n, shapes[n]) for n in names],
                       [weights(rng, "w1", (32, 32)), weights(rng, "w2", (32, 32)),
                        numpy_helper.from_array(np.array([1, 4, 8], np.int64), "heads")])
    x = rng.standard_normal((1, 32)).astype(np.float32)
    reference = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x})
    got, _ = _run_on_system(model, [x], system="tiny-2", parallel="tensor")
    for a, b in zip(got, reference):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
