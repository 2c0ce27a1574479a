"""int8 decode steps (issue 50, item 5): a quantised embedding table is gathered as integers and dequantised on
lpx (never dequantised whole on the host, on every call); a move between a DequantizeLinear and a QuantizeLinear
of the same parameters (the rotary embedding's halves, a grouped cache's expansion) runs on the integers; the
quantiser's per-reader copies of one DequantizeLinear are one instruction. Scales are powers of two, so the
expected numbers are exact; the Hugging Face decode steps are checked against ONNX Runtime on the same QDQ
graph."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import lpx_tvm
from conftest import ort_run, run_on_lpx
from lpx_tvm.codegen.graph import Graph
from lpx_tvm.codegen.qfuse import fuse_int8
from lpx_tvm.runtime import total_offloaded_calls


def _dq(g, x, scale, zp, layer="f/dequantize_1"):
    return g.add_node("DEQUANTIZE", [x], g.tensors[x].shape, "float32", layer, scale=scale, zero_point=zp)


def _q(g, x, scale, zp, layer="f/quantize_9"):
    return g.add_node("QUANTIZE", [x], g.tensors[x].shape, "int8", layer, scale=scale, zero_point=zp)


def _logits_scale(model) -> float:
    """The scale of the DequantizeLinear that makes the graph's ``logits``."""
    constants = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    (dq,) = [n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.output[0] == "logits"]
    return float(constants[dq.input[1]])


def _gather_model():
    """ids int64 [1, 2] ─► Gather(DequantizeLinear(table int8 [16, 8], 0.5, 3)) + x ─► Q/DQ(0.25, 0): an int8
    embedding. Its integers lie in -20 .. 20, so every sum is a multiple of 0.25 well inside int8's range."""
    table = (np.arange(16 * 8, dtype=np.int64).reshape(16, 8) % 41 - 20).astype(np.int8)
    nodes = [helper.make_node("DequantizeLinear", ["table_q", "s", "zp"], ["table"]),
             helper.make_node("Gather", ["table", "ids"], ["rows"], axis=0),
             helper.make_node("Add", ["rows", "x"], ["sum"]),
             helper.make_node("QuantizeLinear", ["sum", "s_y", "zp_y"], ["sum_q"]),
             helper.make_node("DequantizeLinear", ["sum_q", "s_y", "zp_y"], ["y"])]
    graph = helper.make_graph(
        nodes, "embedding", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 2]),
                             helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 8])],
        [numpy_helper.from_array(table, "table_q"), numpy_helper.from_array(np.array(0.5, np.float32), "s"),
         numpy_helper.from_array(np.array(3, np.int8), "zp"),
         numpy_helper.from_array(np.array(0.25, np.float32), "s_y"),
         numpy_helper.from_array(np.array(0, np.int8), "zp_y")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), table


def test_an_int8_embedding_is_gathered_as_integers_and_dequantised_on_lpx_not_on_the_host(rng):
    """The host gathers two rows of integers (TVM imports Gather as a wrap of negative ids, ``less``, ``add``,
    ``where``, and a ``take``); lpx dequantises them and adds x, in one call. (Before, the host dequantised the
    whole 16 × 8 table, on every call, then gathered.)"""
    model, table = _gather_model()
    ids = np.array([[3, 11]], np.int64)
    x = (rng.integers(-8, 8, (1, 2, 8)) * 0.25).astype(np.float32)
    compiled = lpx_tvm.compile(model, config="tiny", dtype="int8")
    (y,) = run_on_lpx(compiled, [ids, x], programs=1, host_ops={
        "relax.shape_to_tensor": 1, "relax.less": 1, "relax.add": 1, "relax.where": 1, "relax.take": 2})
    want = (table[ids].astype(np.float32) - 3) * 0.5 + x
    np.testing.assert_array_equal(y, want)
    np.testing.assert_array_equal(y, ort_run(model, {"ids": ids, "x": x})[0])


def test_a_slice_and_a_concat_between_equal_quantisation_parameters_run_on_the_integers():
    """x int8 [1, 16] ─► DQ(0.5, 3) twice (the quantiser's per-reader copies) ─► two halves (SLICE) ─► Q(0.5, 3)
    ─► DQ ─► CONCAT ─► Q(0.5, 3): the moves read and write the integers, with no DEQUANTIZE or QUANTIZE left."""
    g = Graph()
    x = g.add_tensor((1, 16), "int8")
    g.inputs = [x]
    halves = []
    for begin in (8, 0):
        half = g.add_node("SLICE", [_dq(g, x, 0.5, 3.0)], (1, 8), "float32", "f/strided_slice_2",
                          begin=(0, begin), step=(1, 1))
        halves.append(_dq(g, _q(g, half, 0.5, 3.0), 0.5, 3.0))
    joined = g.add_node("CONCAT", halves, (1, 16), "float32", "f/concat_3", axis=1)
    g.outputs = [_q(g, joined, 0.5, 3.0)]
    fuse_int8(g)
    assert [n.kind for n in g.nodes] == ["SLICE", "SLICE", "CONCAT"]
    first, second, concat = g.nodes
    assert first.inputs == second.inputs == [x]
    assert concat.inputs == [first.output, second.output] and concat.output == g.outputs[0]
    assert {str(g.tensors[n.output].dtype) for n in g.nodes} == {"int8"}


def test_a_concat_of_operands_quantised_otherwise_keeps_its_float_form():
    """A cache's past quantised at 0.25 joined with a new slot at 0.5, quantised at 0.5: the past is
    requantised, so the concat stays between its DEQUANTIZEs and QUANTIZE."""
    g = Graph()
    past, new = g.add_tensor((1, 4), "int8"), g.add_tensor((1, 1), "int8")
    g.inputs = [past, new]
    joined = g.add_node("CONCAT", [_dq(g, past, 0.25, 0.0), _dq(g, new, 0.5, 0.0)], (1, 5), "float32",
                        "f/concat_3", axis=1)
    g.outputs = [_q(g, joined, 0.5, 0.0)]
    fuse_int8(g)
    assert [n.kind for n in g.nodes] == ["DEQUANTIZE", "DEQUANTIZE", "CONCAT", "QUANTIZE"]


def test_copies_of_one_dequantise_are_one_instruction_and_other_parameters_keep_their_own():
    """Three DQ(x, 0.5, 3) (one a reader, as the quantiser writes them) and one DQ(x, 0.25, 3), each read by a
    NEG: two DEQUANTIZEs remain, the copies' readers all reading the first."""
    g = Graph()
    x = g.add_tensor((1, 8), "int8")
    g.inputs = [x]
    dqs = [_dq(g, x, 0.5, 3.0), _dq(g, x, 0.5, 3.0), _dq(g, x, 0.5, 3.0), _dq(g, x, 0.25, 3.0)]
    g.outputs = [g.add_node("NEG", [d], (1, 8), "float32", f"f/negative_{k}") for k, d in enumerate(dqs)]
    fuse_int8(g)
    assert [n.kind for n in g.nodes] == ["DEQUANTIZE", "DEQUANTIZE", "NEG", "NEG", "NEG", "NEG"]
    negs = [n for n in g.nodes if n.kind == "NEG"]
    assert [g.base(n.inputs[0]) for n in negs] == [dqs[0], dqs[0], dqs[0], dqs[3]]


@pytest.fixture(scope="module")
def quantised_decoders(tmp_path_factory):
    """arch ─► its random-weight decoder (4 layers) exported by torch.onnx and quantised by ONNX Runtime (QDQ),
    made once."""
    pytest.importorskip("torch", reason="needs the optional dependency torch (lpx-tvm[hf])")
    pytest.importorskip("transformers", reason="needs the optional dependency transformers (lpx-tvm[hf])")
    pytest.importorskip("onnxscript", reason="needs the optional dependency onnxscript (torch.onnx's exporter)")
    from lpx_tvm.app.llm.hf_decoder import HFDecoder, export_decoder, random_causal_lm

    made = {}

    def get(arch):
        if arch not in made:
            folder = tmp_path_factory.mktemp(arch)
            export_decoder(random_causal_lm(arch, layers=4), folder)
            decoder = HFDecoder(folder)
            fp32 = decoder.graph.SerializeToString()
            decoder.quantize(seed=0)
            made[arch] = onnx.ModelProto.FromString(decoder.graph.SerializeToString()), folder, fp32
        return made[arch]
    return get


def _step_cycles(compiled, decoder) -> int:
    """The cycles of one decode step (one token over a past of 16), as the simulator counts them."""
    feeds = decoder.decode_feeds(token=42, position=6, context=16)
    blank = {n: np.zeros(decoder.cache_shape(16), np.float32) for n in decoder.cache_names}
    compiled(**feeds, **blank)
    return sum(sim.stats.cycles for sim in compiled.simulators.values())


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_an_int8_hugging_face_decode_step_dequantises_no_weight_on_the_host_and_matches_onnx_runtime(
        quantised_decoders, arch):
    """One token over a past of 16 (6 filled), in one lpx call. The host keeps only the mask and position
    arithmetic and the embedding's gather (its table float: the decoder is quantised at its products), no
    DequantizeLinear. ONNX Runtime runs the same QDQ graph
    (edited as lpx's: each cache's new slot as an output): the logits agree to within one step of their
    QuantizeLinear's scale, almost everywhere."""
    from lpx_tvm.app.llm.hf_decoder import HFDecoder

    qdq, folder, _ = quantised_decoders(arch)
    decoder = HFDecoder(folder)
    decoder.graph = onnx.ModelProto.FromString(qdq.SerializeToString())
    _, (graph, shapes) = decoder.graphs(prompt_len=6, context=16)
    compiled = lpx_tvm.compile(graph, input_shapes=shapes, dtype="int8", state=decoder.cache_names)
    assert compiled.report.host_ops["relax.dequantize"] == 0, compiled.report.summary()
    rng = np.random.default_rng(7)
    past = {n: (0.5 * rng.standard_normal(decoder.cache_shape(16))).astype(np.float32) for n in decoder.cache_names}
    for n in decoder.cache_names:
        compiled.write_state(n, past[n])
    feeds = decoder.decode_feeds(token=42, position=6, context=16)
    blank = {n: np.zeros(decoder.cache_shape(16), np.float32) for n in decoder.cache_names}
    before = total_offloaded_calls()
    got = dict(zip(decoder.outputs, compiled(**feeds, **blank)))
    assert total_offloaded_calls() - before == 1
    want = dict(zip(decoder.outputs, ort_run(graph, {**feeds, **past})))
    logit_scale = _logits_scale(graph)
    steps = np.abs(got["logits"] - want["logits"]) / logit_scale
    assert np.mean(steps <= 1.01) >= 0.99, np.sort(steps.ravel())[-8:]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_an_int8_hugging_face_decode_step_is_quantised_at_its_products_and_is_no_slower_than_fp16(
        quantised_decoders, arch):
    """The quantiser (lpx_tvm.quantize) quantises a decode step's products: every activation it dequantises
    is a MatMul's operand, and only the logits stay quantised; nothing else is wrapped in QuantizeLinear /
    DequantizeLinear. Compiled side by side, the int8 step takes no more cycles than the fp16 one (before:
    7,604 against 4,878 on Llama, 7,752 on Qwen2: a QDQ pair around every vector op of a latency-bound chain).
    Cycles are deterministic: this is a count, not a timing."""
    from lpx_tvm.app.llm.hf_decoder import HFDecoder

    qdq, folder, fp32 = quantised_decoders(arch)
    readers = {}
    for node in qdq.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node.op_type)
    weights = {i.name for i in qdq.graph.initializer}
    activations = [n for n in qdq.graph.node if n.op_type == "DequantizeLinear" and n.input[0] not in weights]
    assert activations and all(set(readers.get(n.output[0], [])) <= {"MatMul"} for n in activations
                               if n.output[0] != "logits")
    assert [n.output[0] for n in activations if n.output[0] == "logits"] == ["logits"]

    cycles = {}
    for dtype, graph in (("fp16", onnx.ModelProto.FromString(fp32)), ("int8", qdq)):
        decoder = HFDecoder(folder)
        decoder.graph = onnx.ModelProto.FromString(graph.SerializeToString())
        _, (lpx_graph, shapes) = decoder.graphs(prompt_len=6, context=16)
        compiled = lpx_tvm.compile(lpx_graph, input_shapes=shapes, dtype=dtype, state=decoder.cache_names)
        cycles[dtype] = _step_cycles(compiled, decoder)
    assert cycles["int8"] <= cycles["fp16"], cycles


def test_a_model_quantised_at_its_products_runs_them_as_int8_with_float_results_and_matches_onnx_runtime(rng):
    """x [1, 16] ─► MatMul ─► SiLU ─► MatMul ─► + x ─► MatMul ─► y, quantised at its products only (ONNX
    Runtime's pre-processing makes the second product and the add a Gemm): each product runs on int8 operands;
    the first two dequantise in their EPILOGUEs (the second adding x there, as its bias), the third's result is
    the graph output and keeps its QuantizeLinear (requantised in its EPILOGUE, widened on the host). The lpx
    program quantises the second's and the third's operands (x's is the host's) and dequantises only x (the
    residual the pre-processing gives the Gemm is x's DequantizeLinear); it matches ONNX Runtime on the same
    QDQ model to the output's step."""
    from lpx_tvm.runtime_sim import Opcode

    weights = [(rng.standard_normal(shape) * 0.3).astype(np.float32) for shape in ((16, 32), (32, 16), (16, 8))]
    nodes = [helper.make_node("MatMul", ["x", "w0"], ["h"]), helper.make_node("Sigmoid", ["h"], ["s"]),
             helper.make_node("Mul", ["h", "s"], ["a"]), helper.make_node("MatMul", ["a", "w1"], ["d"]),
             helper.make_node("Add", ["d", "x"], ["r"]), helper.make_node("MatMul", ["r", "w2"], ["y"])]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])],
                              [numpy_helper.from_array(w, f"w{k}") for k, w in enumerate(weights)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    qdq = lpx_tvm.quantize(model, [{"x": rng.standard_normal((1, 16)).astype(np.float32)} for _ in range(4)],
                           products_only=True)
    assert sum(n.op_type == "QuantizeLinear" for n in qdq.graph.node) == 4  # 3 product inputs and the output
    compiled = lpx_tvm.compile(qdq, config="tiny", dtype="int8")
    (sim,) = compiled.simulators.values()
    opcodes = [i.opcode for i in sim.program.instructions]
    assert opcodes.count(Opcode.DEQUANTIZE) == 1 and opcodes.count(Opcode.QUANTIZE) == 2, opcodes
    x = rng.standard_normal((1, 16)).astype(np.float32)
    (y,) = run_on_lpx(compiled, [x], programs=1)
    step = float(numpy_helper.to_array(next(i for i in qdq.graph.initializer if i.name.startswith("y_scale"))))
    assert np.abs(y - ort_run(qdq, {"x": x})[0]).max() <= step * 1.01
