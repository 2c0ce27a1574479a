"""The bugs an outside review found, each with the test that failed before its fix."""

import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, defs, helper, numpy_helper

import lpx_tvm
from lpx_tvm import runtime
from lpx_tvm.runtime_sim import Opcode, decode
from lpx_tvm.runtime_sim.program import read_digest
from lpx_tvm.runtime_sim.simulator import OverflowWarning
from conftest import assert_close, cnn_model, make_model, mlp_model, ort_run, tensor_info, weights


def _run_counted(compiled, *inputs):
    before = runtime.total_offloaded_calls()
    out = compiled(*inputs)
    return out, runtime.total_offloaded_calls() - before


def _within_one_step(qdq, out, ref) -> float:
    from lpx_tvm.app.tools.zoo import output_step

    return float(np.mean(np.rint(np.abs(np.asarray(out, np.float64) - ref) / output_step(qdq)) <= 1))


def test_uint8_activations_quantised_by_ort_run_as_ort_defines_them(rng):
    """Was: KeyError 'uint8' in the cost model for any Gemm/MatMul quantised with QUInt8 activations."""
    model = mlp_model()
    qdq = lpx_tvm.quantize(model, [{"x": rng.standard_normal((4, 64)).astype(np.float32)} for _ in range(4)],
                           activations="uint8")
    assert any(i.data_type == TensorProto.UINT8 for i in qdq.graph.initializer)
    compiled = lpx_tvm.compile(qdq, config="tiny", dtype="int8")
    x = rng.standard_normal((4, 64)).astype(np.float32)
    (out,), calls = _run_counted(compiled, x)
    assert calls == 1 and not compiled.report.host_ops
    assert _within_one_step(qdq, out, ort_run(qdq, {"x": x})[0]) >= 0.99


@pytest.mark.slow
def test_uint8_resnet50_agrees_with_ort_within_one_step():
    from lpx_tvm.app.tools.zoo import ZOO, seeded_inputs, without_final_softmax

    model = without_final_softmax(ZOO["resnet50"].load())
    qdq = lpx_tvm.quantize(model, [seeded_inputs(model, s) for s in range(2, 4)], activations="uint8")
    compiled = lpx_tvm.compile(qdq, dtype="int8")
    feeds = seeded_inputs(qdq, 11)
    (out,), calls = _run_counted(compiled, *feeds.values())
    ref = ort_run(qdq, feeds)[0]
    assert calls == compiled.report.lpx_functions == 1  # ResNet-50's whole int8 graph is one lpx program
    assert _within_one_step(qdq, out, ref) >= 0.99
    assert out.argmax() == ref.argmax()


def test_batch_norm_in_training_mode_runs_on_the_host_as_onnx_defines_it(rng):
    """Was: offloaded and normalised with the stored statistics, a silent wrong answer (errors up to 6.0)."""
    stats = [numpy_helper.from_array(rng.uniform(0.5, 1.5, 3).astype(np.float32), n) for n in ("g", "b", "m", "v")]
    model = make_model([helper.make_node("BatchNormalization", ["x", "g", "b", "m", "v"], ["y", "rm", "rv"],
                                         training_mode=1)], [tensor_info("x", [2, 3, 4, 4])],
                       [tensor_info("y", None), tensor_info("rm", None), tensor_info("rv", None)], stats)
    model.opset_import[0].version = 15
    compiled = lpx_tvm.compile(model, config="tiny")
    assert compiled.report.host_ops["relax.nn.batch_norm"] == 1
    x = (rng.standard_normal((2, 3, 4, 4)) * 3 + 1).astype(np.float32)
    assert_close(compiled(x)[0], ort_run(model, {"x": x})[0], 1e-5)


@pytest.mark.parametrize("a_shape, b_shape", [((16,), (3, 16, 5)), ((16,), (16,)), ((2, 3, 4, 16), (16,))])
def test_matmul_with_a_one_dimensional_operand_runs_on_lpx(rng, a_shape, b_shape):
    """Was: IndexError in the tiler or a rejected program."""
    model = make_model([helper.make_node("MatMul", ["a", "b"], ["y"])], [tensor_info("a", list(a_shape))],
                       [tensor_info("y", None)], [weights(rng, "b", b_shape)])
    compiled = lpx_tvm.compile(model, config="tiny")
    a = rng.standard_normal(a_shape).astype(np.float32)
    (out,), calls = _run_counted(compiled, a)
    assert calls == 1
    assert_close(out, ort_run(model, {"a": a})[0], 1e-5)


def _gelu_function_body_model(shape=(4, 8)):
    """Gelu written out as ONNX's own function body: Constant, CastLike, Sqrt, Div, Erf, Sum, Mul."""
    node = helper.make_node("Gelu", ["x"], ["y"])
    body = defs.get_schema("Gelu", 20).get_context_dependent_function(
        node.SerializeToString(), [helper.make_tensor_type_proto(TensorProto.FLOAT, list(shape)).SerializeToString()])
    function = onnx.FunctionProto()
    function.ParseFromString(body)
    nodes = []
    for n in function.node:
        copy = onnx.NodeProto()
        copy.CopyFrom(n)
        copy.input[:] = ["x" if i == "X" else i for i in n.input]
        copy.output[:] = ["y" if o == "Y" else o for o in n.output]
        nodes.append(copy)
    model = make_model(nodes, [tensor_info("x", list(shape))], [tensor_info("y", list(shape))], [])
    model.opset_import[0].version = 20
    return model


def test_gelu_written_out_as_its_onnx_function_offloads(rng):
    """Was: "Could not convert T.float32 to a NumPy dtype" while folding its constants."""
    model = _gelu_function_body_model()
    compiled = lpx_tvm.compile(model, config="tiny")
    x = rng.standard_normal((4, 8)).astype(np.float32)
    (out,), calls = _run_counted(compiled, x)
    assert calls == 1 and not compiled.report.host_ops, compiled.report.summary()
    assert_close(out, ort_run(model, {"x": x})[0], 1e-5)


def test_reshape_with_allowzero_of_an_empty_input_stays_on_the_host(rng):
    """Was: TypeError "Invalid type: relax.expr.MatchCast" inside partition_for_lpx."""
    model = make_model([helper.make_node("Reshape", ["x", "s"], ["r"], allowzero=1),
                        helper.make_node("Relu", ["r"], ["y"])], [tensor_info("x", [0, 4])], [tensor_info("y", None)],
                       [numpy_helper.from_array(np.array([4, 0], np.int64), "s")])
    model.opset_import[0].version = 14
    with pytest.warns(lpx_tvm.patterns.PartitionWarning):
        compiled = lpx_tvm.compile(model, config="tiny")
    x = np.zeros((0, 4), np.float32)
    assert compiled(x)[0].shape == ort_run(model, {"x": x})[0].shape == (4, 0)


def test_fp16_overflow_warns_naming_the_layer_and_the_dtype(rng):
    """Was: silent inf (numpy's errors were all ignored)."""
    model = make_model([helper.make_node("Mul", ["x", "k"], ["y"])], [tensor_info("x", [4, 8])],
                       [tensor_info("y", [4, 8])], [numpy_helper.from_array(np.full((4, 8), 100, np.float32), "k")])
    compiled = lpx_tvm.compile(model, config="tiny", dtype="fp16")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ok = compiled(np.full((4, 8), 10, np.float32))[0]
    assert np.isfinite(ok).all() and not [w for w in caught if w.category is OverflowWarning]
    with pytest.warns(OverflowWarning, match=r"layer '.*multiply.*' \(MUL\) overflowed its fp16 storage type"):
        assert np.isinf(compiled(np.full((4, 8), 1e3, np.float32))[0]).all()


def test_batch_norm_is_folded_once_in_the_codegen(rng):
    """Was: folded both in the frontend (ONNX) and in lowering."""
    mod = lpx_tvm.from_onnx(cnn_model())
    assert "nn.batch_norm" in mod.script()  # the frontend leaves it to the codegen
    compiled = lpx_tvm.compile(cnn_model(), config="tiny")
    program = decode(next(iter(compiled.programs.values())))
    assert not [i for i in program.instructions if i.opcode in (Opcode.MUL, Opcode.ADD)]  # folded into the conv
    x = rng.standard_normal((1, 3, 32, 32)).astype(np.float32)
    (y,), calls = _run_counted(compiled, x)
    # the whole model is one lpx program and ran there: one lpx call, nothing left on the host
    assert compiled.report.lpx_functions == 1, compiled.report.summary()
    assert calls == 1 and not compiled.report.host_ops, compiled.report.summary()
    assert_close(y, ort_run(cnn_model(), {"x": x})[0], 1e-5)


def test_a_model_collected_while_a_program_loads_does_not_hang_the_runtime(rng):
    """A collected model's programs are forgotten by a finalizer, which a garbage collection can run in the
    middle of a load, on the thread holding the runtime's lock: the suite once hung there. Released keys are
    set aside and forgotten at the next load."""
    import gc

    old = lpx_tvm.compile(mlp_model(), config="tiny")
    x = rng.standard_normal((4, 64)).astype(np.float32)
    old(x)
    keys = [runtime.program_key(blob) for blob in old.programs.values()]
    assert all(key in runtime._SIMULATORS for key in keys)
    with runtime._LOCK:  # as a load holds it
        del old
        gc.collect()  # the finalizer runs here: it must not wait for the lock
        assert all(key in runtime._SIMULATORS for key in keys)  # set aside
    fresh = lpx_tvm.compile(mlp_model(seed=1), config="tiny")
    fresh(x)  # its load forgets what was set aside
    assert not any(key in runtime._SIMULATORS for key in keys)


def test_two_caches_read_by_one_merged_lpx_function_each_keep_their_own_values():
    """past0 + x, then floor on the host, then past1 + that: TVM merges the two equal adds into one lpx
    function, and both resident caches mapped to its one slot (the result was off by up to 1.9, silently,
    as in a Hugging Face decoder whose identical layers read their own KV caches). Each call of a function
    with state now gets its own program."""
    from onnx import helper

    from conftest import make_model, tensor_info

    model = make_model([helper.make_node("Add", ["past0", "x"], ["a0"]), helper.make_node("Floor", ["a0"], ["s"]),
                        helper.make_node("Add", ["past1", "s"], ["y"])],
                       [tensor_info("past0", [4, 8]), tensor_info("past1", [4, 8]), tensor_info("x", [4, 8])],
                       [tensor_info("y", [4, 8])], [])
    compiled = lpx_tvm.compile(model, config="tiny", state=["past0", "past1"])
    assert compiled.state_where["past0"] != compiled.state_where["past1"]
    rng = np.random.default_rng(0)
    p0, p1, x = (rng.standard_normal((4, 8)).astype(np.float32) for _ in range(3))
    compiled.write_state("past0", p0)
    compiled.write_state("past1", p1)
    assert compiled.report.lpx_functions == 1 and compiled.report.host_ops == {"relax.floor": 1}
    assert len(compiled.programs) == 2  # the one function, a program for each of its two calls
    before = runtime.offload_counts()
    (out,) = compiled(p0, p1, x)
    ran = runtime.offload_counts() - before
    assert set(ran) == {read_digest(b).hex() for b in compiled.programs.values()}
    assert sorted(ran.values()) == [1, 1]  # each add on lpx once, by its own program
    np.testing.assert_allclose(out, p1 + np.floor(p0 + x), rtol=1e-6, atol=1e-6)


def test_an_fp16_attention_mask_of_float32_lowest_saturates_instead_of_making_nan(rng):
    """Hugging Face builds its additive mask as (1 - attention_mask) · float32's lowest (-3.4e38). Stored as
    fp16 that constant was -inf, and 0 · -inf is NaN on every position that is not masked; it now saturates
    to -65504 (with a warning) and the masked probabilities are 0, as ONNX Runtime's in fp32."""
    model = make_model([helper.make_node("Sub", ["one", "mask"], ["inverted"]),
                        helper.make_node("Mul", ["inverted", "lowest"], ["additive"]),
                        helper.make_node("Add", ["x", "additive"], ["s"]),
                        helper.make_node("Softmax", ["s"], ["y"], axis=-1)],
                       [tensor_info("x", [4, 8]), tensor_info("mask", [4, 8])], [tensor_info("y", [4, 8])],
                       [numpy_helper.from_array(np.float32(1), "one"),
                        numpy_helper.from_array(np.finfo(np.float32).min, "lowest")])
    with pytest.warns(OverflowWarning, match="overflows fp16 .*it saturates to ±65504"):
        compiled = lpx_tvm.compile(model, config="tiny", dtype="fp16")
    assert compiled.report.lpx_functions == 1 and not compiled.report.host_ops
    x = rng.standard_normal((4, 8)).astype(np.float32)
    mask = np.ones((4, 8), np.float32)
    mask[:, 5:] = 0
    (out,), calls = _run_counted(compiled, x, mask)
    assert calls == 1  # the mask's arithmetic and the softmax: one lpx program
    assert np.isfinite(out).all() and not out[:, 5:].any()
    np.testing.assert_allclose(out, ort_run(model, {"x": x, "mask": mask})[0], atol=2e-3)


@pytest.mark.slow
def test_a_package_probing_for_tvm_before_it_loads_does_not_lose_lpx_registration():
    """transformers looks TVM up (importlib.util.find_spec) without importing it; the hook that registers lpx
    once TVM loads took that lookup for the import and went, so a later import of TVM had no lpx target."""
    import subprocess
    import sys

    code = ("import importlib.util, lpx_tvm; importlib.util.find_spec('tvm'); import tvm; "
            "print(tvm.target.Target('lpx').keys)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "lpx" in done.stdout
