"""Import-time folding: exporter idioms (run-time shape arithmetic, Clip with tensor bounds) must still offload."""

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

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


@pytest.mark.slow
def test_weights_built_by_constant_of_shape_are_weights_so_light_shufflenet_runs_on_lpx(rng):
    """The onnx package's light_shufflenet.onnx builds all 243 of its weights with ConstantOfShape. TVM's
    importer made each a broadcast, so no convolution had a constant weight: 49 of them ran on the host and
    1.8% of the FLOPs on lpx, in 20 programs. Folded at import, the whole network is one program."""
    import onnx

    from conftest import run_on_lpx

    path = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light" / "light_shufflenet.onnx"
    compiled = lpx_tvm.compile(str(path), config="tsp")
    assert compiled.report.offloaded_pct == 100.0
    x = rng.standard_normal((1, 3, 224, 224)).astype(np.float32)
    (out,) = run_on_lpx(compiled, [x], programs=1)
    (want,) = ort_run(onnx.load(str(path)), {"gpu_0/data_0": x})
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-7)


def test_constant_of_shape_of_a_constant_node_folds_with_its_fill_value_and_type(rng):
    shape = helper.make_tensor("shape", TensorProto.INT64, [2], [3, 4])
    model = make_model([helper.make_node("Constant", [], ["s"], value=shape),
                        helper.make_node("ConstantOfShape", ["s"], ["w"],
                                         value=numpy_helper.from_array(np.array([0.25], np.float32))),
                        helper.make_node("MatMul", ["x", "w"], ["y"])],
                       [tensor_info("x", [2, 3])], [tensor_info("y", [2, 4])], [])
    from conftest import run_on_lpx

    compiled = lpx_tvm.compile(model, config="tiny")
    assert compiled.report.offloaded_pct == 100.0
    x = rng.standard_normal((2, 3)).astype(np.float32)
    (out,) = run_on_lpx(compiled, [x], programs=1)
    np.testing.assert_allclose(out, x @ np.full((3, 4), 0.25, np.float32), rtol=1e-6)
