"""Small ONNX graphs built with onnx.helper and seeded weights, and an ONNX Runtime reference."""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

OPSET = [helper.make_opsetid("", 17)]


def make_model(nodes, inputs, outputs, inits, name="g"):
    graph = helper.make_graph(nodes, name, inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=OPSET)


def tensor_info(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def weights(rng, name, shape, scale=0.3):
    return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)


def add_model(rows, cols):
    """z = x + y on two [rows, cols] inputs: bound by the host link, its cycles worked by hand in
    ``programs.host_bound_add_cycles``."""
    return make_model([helper.make_node("Add", ["x", "y"], ["z"])],
                      [tensor_info("x", [rows, cols]), tensor_info("y", [rows, cols])],
                      [tensor_info("z", [rows, cols])], [])


def mlp_model(seed=0):
    rng = np.random.default_rng(seed)
    inits = [weights(rng, "w1", (32, 64)), weights(rng, "b1", (32,)),
             weights(rng, "w2", (10, 32)), weights(rng, "b2", (10,))]
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], transB=1),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Gemm", ["r", "w2", "b2"], ["y"], transB=1)]
    return make_model(nodes, [tensor_info("x", [4, 64])], [tensor_info("y", [4, 10])], inits)


def cnn_model(seed=0):
    rng = np.random.default_rng(seed)
    inits = [weights(rng, "w", (16, 3, 3, 3)), weights(rng, "b", (16,)),
             numpy_helper.from_array(rng.uniform(0.5, 1.5, 16).astype(np.float32), "gamma"),
             weights(rng, "beta", (16,)), weights(rng, "mean", (16,)),
             numpy_helper.from_array(rng.uniform(0.5, 1.5, 16).astype(np.float32), "var"),
             weights(rng, "fc", (10, 16)), weights(rng, "fcb", (10,))]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "gamma", "beta", "mean", "var"], ["bn"]),
             helper.make_node("Relu", ["bn"], ["r"]),
             helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("GlobalAveragePool", ["p"], ["g"]),
             helper.make_node("Flatten", ["g"], ["f"]),
             helper.make_node("Gemm", ["f", "fc", "fcb"], ["y"], transB=1)]
    return make_model(nodes, [tensor_info("x", [1, 3, 32, 32])], [tensor_info("y", [1, 10])], inits)


def host_op_between_model(seed=0):
    """conv+relu ─► Floor (host: lpx has no floor) ─► matmul+relu: two offloadable regions around a host op."""
    rng = np.random.default_rng(seed)
    inits = [weights(rng, "w", (8, 3, 3, 3)), weights(rng, "b", (8,)), weights(rng, "m", (16, 16))]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Floor", ["r"], ["s"]),
             helper.make_node("MatMul", ["s", "m"], ["mm"]),
             helper.make_node("Relu", ["mm"], ["y"])]
    return make_model(nodes, [tensor_info("x", [1, 3, 16, 16])], [tensor_info("y", [1, 8, 16, 16])], inits)


def ort_run(model, feeds):
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def assert_close(actual, expected, rtol):
    """Max abs error relative to the reference's largest magnitude."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape
    scale = max(float(np.abs(expected).max()), 1e-30)
    err = float(np.abs(actual - expected).max()) / scale
    assert err <= rtol, f"relative error {err:.3g} > {rtol}"
    return err


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def run_on_lpx(compiled, args, programs=None, host_ops=None):
    """Call a compiled model and show that lpx ran it: the number of lpx calls it made is the number of its
    lpx programs (or ``programs``), and the ops left on the host are exactly ``host_ops`` (default: none).
    Returns the outputs."""
    from collections import Counter

    from lpx_tvm.runtime import total_offloaded_calls

    expected = compiled.report.lpx_functions if programs is None else programs
    assert compiled.report.lpx_functions == expected, compiled.report.summary()
    assert compiled.report.host_ops == Counter(host_ops or {}), compiled.report.summary()
    before = total_offloaded_calls()
    outputs = compiled(*args)
    assert total_offloaded_calls() - before == expected
    return outputs


def ort_reference(model, feeds):
    """ONNX Runtime's outputs for ``feeds``, on the CPU."""
    import onnxruntime as ort

    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def mlp_stack(rng, widths, batch, act="Relu"):
    """Gemm layers ``widths[0] → widths[1] → …`` with biases and ``act`` between them; input ``x``."""
    inits, nodes, x = [], [], "x"
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        inits += [weights(rng, f"w{i}", (b, a), 1 / np.sqrt(a)), weights(rng, f"b{i}", (b,))]
        nodes.append(helper.make_node("Gemm", [x, f"w{i}", f"b{i}"], [f"h{i}"], transB=1))
        x = f"h{i}"
        if i < len(widths) - 2:
            nodes.append(helper.make_node(act, [x], [f"a{i}"]))
            x = f"a{i}"
    return make_model(nodes, [tensor_info("x", [batch, widths[0]])], [tensor_info(x, [batch, widths[-1]])], inits)


@pytest.fixture
def targets_made(monkeypatch):
    """Every Target made while the test runs."""
    from lpx_tvm.codegen import Target

    made = []
    post_init = Target.__post_init__

    def counted(self):
        post_init(self)
        made.append(self)
    monkeypatch.setattr(Target, "__post_init__", counted)
    return made
