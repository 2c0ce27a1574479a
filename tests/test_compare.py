"""``lpx-tvm compare`` (lpx_tvm/app/tools/compare.py): which layer outputs it watches, the figures it gives for each
(cosine, SQNR, max abs error, share within one step), and the layer-by-layer comparison of lpx with ONNX
Runtime, through the Python API and the command line."""

import json
import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import lpx_tvm
from conftest import make_model, ort_run, run_on_lpx, tensor_info, weights
from lpx_tvm.app.tools.compare import _metrics, compare, exposed, watched_tensors


# ---- _metrics, on arrays worked by hand --------------------------------------------------------------------
def test_metrics_of_a_reference_plus_noise_orthogonal_to_it():
    """ref = [3, 4] (signal 3² + 4² = 25), noise = [0.4, -0.3] (energy 0.16 + 0.09 = 0.25; orthogonal to ref:
    3 × 0.4 − 4 × 0.3 = 0), ours = ref + noise = [3.4, 3.7]. SQNR = 10 log10(25 / 0.25) = 20 dB; max abs error
    0.4; cosine = ours·ref / (|ours| |ref|) = (10.2 + 14.8) / (√25.25 × 5) = 5 / √25.25 = 1 / √1.01. A float
    reference has no integer figure."""
    ref = np.array([3.0, 4.0])
    got = _metrics(ref + np.array([0.4, -0.3]), ref)
    assert set(got) == {"cosine", "sqnr_db", "max_abs_err"}
    assert got["cosine"] == pytest.approx(1 / math.sqrt(1.01), rel=1e-12)
    assert got["sqnr_db"] == pytest.approx(20.0, rel=1e-12)
    assert got["max_abs_err"] == pytest.approx(0.4, rel=1e-12)


def test_metrics_of_an_exact_copy_and_of_a_sign_flip():
    """An exact copy of [0.5, −1.5, 3] has no noise: cosine 1, SQNR infinite, max abs error 0. The negation
    −ref of ref = [1, −2, 2] (signal 1 + 4 + 4 = 9) has noise (2 ref)², energy 4 × 9 = 36: SQNR =
    10 log10(9 / 36) = 10 log10(0.25) = −6.0206 dB, cosine −1, max abs error 2 × 2 = 4. float32 inputs are
    measured in float64 (0.5, 1.5, 3 and 1, 2 are exact in float32)."""
    same = np.array([0.5, -1.5, 3.0], np.float32)
    exact = _metrics(same.copy(), same)
    assert exact["cosine"] == pytest.approx(1.0, abs=1e-15)
    assert exact["sqnr_db"] == math.inf
    assert exact["max_abs_err"] == 0.0
    ref = np.array([1.0, -2.0, 2.0], np.float32)
    flipped = _metrics(-ref, ref)
    assert flipped["cosine"] == pytest.approx(-1.0, abs=1e-15)
    assert flipped["sqnr_db"] == pytest.approx(-6.020599913279624, rel=1e-12)
    assert flipped["max_abs_err"] == 4.0


def test_metrics_of_integers_count_values_within_one_step_without_wrapping():
    """int8 ref = [10, −3, 0, 127, −128], ours = [10, −2, 2, 126, 127]: the differences are 0, 1, 2, 1 and 255
    (not the −1 that int8 arithmetic would wrap 127 − (−128) to), so 3 of 5 values are within one step: 60%;
    max abs error 255. Signal 100 + 9 + 0 + 16129 + 16384 = 32622, noise 0 + 1 + 4 + 1 + 65025 = 65031; ours·ref
    = 100 + 6 + 0 + 16002 − 16256 = −148 and |ours|² = 100 + 4 + 4 + 15876 + 16129 = 32113."""
    ref = np.array([10, -3, 0, 127, -128], np.int8)
    ours = np.array([10, -2, 2, 126, 127], np.int8)
    got = _metrics(ours, ref)
    assert got["within_one_step_pct"] == pytest.approx(60.0, rel=1e-12)
    assert got["max_abs_err"] == 255.0
    assert got["sqnr_db"] == pytest.approx(10 * math.log10(32622 / 65031), rel=1e-12)
    assert got["cosine"] == pytest.approx(-148 / math.sqrt(32113 * 32622), rel=1e-12)


# ---- watched_tensors and exposed, on graphs built by hand --------------------------------------------------
def _graph_of_every_kind():
    """x [4, 16] ─► Gemm h ─► Relu r ─► Reshape s (by a Constant node's shape) ─► MatMul m (by w2 = w2raw × 2,
    a node of weights only) ─► Sigmoid g (a graph output) ─► Mul y = g × m (a graph output); and a Transpose
    of r, t, that goes nowhere else."""
    rng = np.random.default_rng(0)
    inits = [weights(rng, "w1", (8, 16)), weights(rng, "b1", (8,)), weights(rng, "w2raw", (16, 4)),
             numpy_helper.from_array(np.array(2.0, np.float32), "two")]
    shape = numpy_helper.from_array(np.array([2, 16], np.int64))
    nodes = [helper.make_node("Constant", [], ["shape"], value=shape),
             helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], transB=1),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Transpose", ["r"], ["t"]),
             helper.make_node("Reshape", ["r", "shape"], ["s"]),
             helper.make_node("Mul", ["w2raw", "two"], ["w2"]),
             helper.make_node("MatMul", ["s", "w2"], ["m"]),
             helper.make_node("Sigmoid", ["m"], ["g"]),
             helper.make_node("Mul", ["g", "m"], ["y"])]
    return make_model(nodes, [tensor_info("x", [4, 16])], [tensor_info("g", [2, 4]), tensor_info("y", [2, 4])],
                      inits)


def test_watched_tensors_of_a_float_model():
    """In ``_graph_of_every_kind``: h (Gemm), r (Relu) and m (MatMul) are watched, in graph order; skipped are
    the Constant's shape, the Transpose t and the Reshape s (ops that move or make data), w2 (its inputs are
    all initializers: a weight) and g and y (graph outputs, compared as outputs)."""
    assert watched_tensors(_graph_of_every_kind()) == ["h", "r", "m"]


def _qdq_model():
    """A QDQ graph: x ─► Q xq ─► DQ ─► MatMul (by DQ of the int8 initializer wq) m ─► Q mq ─► DQ ─► Relu r ─►
    Q rq ─► DQ ─► MatMul (by DQ of Q of the float initializer wf: wfq, weights only) y ─► Q yq (the graph
    output)."""
    rng = np.random.default_rng(1)

    def scale(name, value):
        return [numpy_helper.from_array(np.array(value, np.float32), f"s_{name}"),
                numpy_helper.from_array(np.array(0, np.int8), f"z_{name}")]

    inits = [numpy_helper.from_array(rng.integers(-100, 100, (16, 8)).astype(np.int8), "wq"),
             weights(rng, "wf", (8, 4))]
    for name, value in [("x", 0.05), ("w", 0.01), ("m", 0.1), ("r", 0.1), ("wf", 0.01), ("y", 0.2)]:
        inits += scale(name, value)
    def q(src, dst, s):
        return helper.make_node("QuantizeLinear", [src, f"s_{s}", f"z_{s}"], [dst])

    def dq(src, dst, s):
        return helper.make_node("DequantizeLinear", [src, f"s_{s}", f"z_{s}"], [dst])

    nodes = [q("x", "xq", "x"), dq("xq", "xd", "x"), dq("wq", "wd", "w"),
             helper.make_node("MatMul", ["xd", "wd"], ["m"]), q("m", "mq", "m"), dq("mq", "md", "m"),
             helper.make_node("Relu", ["md"], ["r"]), q("r", "rq", "r"), dq("rq", "rd", "r"),
             q("wf", "wfq", "wf"), dq("wfq", "wfd", "wf"), helper.make_node("MatMul", ["rd", "wfd"], ["y"]),
             q("y", "yq", "y")]
    return make_model(nodes, [tensor_info("x", [4, 16])],
                      [helper.make_tensor_value_info("yq", TensorProto.INT8, [4, 4])], inits)


def test_watched_tensors_of_a_qdq_model_are_its_activations_quantize_outputs():
    """In ``_qdq_model`` only QuantizeLinear outputs are watched: xq, mq, rq (the activations, in graph order);
    wfq (QuantizeLinear of weights only) and yq (the graph output) are not, nor any MatMul, Relu or
    DequantizeLinear output. The graph is a valid model (the ONNX checker passes it)."""
    model = _qdq_model()
    onnx.checker.check_model(model, full_check=True)
    assert watched_tensors(model) == ["xq", "mq", "rq"]


def _small_model(seed=0):
    """x [4, 16] ─► Gemm h [4, 8] ─► Relu r [4, 8] ─► Reshape s [2, 16] ─► MatMul m [2, 4] (by w2 = w2raw × 2, a
    node of weights only) ─► Tanh y [2, 4]: three layers to watch (h, r, m), all of them lpx ops."""
    rng = np.random.default_rng(seed)
    inits = [weights(rng, "w1", (8, 16)), weights(rng, "b1", (8,)), weights(rng, "w2raw", (16, 4)),
             numpy_helper.from_array(np.array(2.0, np.float32), "two"),
             numpy_helper.from_array(np.array([2, 16], np.int64), "shape")]
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], transB=1),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Reshape", ["r", "shape"], ["s"]),
             helper.make_node("Mul", ["w2raw", "two"], ["w2"]),
             helper.make_node("MatMul", ["s", "w2"], ["m"]),
             helper.make_node("Tanh", ["m"], ["y"])]
    return make_model(nodes, [tensor_info("x", [4, 16])], [tensor_info("y", [2, 4])], inits)


WATCHED = ["h", "r", "m"]
SHAPES = {"y": [2, 4], "h": [4, 8], "r": [4, 8], "m": [2, 4]}  # by hand, from _small_model's docstring


def _wide_by_hand():
    """``_small_model`` with h, r and m added as outputs, their float types and shapes written by hand."""
    model = _small_model()
    model.graph.output.extend([tensor_info(name, SHAPES[name]) for name in WATCHED])
    return model


def _cosine(a, b):
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_exposed_adds_the_watched_tensors_as_outputs_with_their_shapes():
    """``exposed(model, [h, r, m])`` keeps the output y first and appends h, r, m as float outputs of the
    shapes worked by hand (h, r [4, 8]; m [2, 4]); the model it was given is left with its one output."""
    model = _small_model()
    wide = exposed(model, WATCHED)
    got = [(o.name, o.type.tensor_type.elem_type, [d.dim_value for d in o.type.tensor_type.shape.dim])
           for o in wide.graph.output]
    assert got == [(name, TensorProto.FLOAT, SHAPES[name]) for name in ["y"] + WATCHED]
    assert [o.name for o in model.graph.output] == ["y"]


def test_compare_reports_every_watched_layer_agreeing_with_onnx_runtime_and_run_on_lpx():
    """``compare`` of ``_small_model`` on tiny with fixed inputs reports h (Gemm), r (Relu), m (MatMul), in
    that order, and y as the output. Independently: the wide model written by hand, compiled for tiny, is one
    lpx program with no host ops, and its run (one lpx call) agrees with ONNX Runtime's run of the same wide
    model on every layer at cosine ≥ 0.9999 (cosines by numpy here); compare's cosine and max abs error for
    each layer are those figures, and compare itself makes exactly one lpx call (the one program)."""
    from lpx_tvm.runtime import total_offloaded_calls

    x = np.random.default_rng(7).standard_normal((4, 16)).astype(np.float32)
    wide = _wide_by_hand()
    reference = ort_run(wide, {"x": x})
    compiled = lpx_tvm.compile(wide, config="tiny")
    ours = run_on_lpx(compiled, [x], programs=1)
    mine = {name: (_cosine(o, r), float(np.abs(np.asarray(o, np.float64) - r).max()))
            for name, o, r in zip(["y"] + WATCHED, ours, reference)}
    for name, (cosine, _) in mine.items():
        assert cosine >= 0.9999, f"{name}: cosine {cosine}"

    before = total_offloaded_calls()
    report = compare(_small_model(), config="tiny", feeds={"x": x})
    assert total_offloaded_calls() - before == 1
    assert [(r["tensor"], r["op"]) for r in report["layers"]] == [("h", "Gemm"), ("r", "Relu"), ("m", "MatMul")]
    for record in report["layers"]:
        cosine, err = mine[record["tensor"]]
        assert record["cosine"] == pytest.approx(cosine, abs=1e-9), record
        assert record["max_abs_err"] == pytest.approx(err, rel=1e-5, abs=1e-7), record
    assert report["first_below"] is None
    assert [o["tensor"] for o in report["outputs"]] == ["y"]
    assert report["outputs"][0]["cosine"] == pytest.approx(mine["y"][0], abs=1e-9)


@pytest.mark.parametrize("bad", [1.5, -1.01])
def test_compare_rejects_a_min_cosine_that_is_not_a_cosine(bad):
    """A cosine lies in [−1, 1]: 1.5 and −1.01 are refused with a ValueError naming the value, before any
    work."""
    with pytest.raises(ValueError, match=f"got {bad}"):
        compare(_small_model(), config="tiny", min_cosine=bad)


def test_cli_compare_prints_a_row_per_watched_tensor(tmp_path, capsys):
    """``lpx-tvm compare small.onnx --config tiny --json r.json`` exits 0; its table has one row per watched
    tensor of ``_small_model``: #0 h Gemm, #1 r Relu, #2 m MatMul (the names and ops by hand); every layer is
    at cosine ≥ 0.999 (lpx computes these fp32 layers as ONNX Runtime does, as the test above shows), the
    output y is named, and the JSON file lists the same three layers for config tiny."""
    from lpx_tvm.app.cli import main

    path = tmp_path / "small.onnx"
    onnx.save(_small_model(), path)
    code = main(["compare", str(path), "--config", "tiny", "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in out.splitlines()
            if line.startswith("|") and not line.startswith("|--")]
    assert rows[0][:3] == ["#", "tensor", "op"]
    assert [row[:3] for row in rows[1:]] == [["0", "h", "Gemm"], ["1", "r", "Relu"], ["2", "m", "MatMul"]]
    assert "every layer at cosine >= 0.999" in out
    assert "outputs: y: cosine" in out
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["config"] == "tiny"
    assert [r["tensor"] for r in saved["layers"]] == WATCHED


def test_two_all_zero_tensors_agree_exactly():
    """A layer that is all zeros on both sides (a ReLU of negatives) agrees exactly: cosine 1, no error, an
    SQNR of inf (no noise); zeros against a result that is not are cosine 0 and -inf dB, without a warning."""
    from lpx_tvm.app.tools.compare import _metrics

    zeros = np.zeros(5, np.float32)
    assert _metrics(zeros, zeros) == {"cosine": 1.0, "sqnr_db": float("inf"), "max_abs_err": 0.0}
    other = _metrics(np.ones(5, np.float32), zeros)
    assert (other["cosine"], other["sqnr_db"], other["max_abs_err"]) == (0.0, float("-inf"), 1.0)


def test_a_chain_of_weight_only_nodes_is_a_weight_not_a_layer():
    """x ─► MatMul(x, Neg(Mul(w, 2))) y: the Mul and the Neg compute from the weight alone (before, the Neg's
    output was watched as a layer, since one of its inputs is not an initializer); the MatMul m is watched."""
    rng = np.random.default_rng(0)
    model = make_model([helper.make_node("Mul", ["w", "two"], ["w2"]), helper.make_node("Neg", ["w2"], ["w3"]),
                        helper.make_node("MatMul", ["x", "w3"], ["m"]), helper.make_node("Relu", ["m"], ["y"])],
                       [tensor_info("x", [2, 4])], [tensor_info("y", [2, 4])],
                       [weights(rng, "w", (4, 4)), numpy_helper.from_array(np.array(2.0, np.float32), "two")])
    assert watched_tensors(model) == ["m"]
