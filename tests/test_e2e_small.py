"""End-to-end on small ONNX graphs: lpx vs ONNX Runtime, and proof that lpx really ran."""

import numpy as np
import pytest
import tvm
from onnx import helper
from tvm import relax

import lpx_tvm
from lpx_tvm import runtime
from lpx_tvm.runtime_sim import Opcode, decode
from conftest import assert_close, cnn_model, make_model, mlp_model, ort_run, host_op_between_model, tensor_info, weights


def _run_counted(compiled, *inputs):
    before = runtime.total_offloaded_calls()
    out = compiled(*inputs)
    return out, runtime.total_offloaded_calls() - before


@pytest.mark.parametrize("config", ["tiny", "tsp"])
def test_mlp_matches_ort(rng, config):
    model = mlp_model()
    x = rng.standard_normal((4, 64)).astype(np.float32)
    compiled = lpx_tvm.compile(model, config=config)
    (out,), calls = _run_counted(compiled, x)
    assert_close(out, ort_run(model, {"x": x})[0], 1e-4)
    assert compiled.report.lpx_functions == 1 and calls == 1
    assert not compiled.report.host_ops


def test_cnn_matches_ort(rng):
    model = cnn_model()
    x = rng.standard_normal((1, 3, 32, 32)).astype(np.float32)
    compiled = lpx_tvm.compile(model, config="tiny")
    (out,), calls = _run_counted(compiled, x)
    assert_close(out, ort_run(model, {"x": x})[0], 1e-4)
    assert compiled.report.lpx_functions == 1 and calls == 1
    assert compiled.report.offloaded_pct == 100.0


@pytest.mark.parametrize("kernel, stride, pad", [(3, 1, 1), (5, 2, 2), (3, 2, 0)])
def test_depthwise_conv_runs_as_dwconv(rng, kernel, stride, pad):
    inits = [weights(rng, "w", (12, 1, kernel, kernel)), weights(rng, "b", (12,))]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], group=12, strides=[stride, stride],
                              pads=[pad] * 4),
             helper.make_node("Relu", ["c"], ["y"])]
    model = make_model(nodes, [tensor_info("x", [1, 12, 11, 13])], [tensor_info("y", None)], inits)
    x = rng.standard_normal((1, 12, 11, 13)).astype(np.float32)
    compiled = lpx_tvm.compile(model, config="tiny")
    (out,), calls = _run_counted(compiled, x)
    assert_close(out, ort_run(model, {"x": x})[0], 1e-4)
    assert calls == 1
    (program,) = (decode(blob) for blob in compiled.programs.values())
    assert [i.opcode for i in program.instructions if i.opcode not in (Opcode.LOAD, Opcode.STORE)] == [Opcode.DWCONV]


def test_unsupported_op_runs_on_host_between_two_lpx_regions(rng):
    model = host_op_between_model()
    x = rng.standard_normal((1, 3, 16, 16)).astype(np.float32)
    compiled = lpx_tvm.compile(model, config="tiny")
    (out,), calls = _run_counted(compiled, x)
    assert_close(out, ort_run(model, {"x": x})[0], 1e-4)
    assert compiled.report.lpx_functions == 2 and calls == 2
    assert compiled.report.host_ops == {"relax.floor": 1}


def test_tvm_compile_target_lpx_offloads(rng):
    model = host_op_between_model()
    x = rng.standard_normal((1, 3, 16, 16)).astype(np.float32)
    mod = lpx_tvm.from_onnx(model)
    expected = ort_run(model, {"x": x})[0]
    for kwargs in ({}, {"relax_pipeline": "lpx"}):
        ex = tvm.compile(mod, target="lpx", **kwargs)
        vm = relax.VirtualMachine(ex, tvm.cpu())
        before = runtime.total_offloaded_calls()
        out = vm["main"](tvm.runtime.tensor(x)).numpy()
        assert runtime.total_offloaded_calls() - before == 2, kwargs
        assert_close(out, expected, 1e-4)


def test_byoc_convention_partition_runcodegen_compile(rng):
    model = mlp_model()
    x = rng.standard_normal((4, 64)).astype(np.float32)
    mod = lpx_tvm.partition_for_lpx(lpx_tvm.from_onnx(model), config="tiny")
    mod = relax.transform.RunCodegen(target_options={"lpx": {"config": "tiny"}})(mod)
    ex = tvm.compile(mod, target="lpx")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    before = runtime.total_offloaded_calls()
    out = vm["main"](tvm.runtime.tensor(x)).numpy()
    assert runtime.total_offloaded_calls() - before == 1
    assert_close(out, ort_run(model, {"x": x})[0], 1e-4)


def test_llvm_target_is_unchanged(rng):
    model = mlp_model()
    x = rng.standard_normal((4, 64)).astype(np.float32)
    mod = lpx_tvm.from_onnx(model)
    ex = tvm.compile(mod, target="llvm")
    before = runtime.total_offloaded_calls()
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    assert runtime.total_offloaded_calls() == before
    assert_close(out, ort_run(model, {"x": x})[0], 1e-4)


def test_nothing_offloadable_warns(rng):
    model = make_model([helper.make_node("Floor", ["x"], ["y"])], [tensor_info("x", [2, 3])],
                       [tensor_info("y", [2, 3])], [])
    with pytest.warns(lpx_tvm.NothingOffloadedWarning):
        tvm.compile(lpx_tvm.from_onnx(model), target="lpx")


def test_lrn_runs_on_lpx(rng):
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("LRN", ["c"], ["y"], size=5, alpha=1e-3, beta=0.75, bias=2.0)]
    model = make_model(nodes, [tensor_info("x", [1, 3, 9, 9])], [tensor_info("y", None)],
                       [weights(rng, "w", (10, 3, 3, 3))])
    x = rng.standard_normal((1, 3, 9, 9)).astype(np.float32) * 3
    compiled = lpx_tvm.compile(model, config="tiny")
    (out,), calls = _run_counted(compiled, x)
    assert_close(out, ort_run(model, {"x": x})[0], 1e-4)
    assert calls == 1 and not compiled.report.host_ops, compiled.report.summary()


def test_a_tvm_target_carries_the_lpx_target_it_was_made_from(rng):
    """``tvm.compile(mod, target=Target.parse("tiny", dtype="fp16").tvm_target())`` compiles for the tiny chip in
    fp16 (the plain "lpx" tag would mean tsp and fp32), through both lpx pipelines."""
    from lpx_tvm.codegen import Target

    model = host_op_between_model()
    x = rng.standard_normal((1, 3, 16, 16)).astype(np.float32)
    target = Target.parse("tiny", dtype="fp16")
    assert Target.from_tvm(target.tvm_target()) == target
    assert Target.from_tvm(tvm.target.Target("lpx")) == Target.parse()
    for kwargs in ({}, {"relax_pipeline": "lpx"}):
        runtime.clear()
        ex = tvm.compile(lpx_tvm.from_onnx(model), target=target.tvm_target(), **kwargs)
        before = runtime.total_offloaded_calls()
        out = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
        assert runtime.total_offloaded_calls() - before == 2, kwargs
        programs = [sim.program for sim in runtime._SIMULATORS.values()]
        assert [p.config_name for p in programs] == ["tiny", "tiny"]
        # fp16 storage: each program's fp32 input is rounded to fp16 by the host, and its inputs are fp16
        assert [p.inputs[0].dtype.name for p in programs] == ["F16", "F16"]
        assert_close(out, ort_run(model, {"x": x})[0], 2e-2)
