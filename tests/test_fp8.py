"""fp8 (e4m3) on a chip whose matrix unit runs it: products in fp8 with per-channel weight scales, the vector
work in fp16, against ONNX Runtime in fp32; and a clear error on a chip without it."""

from collections import Counter

import numpy as np
import onnxruntime as ort
import pytest

import lpx_tvm
from conftest import cnn_model, run_on_lpx
from lpx_tvm.app.tools.zoo import ZOO, compare
from lpx_tvm.runtime import total_offloaded_calls
from lpx_tvm.runtime_sim import DType, Opcode, decode


def test_fp8_on_a_chip_without_it_names_what_the_chip_runs():
    with pytest.raises(ValueError, match=r"'tsp' has no fp8 matrix unit \(it runs bf16, fp16, fp32, int8\)"):
        lpx_tvm.compile(cnn_model(), config="tsp", dtype="fp8")


HOST_OPS = {"squeezenet": {}, "bert_encoder": {"relax.shape_to_tensor": 1, "relax.take": 2, "relax.less": 1,
                                                "relax.add": 1, "relax.where": 1}}


@pytest.mark.parametrize("name", ["squeezenet", "bert_encoder"])
@pytest.mark.slow
def test_fp8_agrees_with_onnx_runtime_in_fp32(name):
    entry = ZOO[name]
    model = entry.load()
    feeds = entry.feeds(model)
    reference = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    compiled = lpx_tvm.compile(model, config="lp30", dtype="fp8", input_shapes=entry.input_shapes)
    # one lpx program; on the host nothing for squeezenet, and for bert_encoder only its embedding's Gather,
    # as TVM's ONNX frontend writes it: the table lookup (a take) behind the negative-index wrap
    # where(i < 0, i + n, i), n the first entry (a second take) of shape_to_tensor's shape
    assert compiled.report.lpx_functions == 1, compiled.report.summary()
    assert compiled.report.host_ops == Counter(HOST_OPS[name]), compiled.report.summary()
    calls = total_offloaded_calls()
    outputs = compiled(*[feeds[n] for n, _, _ in compiled.input_signature])
    assert total_offloaded_calls() - calls == 1  # the one program ran on lpx, once
    assert compare(outputs, reference)["cosine"] >= 0.99
    (sim,) = compiled.simulators.values()
    products = [i for i in sim.program.instructions if i.opcode in (Opcode.MATMUL, Opcode.INSTALL)]
    in_fp8 = [i for i in products if i.srcs[0].dtype == DType.F8]
    # the weighted products run in fp8; the first and last layer's, and attention's products of two
    # activations, in fp16
    assert in_fp8 and len(in_fp8) < len(products)
    assert all(i.srcs[0].dtype in (DType.F8, DType.F16) for i in products)


def test_small_weights_keep_their_precision_in_fp8(rng):
    """Weights of 1e-3 are subnormal in e4m3 (2^-9 steps): stored as they are they would lose most of their
    digits; scaled per output column they keep fp8's 3 mantissa bits. The small weight is the middle of
    three products: the first and the last stay fp16 (a lone product is both, and ran in fp16)."""
    from onnx import helper, numpy_helper
    from conftest import make_model, tensor_info

    w1 = (rng.standard_normal((64, 64)) * 0.1).astype(np.float32)
    w3 = (rng.standard_normal((32, 32)) * 0.1).astype(np.float32)
    w = (rng.standard_normal((64, 32)) * 1e-3).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("MatMul", ["h", "w"], ["s"]),
             helper.make_node("MatMul", ["s", "w3"], ["y"])]
    inits = [numpy_helper.from_array(a, n) for a, n in ((w1, "w1"), (w, "w"), (w3, "w3"))]
    model = make_model(nodes, [tensor_info("x", [8, 64])], [tensor_info("y", [8, 32])], inits)
    x = rng.standard_normal((8, 64)).astype(np.float32)
    compiled = lpx_tvm.compile(model, config="lp30", dtype="fp8")
    (y,) = run_on_lpx(compiled, [x], programs=1)
    (program,) = (decode(blob) for blob in compiled.programs.values())
    layers = {program.layer_names[i.layer].split("/")[-1]: i.srcs[0].dtype for i in program.instructions
              if i.opcode == Opcode.MATMUL}
    assert sorted(layers.values(), key=lambda d: d.value) == [DType.F16, DType.F16, DType.F8]
    want = x.astype(np.float64) @ w1 @ w @ w3
    cosine = float((y.astype(np.float64) * want).sum() / np.linalg.norm(y) / np.linalg.norm(want))
    assert cosine > 0.998
