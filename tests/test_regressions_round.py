"""Regressions outside users found (issue 50): each test failed before its fix."""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import lpx_tvm
from conftest import assert_close, ort_reference, run_on_lpx


# ---------------------------------------------------------------------------
# two models in one process
# ---------------------------------------------------------------------------
def _layer_norm_expanded(name: str, axis: int, shape=(3, 4)):
    """The onnx package's function-expanded LayerNormalization test graph ``<name>_expanded``: the same
    nodes for every name, but each node named after the test (so only the ONNX names tell two apart)."""
    from onnx.backend.test.case.node import function_testcase_helper

    node = helper.make_node("LayerNormalization", ["X", "W", "B"], ["Y", "Mean", "InvStdDev"], axis=axis)
    stat = [*shape[:axis % len(shape)], *[1] * (len(shape) - axis % len(shape))]
    inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, shape),
              helper.make_tensor_value_info("W", TensorProto.FLOAT, shape[axis % len(shape):]),
              helper.make_tensor_value_info("B", TensorProto.FLOAT, shape[axis % len(shape):])]
    outputs = [helper.make_tensor_value_info("Y", TensorProto.FLOAT, shape),
               helper.make_tensor_value_info("Mean", TensorProto.FLOAT, stat),
               helper.make_tensor_value_info("InvStdDev", TensorProto.FLOAT, stat)]
    (nodes, opsets), *_ = function_testcase_helper(node, [i.type for i in inputs], name)[0]
    graph = helper.make_graph(nodes, name + "_expanded", inputs, outputs)
    return helper.make_model(graph, opset_imports=opsets)


@pytest.mark.parametrize("first", [0, 1])
def test_two_models_alike_but_for_their_names_run_in_one_process(rng, first):
    # axis 1 and axis -1 of a 2-D input expand to the same graph, its nodes named after each test: their
    # Relax functions hash alike (spans are not hashed), their programs differ in their layer names, and
    # both once shared one chip plan ("weights ... overlap another program's ... on the same chip")
    models = [_layer_norm_expanded("test_layer_normalization_2d_axis1", 1),
              _layer_norm_expanded("test_layer_normalization_2d_axis_negative_1", -1)]
    feeds = [rng.standard_normal(s).astype(np.float32) for s in ((3, 4), (4,), (4,))]
    compiled = [lpx_tvm.compile(m) for m in models]  # both alive: the first's programs stay loaded
    for k in (first, 1 - first, first):
        outs = run_on_lpx(compiled[k], feeds, programs=1)
        refs = ort_reference(models[k], dict(zip("XWB", feeds)))
        for out, ref in zip(outs, refs):
            assert_close(out, ref, 1e-5)


# ---------------------------------------------------------------------------
# a window too large for a host kernel
# ---------------------------------------------------------------------------
def _refuse_to_build(*window):
    raise AssertionError(f"a kernel was built for the window {window}")


def test_a_large_pooling_window_runs_numpys_passes_not_a_kernel_build(rng, monkeypatch):
    # the onnx package's pytorch-converted test_MaxPool2d_stride_padding_dilation: 4,800 taps, whose kernel
    # (every tap written out) had not built after 150 s
    from lpx_tvm import window_kernels

    monkeypatch.setattr(window_kernels, "_build_maxpool", _refuse_to_build)
    node = helper.make_node("MaxPool", ["X"], ["Y"], kernel_shape=[60, 80], dilations=[10, 10],
                            strides=[10, 10], pads=[10, 20, 10, 20])
    model = helper.make_model(helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 1, 1000, 1000])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 1, 43, 25])]),
        opset_imports=[helper.make_opsetid("", 17)])
    x = rng.standard_normal((1, 1, 1000, 1000)).astype(np.float32)
    (out,) = run_on_lpx(lpx_tvm.compile(model), [x], programs=1)
    (ref,) = ort_reference(model, {"X": x})
    np.testing.assert_array_equal(np.asarray(out), ref)  # a maximum is exact


def test_a_large_convolution_window_runs_numpys_im2col_not_a_kernel_build(rng, monkeypatch):
    # 9 x 9 = 81 taps: its IM2COL kernel took 17 s to build, more than numpy's copies cost over many runs
    from lpx_tvm import window_kernels
    from lpx_tvm.runtime_sim import Opcode, decode

    monkeypatch.setattr(window_kernels, "_build_im2col", _refuse_to_build)
    w = (rng.standard_normal((8, 4, 9, 9)) * 0.1).astype(np.float32)
    node = helper.make_node("Conv", ["X", "W"], ["Y"], kernel_shape=[9, 9], pads=[4, 4, 4, 4])
    model = helper.make_model(helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 4, 24, 24])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 8, 24, 24])],
        [numpy_helper.from_array(w, "W")]), opset_imports=[helper.make_opsetid("", 17)])
    x = rng.standard_normal((1, 4, 24, 24)).astype(np.float32)
    compiled = lpx_tvm.compile(model)
    (program,) = (decode(blob) for blob in compiled.programs.values())
    assert Opcode.IM2COL in {ins.opcode for ins in program.instructions}
    (out,) = run_on_lpx(compiled, [x], programs=1)
    (ref,) = ort_reference(model, {"X": x})
    assert_close(out, ref, 1e-5)


@pytest.mark.parametrize("kernel, built", [((7, 7), True), ((1, 49), True), ((5, 10), False), ((1, 50), False)])
def test_a_window_kernel_is_built_up_to_a_7x7_stems_taps(kernel, built, monkeypatch):
    from lpx_tvm import window_kernels

    windows = []

    def record(window):
        windows.append(window)
        return lambda *args: None

    monkeypatch.setattr(window_kernels, "_build_maxpool", record)
    attrs = {"kernel": kernel, "stride": (1, 1), "dilation": (1, 1), "pad": (0, 0, 0, 0)}
    x = np.zeros((1, 1, 8, 56), np.float32)
    out = np.zeros((1, 1, 8 - kernel[0] + 1, 56 - kernel[1] + 1), np.float32)
    assert window_kernels.max_pool(x, out, attrs) is built
    assert windows == ([(kernel, (1, 1), (1, 1))] if built else [])
