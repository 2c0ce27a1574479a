"""Import-time folding: exporter idioms (run-time shape arithmetic, Clip with tensor bounds) must still offload."""

import numpy as np
from onnx import helper, numpy_helper

import lpx_tvm
from lpx_tvm.runtime import total_offloaded_calls
from conftest import assert_close, make_model, ort_run, tensor_info, weights


def exporter_style_model(rng):
    """Conv ─► Clip(0, 6) with initializer bounds ─► Reshape to [Shape(x)[0], -1] ─► Gemm, batch dynamic."""
    inits = [weights(rng, "w", (8, 3, 3, 3)), weights(rng, "fc", (5, 8 * 6 * 6)),
             numpy_helper.from_array(np.float32(0.0), "lo"), numpy_helper.from_array(np.float32(6.0), "hi"),
             numpy_helper.from_array(np.array([0], np.int64), "zero"),
             numpy_helper.from_array(np.array([1], np.int64), "one"),
             numpy_helper.from_array(np.array([-1], np.int64), "minus_one")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]),
             helper.make_node("Clip", ["c", "lo", "hi"], ["r"]),
             helper.make_node("Shape", ["r"], ["s"]),
             helper.make_node("Slice", ["s", "zero", "one"], ["n"]),
             helper.make_node("Concat", ["n", "minus_one"], ["target"], axis=0),
             helper.make_node("Reshape", ["r", "target"], ["flat"]),
             helper.make_node("Gemm", ["flat", "fc"], ["y"], transB=1)]
    return make_model(nodes, [tensor_info("x", ["N", 3, 8, 8])], [tensor_info("y", ["N", 5])], inits)


def test_shape_arithmetic_and_clip_fold_so_everything_offloads(rng):
    model = exporter_style_model(rng)
    compiled = lpx_tvm.compile(model, config="tiny", input_shapes={"x": [2, 3, 8, 8]})
    assert compiled.report.lpx_functions == 1 and not compiled.report.host_ops, compiled.report.summary()
    x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32) * 4  # big enough for Clip to bite at 6
    before = total_offloaded_calls()
    out = compiled(x)[0]
    assert total_offloaded_calls() - before == 1
    assert_close(out, ort_run(model, {"x": x})[0], 1e-4)
