"""Reduced precision on lpx: fp16 and bf16 storage with fp32 accumulation, and clear errors for what a chip lacks."""

import dataclasses
import importlib.util
import json

import numpy as np
import pytest

import lpx_tvm
from lpx_tvm.runtime_sim import DType, Opcode, decode
from lpx_tvm.runtime_sim.config import load_config
from lpx_tvm.app.tools.zoo import ZOO, run_model
from lpx_tvm.runtime import total_offloaded_calls
from conftest import mlp_model, ort_run, run_on_lpx

NO_RAPIDOCR = importlib.util.find_spec("rapidocr_onnxruntime") is None


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("name", [
    "squeezenet", "bert_encoder", "gpt2_decoder",
    pytest.param("ppocr_cls", marks=pytest.mark.skipif(
        NO_RAPIDOCR, reason="optional rapidocr-onnxruntime (the models extra) is not installed")),
])
@pytest.mark.slow
def test_one_model_per_family_against_ort_fp32(name, dtype):
    record = run_model(ZOO[name], config="tsp", llvm=False, repeat=1, dtype=dtype)
    print(f"\n{name} {dtype}: cosine {record['cosine']:.6f}, max rel err {record['max_rel_err']:.2e}")
    assert record["ok"] and record["cosine"] >= 0.999, record.get("error")
    assert record["lpx_calls"] == record["lpx_subgraphs"] >= 1 and record["dtype"] == dtype


@pytest.mark.parametrize("dtype, storage", [("fp16", DType.F16), ("bf16", DType.BF16)])
def test_storage_is_reduced_and_the_link_carries_it(rng, dtype, storage):
    """The caller passes and takes fp32; the host rounds the [4, 64] input to the storage type before the
    link (4·64·2 = 512 bytes cross, not 1,024) and widens the [4, 10] output after it; no CAST runs on lpx."""
    compiled = lpx_tvm.compile(mlp_model(), config="tiny", dtype=dtype)
    (program,) = (decode(blob) for blob in compiled.programs.values())
    loads = [i.dsts[0] for i in program.instructions if i.opcode == Opcode.LOAD]
    stores = [i.srcs[0] for i in program.instructions if i.opcode == Opcode.STORE]
    assert {r.dtype for r in loads + stores} == {storage} and sum(r.nbytes for r in loads) == 512
    assert program.host_converted == ((0, 1.0, 0),) and program.widened_outputs == ((0, 1.0, 0),)
    assert not any(i.opcode == Opcode.CAST for i in program.instructions)
    assert {i.srcs[0].dtype for i in program.instructions if i.opcode == Opcode.MATMUL} == {storage}
    x = rng.standard_normal((4, 64)).astype(np.float32)
    (out,) = run_on_lpx(compiled, [x], programs=1)  # the one program ran on lpx, nothing on the host
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, ort_run(mlp_model(), {"x": x})[0], rtol=0.05, atol=0.05)


@pytest.mark.slow
def test_cycles_fall_with_the_matrix_rate():
    """squeezenet's one lpx program, nothing left on the host in either dtype (a layer fallen back to the
    host would take its cycles with it), is faster in fp16 (4 matrix passes a row) than in fp32 (12)."""
    model = ZOO["squeezenet"].load()
    compiled = {d: lpx_tvm.compile(model, dtype=d) for d in ("fp32", "fp16")}
    for d, c in compiled.items():
        assert c.report.lpx_functions == len(c.simulators) == 1, (d, c.report.summary())
        assert not c.report.host_ops, (d, c.report.summary())
    cycles = {d: sum(s.stats.cycles for s in c.simulators.values()) for d, c in compiled.items()}
    assert cycles["fp16"] < cycles["fp32"]


def test_dtype_the_chip_lacks_is_a_clear_error(tmp_path):
    preset = dataclasses.asdict(load_config("tiny"))
    preset["mxm_passes"] = {k: v for k, v in preset["mxm_passes"].items() if k != "bf16"}
    preset["name"] = "no_bf16"
    path = tmp_path / "no_bf16.json"
    path.write_text(json.dumps(preset))
    with pytest.raises(ValueError, match="chip config 'no_bf16' has no bf16 matrix unit"):
        lpx_tvm.compile(mlp_model(), config=str(path), dtype="bf16")
    with pytest.raises(ValueError, match="dtype must be one of fp32, fp16, bf16, fp8, int8"):
        lpx_tvm.compile(mlp_model(), config="tiny", dtype="fp4")


def _int8_programs(compiled) -> list:
    return [i for blob in compiled.programs.values() for i in decode(blob).instructions
            if i.opcode == Opcode.MATMUL and i.srcs[0].dtype == DType.I8]


@pytest.mark.slow
def test_int8_cnn_matches_ort_on_the_same_qdq_model():
    import onnxruntime as ort

    from lpx_tvm.app.tools.zoo import output_step, quantized_for_zoo, seeded_inputs

    record = run_model(ZOO["squeezenet"], config="tsp", llvm=False, repeat=1, dtype="int8")
    assert record["ok"], record.get("error")
    assert record["lpx_calls"] == record["lpx_subgraphs"] == 1
    qdq = quantized_for_zoo(ZOO["squeezenet"], ZOO["squeezenet"].load())
    compiled = lpx_tvm.compile(qdq, dtype="int8")
    assert compiled.report.lpx_functions == 1, compiled.report.summary()
    assert not compiled.report.host_ops, compiled.report.summary()
    assert len(_int8_programs(compiled)) >= 20
    session = ort.InferenceSession(qdq.SerializeToString(), providers=["CPUExecutionProvider"])
    step = output_step(qdq)
    for seed in (11, 12, 13):  # inputs the calibration never saw
        feeds = seeded_inputs(qdq, seed)
        calls = total_offloaded_calls()
        out, ref = compiled(*feeds.values())[0], session.run(None, feeds)[0]
        assert total_offloaded_calls() - calls == 1  # its one program ran on lpx
        within = np.mean(np.rint(np.abs(out - ref) / step) <= 1)
        print(f"\nsqueezenet int8, input {seed}: {100 * within:.1f}% of logits within one step of ONNX Runtime")
        assert within >= 0.99 and out.argmax() == ref.argmax()


def test_int8_runs_int8_matmuls_and_softmax_in_float_between_its_dequantise_and_quantise(rng):
    """Softmax has no int8 kernel: it runs on lpx's vector unit in float, between the QDQ model's DQ and Q
    (it fell back to the host, which cut the model into two programs)."""
    from onnx import helper

    from conftest import make_model, ort_run, run_on_lpx, tensor_info, weights

    model = make_model([helper.make_node("Gemm", ["x", "w", "b"], ["h"], transB=1),
                        helper.make_node("Relu", ["h"], ["r"]),
                        helper.make_node("Gemm", ["r", "v"], ["z"], transB=1),
                        helper.make_node("Softmax", ["z"], ["y"], axis=-1)],
                       [tensor_info("x", [4, 64])], [tensor_info("y", [4, 10])],
                       [weights(rng, "w", (32, 64)), weights(rng, "b", (32,)), weights(rng, "v", (10, 32))])
    calibration = [{"x": rng.standard_normal((4, 64)).astype(np.float32)} for _ in range(4)]
    qdq = lpx_tvm.quantize(model, calibration)
    compiled = lpx_tvm.compile(qdq, config="tiny", dtype="int8")
    int8 = _int8_programs(compiled)
    programs = [decode(blob) for blob in compiled.programs.values()]
    layers = {p.layer_names[i.layer] for p in programs for i in p.instructions if i.opcode == Opcode.MATMUL}
    # both Gemms run int8 x int8 -> int32 on the matrix planes, and no MATMUL is left in float
    assert len(layers) == 2 and len(int8) == sum(i.opcode == Opcode.MATMUL for p in programs for i in p.instructions)
    assert sum(i.opcode == Opcode.SOFTMAX for p in programs for i in p.instructions) == 1
    x = rng.standard_normal((4, 64)).astype(np.float32)
    (out,) = run_on_lpx(compiled, [x], programs=1)
    np.testing.assert_allclose(out, ort_run(qdq, {"x": x})[0], atol=2 / 256)


def test_int8_of_a_float_model_is_a_clear_error():
    with pytest.raises(ValueError, match="needs a QDQ-quantised model"):
        lpx_tvm.compile(mlp_model(), config="tiny", dtype="int8")


@pytest.mark.slow
def test_int8_weight_bigger_than_sram_streams_as_int8(rng):
    from onnx import helper

    from conftest import make_model, ort_run, run_on_lpx, tensor_info, weights

    # 1024 x 4608 int8 = 4.5 MiB, more than the tiny chip's 4 MiB of SRAM: streamed, still int8
    model = make_model([helper.make_node("Gemm", ["x", "w", "b"], ["y"], transB=1)],
                       [tensor_info("x", [1, 4608])], [tensor_info("y", [1, 1024])],
                       [weights(rng, "w", (1024, 4608), 0.02), weights(rng, "b", (1024,), 0.1)])
    qdq = lpx_tvm.quantize(model, [{"x": rng.standard_normal((1, 4608)).astype(np.float32)} for _ in range(2)])
    compiled = lpx_tvm.compile(qdq, config="tiny", dtype="int8")
    (program,) = (decode(blob) for blob in compiled.programs.values())
    assert any(i.opcode == Opcode.STREAM for i in program.instructions)
    assert {w.host.dtype for w in program.streamed} == {DType.I8}
    assert len(_int8_programs(compiled)) >= 2
    x = rng.standard_normal((1, 4608)).astype(np.float32)
    (out,) = run_on_lpx(compiled, [x], programs=1)  # one lpx call, nothing on the host
    ref = ort_run(qdq, {"x": x})[0]
    from lpx_tvm.app.tools.zoo import output_step

    assert np.mean(np.rint(np.abs(out - ref) / output_step(qdq)) <= 1) >= 0.99


def test_int8_depthwise_conv_runs_as_int8_dwconv(rng):
    from onnx import helper

    from conftest import make_model, ort_run, run_on_lpx, tensor_info, weights
    from lpx_tvm.app.tools.zoo import output_step

    model = make_model([helper.make_node("Conv", ["x", "w", "b"], ["c"], group=16, pads=[2, 2, 2, 2]),
                        helper.make_node("Relu", ["c"], ["r"]),
                        helper.make_node("Conv", ["r", "p"], ["y"])],
                       [tensor_info("x", [1, 16, 12, 20])], [tensor_info("y", [1, 8, 12, 20])],
                       [weights(rng, "w", (16, 1, 5, 5)), weights(rng, "b", (16,)), weights(rng, "p", (8, 16, 1, 1))])
    feeds = [{"x": rng.standard_normal((1, 16, 12, 20)).astype(np.float32)} for _ in range(3)]
    qdq = lpx_tvm.quantize(model, feeds)
    compiled = lpx_tvm.compile(qdq, config="tiny", dtype="int8")
    (program,) = (decode(blob) for blob in compiled.programs.values())
    kinds = {(i.opcode, i.srcs[0].dtype) for i in program.instructions if i.opcode in (Opcode.DWCONV, Opcode.MATMUL)}
    assert kinds == {(Opcode.DWCONV, DType.I8), (Opcode.MATMUL, DType.I8)}
    x = feeds[0]["x"]
    (out,) = run_on_lpx(compiled, [x], programs=1)  # one lpx call, nothing on the host
    steps = np.rint(np.abs(out - ort_run(qdq, {"x": x})[0]) / output_step(qdq))
    assert np.mean(steps <= 1) >= 0.99


def test_int8_weight_with_a_nonzero_zero_point(rng):
    """A hand-built QDQ conv whose per-tensor weight zero point is 5 runs as int8 and matches ORT's QLinearConv."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from conftest import ort_run, run_on_lpx

    def scalar(name, value, dtype):
        return numpy_helper.from_array(np.array(value, dtype), name)

    inits = [scalar("sx", 0.05, np.float32), scalar("zx", -3, np.int8), scalar("sw", 0.01, np.float32),
             scalar("zw", 5, np.int8), scalar("sy", 0.2, np.float32), scalar("zy", 7, np.int8),
             numpy_helper.from_array(rng.integers(-100, 100, (6, 3, 3, 3)).astype(np.int8), "wq")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xd"]),
             helper.make_node("DequantizeLinear", ["wq", "sw", "zw"], ["wd"]),
             helper.make_node("Conv", ["xd", "wd"], ["c"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("QuantizeLinear", ["c", "sy", "zy"], ["yq"]),
             helper.make_node("DequantizeLinear", ["yq", "sy", "zy"], ["y"])]
    graph = helper.make_graph(nodes, "qconv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 9, 9])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6, 5, 5])], inits)
    qdq = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    onnx.checker.check_model(qdq)
    compiled = lpx_tvm.compile(qdq, config="tiny", dtype="int8")
    matmuls = _int8_programs(compiled)
    # whichever operand stays installed, the weight's zero point (5) and the input's (-3) both apply
    assert matmuls and all({m.attrs["zp_a"], m.attrs["zp_b"]} == {5, -3} for m in matmuls)
    x = rng.standard_normal((1, 3, 9, 9)).astype(np.float32)
    (out,) = run_on_lpx(compiled, [x], programs=1)  # one lpx call, nothing on the host
    steps = np.rint(np.abs(out - ort_run(qdq, {"x": x})[0]) / 0.2)
    assert steps.max() <= 1 and np.mean(steps == 0) >= 0.99


def test_int8_input_is_quantised_on_the_host_so_the_link_carries_one_byte_an_element(rng):
    """The QDQ model's first QuantizeLinear runs on the host: the link moves the 1·8·12·12 = 1,152 integers
    (the fp32 tensor is 4,608 bytes), and the LOAD takes ceil(1152 / host bytes per cycle) cycles. Its last
    DequantizeLinear runs on the host too: the 1·16·12·12 = 2,304 integers cross back."""
    from math import ceil

    from onnx import helper

    from conftest import make_model, ort_run, run_on_lpx, tensor_info, weights
    from lpx_tvm.app.tools.zoo import output_step
    from lpx_tvm.runtime_sim import Simulator, load_config

    model = make_model([helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
                        helper.make_node("Relu", ["c"], ["y"])],
                       [tensor_info("x", [1, 8, 12, 12])], [tensor_info("y", [1, 16, 12, 12])],
                       [weights(rng, "w", (16, 8, 3, 3)), weights(rng, "b", (16,))])
    feeds = [{"x": rng.standard_normal((1, 8, 12, 12)).astype(np.float32)} for _ in range(3)]
    qdq = lpx_tvm.quantize(model, feeds)
    compiled = lpx_tvm.compile(qdq, config="tiny", dtype="int8")
    (program,) = (decode(blob) for blob in compiled.programs.values())
    assert program.inputs[0].dtype in (DType.I8, DType.U8) and len(program.host_converted) == 1
    loads = [i for i in program.instructions if i.opcode == Opcode.LOAD]
    assert sum(i.dsts[0].nbytes for i in loads) == 1152
    assert not any(i.opcode in (Opcode.QUANTIZE, Opcode.DEQUANTIZE) for i in program.instructions)
    stores = [i for i in program.instructions if i.opcode == Opcode.STORE]
    assert sum(i.srcs[0].nbytes for i in stores) == 2304 and len(program.widened_outputs) == 1
    sim = Simulator(program)
    per_cycle = load_config("tiny").host_bytes_per_cycle
    assert sum(sim.costs[program.instructions.index(i)].busy for i in loads) == \
        sum(ceil(i.dsts[0].nbytes / per_cycle) for i in loads)
    x = rng.standard_normal((1, 8, 12, 12)).astype(np.float32) * 1.5  # some values saturate
    (out,) = run_on_lpx(compiled, [x], programs=1)
    steps = np.rint(np.abs(out - ort_run(qdq, {"x": x})[0]) / output_step(qdq))
    assert np.mean(steps <= 1) >= 0.99



def test_int8_attention_runs_its_products_of_two_activations_in_int8_with_nothing_on_the_host(rng):
    """softmax(q kᵀ / 8) v from ONNX Runtime's quantiser: QDQ pairs around the reshapes and transposes run
    on the integers (no DEQUANTIZE/QUANTIZE pass for them), both products of two activations are int8
    MATMULs (QLinearMatMul), and the quantised scalar 8 is folded at import (it was dequantised on the
    host at every call)."""
    from onnx import helper

    from conftest import make_model, ort_run, run_on_lpx, tensor_info, weights
    from lpx_tvm.app.tools.zoo import output_step

    heads, seq, dim = 2, 16, 8
    model = make_model([
        helper.make_node("MatMul", ["x", "wq"], ["q2"]), helper.make_node("MatMul", ["x", "wk"], ["k2"]),
        helper.make_node("MatMul", ["x", "wv"], ["v2"]),
        *[helper.make_node("Reshape", [f"{t}2", "split"], [f"{t}3"]) for t in "qkv"],
        helper.make_node("Transpose", ["q3"], ["q"], perm=[1, 0, 2]),
        helper.make_node("Transpose", ["k3"], ["kt"], perm=[1, 2, 0]),
        helper.make_node("Transpose", ["v3"], ["v"], perm=[1, 0, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["s"]), helper.make_node("Div", ["s", "d"], ["scaled"]),
        helper.make_node("Softmax", ["scaled"], ["p"], axis=-1), helper.make_node("MatMul", ["p", "v"], ["y"])],
        [tensor_info("x", [seq, heads * dim])], [tensor_info("y", [heads, seq, dim])],
        [weights(rng, f"w{t}", (heads * dim, heads * dim)) for t in "qkv"]
        + [helper.make_tensor("split", 7, [3], [seq, heads, dim]), helper.make_tensor("d", 1, [], [8.0])])
    feeds = [{"x": rng.standard_normal((seq, heads * dim)).astype(np.float32)} for _ in range(4)]
    qdq = lpx_tvm.quantize(model, feeds)
    compiled = lpx_tvm.compile(qdq, config="tiny", dtype="int8")
    (program,) = (decode(blob) for blob in compiled.programs.values())
    products = [i for i in program.instructions if i.opcode == Opcode.MATMUL]
    layers = {program.layer_names[i.layer].split("/")[-1] for i in products}
    assert {i.srcs[0].dtype for i in products} <= {DType.I8, DType.U8} and len(layers) == 5
    transposes = [i for i in program.instructions if i.opcode == Opcode.TRANSPOSE]
    assert transposes and {i.srcs[0].dtype for i in transposes} <= {DType.I8, DType.U8}
    x = feeds[0]["x"]
    (out,) = run_on_lpx(compiled, [x], programs=1)
    steps = np.rint(np.abs(out - ort_run(qdq, {"x": x})[0]) / output_step(qdq))
    assert np.mean(steps <= 1) >= 0.99
