"""Regressions outside users found (issue 50): each test failed before its fix."""

import numpy as np
import pytest
from onnx import TensorProto, helper

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
