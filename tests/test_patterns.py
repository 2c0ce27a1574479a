"""Partitioning alone, in the style of TVM's test_cublas_partition_*: what lpx takes, and what stays on the host."""

import numpy as np
import pytest
import tvm
from onnx import helper, numpy_helper
from tvm import relax

import lpx_tvm
from lpx_tvm.patterns import CapacityWarning
from conftest import make_model, ort_run, run_on_lpx, tensor_info, weights


def _ops(func) -> list:
    found = []
    relax.analysis.post_order_visit(func, lambda e: found.append(e.op.name.removeprefix("relax."))
                                    if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) else None)
    return found


def partition(model, config="tiny", dtype="fp32"):
    """(ops inside lpx functions, ops left in the host functions, composite names)."""
    mod = lpx_tvm.partition_for_lpx(lpx_tvm.from_onnx(model), config, dtype)
    lpx, host, composites = [], [], []
    for _, func in mod.functions.items():
        if not isinstance(func, relax.Function):
            continue
        attrs = func.attrs or {}
        if attrs.get("Codegen") == "lpx":
            lpx += _ops(func)
            relax.analysis.post_order_visit(func, lambda e: composites.append(str(e.attrs["Composite"]))
                                            if isinstance(e, relax.Function) and e.attrs and "Composite" in e.attrs
                                            else None)
        elif attrs.get("Composite"):
            composites.append(str(attrs["Composite"]))
        else:
            host += [op for op in _ops(func) if op not in ("call_dps_packed",)]
    return lpx, host, composites


def one_op(op_type, shape=(2, 3, 8, 8), inits=(), inputs=None, opset=17, **attrs):
    names = ["x"] + [i.name for i in inits] if inputs is None else inputs
    return make_model([helper.make_node(op_type, names, ["y"], **attrs)], [tensor_info("x", list(shape))],
                      [tensor_info("y", None)], list(inits))


def test_conv_bias_relu_is_one_fused_composite(rng):
    model = make_model([helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
                        helper.make_node("Relu", ["c"], ["y"])], [tensor_info("x", [1, 3, 8, 8])],
                       [tensor_info("y", None)], [weights(rng, "w", (4, 3, 3, 3)), weights(rng, "b", (4,))])
    lpx, host, composites = partition(model)
    assert composites == ["lpx.conv2d_bias_relu"] and not host and set(lpx) >= {"nn.conv2d", "add", "nn.relu"}


def test_leaky_relu_and_hard_swish_offload_and_hard_swish_is_one_operator():
    lpx, host, composites = partition(one_op("LeakyRelu", alpha=0.3))
    assert lpx == ["nn.leakyrelu"] and not host
    lpx, host, composites = partition(one_op("HardSwish", opset=14))
    assert composites == ["lpx.hard_swish"] and not host


def test_a_hard_swish_lookalike_with_other_constants_is_not_the_idiom(rng):
    three = numpy_helper.from_array(np.float32(2.0), "three")  # x * clip(x + 2, 0, 6) / 6 is not HardSwish
    six = numpy_helper.from_array(np.float32(6.0), "six")
    lo, hi = (numpy_helper.from_array(np.float32(v), n) for v, n in ((0, "lo"), (6, "hi")))
    model = make_model([helper.make_node("Add", ["x", "three"], ["a"]), helper.make_node("Clip", ["a", "lo", "hi"], ["c"]),
                        helper.make_node("Div", ["c", "six"], ["d"]), helper.make_node("Mul", ["x", "d"], ["y"])],
                       [tensor_info("x", [2, 8])], [tensor_info("y", None)], [three, six, lo, hi])
    _, host, composites = partition(model)
    assert "lpx.hard_swish" not in composites and not host


def _erf_gelu(divide_by: float | None, half: float = 0.5, scale: float = 1 / np.sqrt(2)):
    """x · half · (1 + erf(x / divide_by)), or with ``divide_by=None`` erf(x · scale)."""
    consts = [numpy_helper.from_array(np.float32(v), n) for v, n in ((half, "half"), (1.0, "one"),
                                                                     (divide_by or scale, "k"))]
    scaled = helper.make_node("Div" if divide_by else "Mul", ["x", "k"], ["s"])
    return make_model([scaled, helper.make_node("Erf", ["s"], ["e"]), helper.make_node("Add", ["e", "one"], ["p"]),
                       helper.make_node("Mul", ["x", "half"], ["h"]), helper.make_node("Mul", ["h", "p"], ["y"])],
                      [tensor_info("x", [2, 8])], [tensor_info("y", None)], consts)


@pytest.mark.parametrize("divide_by", [np.sqrt(2), None])
def test_the_erf_gelu_as_exporters_write_it_is_one_operator(divide_by, rng):
    model = _erf_gelu(divide_by)
    lpx, host, composites = partition(model)
    assert composites == ["lpx.gelu_erf"] and not host
    x = rng.standard_normal((2, 8)).astype(np.float32) * 3
    compiled = lpx_tvm.compile(model, config="tiny")
    (program,) = (lpx_tvm.runtime_sim.decode(b) for b in compiled.programs.values())
    assert [i.opcode.name for i in program.instructions if i.unit.name == "VXM"] == ["GELU"]
    (out,) = run_on_lpx(compiled, [x], programs=1)  # one lpx call, nothing on the host
    np.testing.assert_allclose(out, ort_run(model, {"x": x})[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("divide_by, half", [(2.0, 0.5), (np.sqrt(2), 0.25)])
def test_an_erf_gelu_lookalike_with_other_constants_is_not_the_idiom(divide_by, half):
    _, host, composites = partition(_erf_gelu(divide_by, half))
    assert "lpx.gelu_erf" not in composites and not host


def test_batch_norm_in_training_mode_stays_on_the_host():
    stats = [numpy_helper.from_array(np.ones(3, np.float32), n) for n in ("g", "b", "m", "v")]
    model = make_model([helper.make_node("BatchNormalization", ["x", "g", "b", "m", "v"], ["y", "rm", "rv"],
                                         training_mode=1)], [tensor_info("x", [2, 3, 4, 4])],
                       [tensor_info("y", None), tensor_info("rm", None), tensor_info("rv", None)], stats)
    model.opset_import[0].version = 15
    lpx, host, _ = partition(model)
    assert "nn.batch_norm" in host and "nn.batch_norm" not in lpx


@pytest.mark.parametrize("op_type, attrs", [("AveragePool", {"kernel_shape": [3, 3], "ceil_mode": 1}),
                                            ("Conv", None)])
def test_attributes_lpx_does_not_implement_stay_on_the_host(rng, op_type, attrs):
    if op_type == "Conv":  # a weight computed at run time is not a weight lpx can keep resident
        model = make_model([helper.make_node("Conv", ["x", "w"], ["y"])],
                           [tensor_info("x", [1, 3, 8, 8]), tensor_info("w", [4, 3, 3, 3])], [tensor_info("y", None)],
                           [])
        lpx, host, _ = partition(model)
        assert "nn.conv2d" in host
        return
    lpx, host, _ = partition(one_op(op_type, **attrs))
    assert "nn.avg_pool2d" in host and "nn.avg_pool2d" not in lpx


def test_an_operator_too_big_for_sram_stays_on_the_host_with_a_warning():
    with pytest.warns(CapacityWarning, match="nn.relu with output \\[300, 2048\\] needs"):
        lpx, host, _ = partition(one_op("Relu", shape=(300, 2048)))
    assert host == ["nn.relu"] and not lpx


def test_int8_ops_without_an_int8_kernel_run_on_lpx_in_float(rng):
    model = make_model([helper.make_node("Gemm", ["x", "w"], ["h"], transB=1),
                        helper.make_node("Softmax", ["h"], ["y"], axis=-1)],
                       [tensor_info("x", [4, 16])], [tensor_info("y", [4, 8])], [weights(rng, "w", (8, 16))])
    qdq = lpx_tvm.quantize(model, [{"x": rng.standard_normal((4, 16)).astype(np.float32)}])
    lpx, host, _ = partition(qdq, dtype="int8")
    assert "nn.softmax" in lpx and "matmul" in lpx and not host


def test_one_dimensional_matmul_operands_offload(rng):
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["y"])], [tensor_info("x", [16])],
                       [tensor_info("y", None)], [weights(rng, "w", (3, 16, 5))])
    lpx, host, _ = partition(model)
    assert "matmul" in lpx and not host


def test_dynamic_and_empty_shapes_stay_on_the_host():
    model = one_op("Relu", shape=("N", 8))
    lpx, host, _ = partition(model)
    assert host == ["nn.relu"] and not lpx


def test_a_graph_tvm_cannot_merge_is_offloaded_op_by_op_with_a_warning(rng):
    """Reshape with allowzero=1 of a zero-size input leaves a match_cast that MergeCompositeFunctions rejects."""
    model = make_model([helper.make_node("Reshape", ["x", "s"], ["r"], allowzero=1), helper.make_node("Relu", ["r"], ["y"])],
                       [tensor_info("x", [0, 4])], [tensor_info("y", None)],
                       [numpy_helper.from_array(np.array([4, 0], np.int64), "s")])
    model.opset_import[0].version = 14
    with pytest.warns(lpx_tvm.patterns.PartitionWarning, match="could not merge"):
        lpx, host, _ = partition(model)
    assert "nn.relu" in host  # a symbolic (zero-size) tensor cannot run on lpx


@pytest.mark.parametrize("starts, ends, axes, steps, stays_on_host", [
    ([2, -4], [8, 100], [1, 2], [2, 1], False),  # a step of 2, a negative start, an end past the axis
    ([7], [0], [1], [-1], True),  # a negative step: the SLICE instruction steps forward only
])
def test_a_slice_runs_on_lpx_unless_it_steps_backwards(rng, starts, ends, axes, steps, stays_on_host):
    """ONNX Slice (Relax strided_slice) is one SLICE on the switch unit: it stayed on the host (17 of them in a
    Hugging Face Llama), cutting the model into programs."""
    from conftest import run_on_lpx

    inits = [numpy_helper.from_array(np.array(v, np.int64), n)
             for n, v in (("s", starts), ("e", ends), ("a", axes), ("st", steps))]
    model = make_model([helper.make_node("Slice", ["x", "s", "e", "a", "st"], ["t"]),
                        helper.make_node("Relu", ["t"], ["y"])],
                       [tensor_info("x", [4, 8, 6])], [tensor_info("y", None)], inits)
    lpx, host, _ = partition(model)
    assert ("strided_slice" in host) == stays_on_host and ("strided_slice" in lpx) != stays_on_host
    compiled = lpx_tvm.compile(model, config="tiny")
    x = rng.standard_normal((4, 8, 6)).astype(np.float32)
    (out,) = run_on_lpx(compiled, [x], host_ops={"relax.strided_slice": 1} if stays_on_host else None)
    np.testing.assert_array_equal(out, ort_run(model, {"x": x})[0])


def test_identical_regions_compile_once_and_run_at_each_place(rng):
    """Three MatMul+ReLU regions with the same weight, Floor (host) between them: one lpx function and one
    program, called three times a run, agreeing with ONNX Runtime."""
    from lpx_tvm.runtime import total_offloaded_calls

    nodes, x = [], "x"
    for i in range(3):
        nodes += [helper.make_node("MatMul", [x, "w"], [f"a{i}"]), helper.make_node("Relu", [f"a{i}"], [f"b{i}"])]
        x = f"b{i}"
        if i < 2:
            nodes.append(helper.make_node("Floor", [x], [f"c{i}"]))
            x = f"c{i}"
    nodes[-1].output[0] = "y"
    model = make_model(nodes, [tensor_info("x", [4, 16])], [tensor_info("y", [4, 16])], [weights(rng, "w", (16, 16))])
    compiled = lpx_tvm.compile(model, config="tiny")
    assert len(compiled.programs) == 1
    assert compiled.report.lpx_functions == 1 and dict(compiled.report.host_ops) == {"relax.floor": 2}
    feed = (rng.standard_normal((4, 16)) * 4).astype(np.float32)
    before = total_offloaded_calls()
    (out,) = compiled(feed)
    assert total_offloaded_calls() - before == 3
    np.testing.assert_allclose(out, ort_run(model, {"x": feed})[0], rtol=1e-5, atol=1e-5)
