"""Regressions outside users found (issue 50): each test failed before its fix."""

import numpy as np
import onnx
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
    from lpx_tvm.kernels import window as window_kernels

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
    from lpx_tvm.kernels import window as window_kernels
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
    from lpx_tvm.kernels import window as window_kernels

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


# ---------------------------------------------------------------------------
# a decode step exported with fixed lengths
# ---------------------------------------------------------------------------
def _fixed_length_decode_step(path, past=16, heads=2, head_dim=4, vocab=32):
    """A one-layer decode step in Hugging Face form traced at one token over ``past`` cache slots, as an
    export without dynamic shapes writes it: every length fixed, and its mask a constant of that length."""
    rng = np.random.default_rng(0)
    width, total = heads * head_dim, past + 1

    def init(name, array):
        return numpy_helper.from_array(np.asarray(array), name)

    def value(name, dtype, shape):
        return helper.make_tensor_value_info(name, dtype, shape)

    inits = [init("embed", (rng.standard_normal((vocab, width)) * 0.3).astype(np.float32)),
             init("head", (rng.standard_normal((width, vocab)) * 0.3).astype(np.float32)),
             init("heads_shape", np.array([1, 1, heads, head_dim], np.int64)),
             init("flat_shape", np.array([1, 1, width], np.int64)),
             init("causal", np.zeros((1, 1, 1, total), np.float32)), init("mask_axes", np.array([1, 2], np.int64))]
    nodes = [helper.make_node("Gather", ["embed", "input_ids"], ["x"]),
             helper.make_node("Reshape", ["x", "heads_shape"], ["x4"]),
             helper.make_node("Transpose", ["x4"], ["q"], perm=[0, 2, 1, 3]),
             helper.make_node("Concat", ["past_key_values.0.key", "q"], ["present.0.key"], axis=2),
             helper.make_node("Concat", ["past_key_values.0.value", "q"], ["present.0.value"], axis=2),
             helper.make_node("Transpose", ["present.0.key"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["scores"]),
             helper.make_node("Cast", ["attention_mask"], ["mask"], to=TensorProto.FLOAT),
             helper.make_node("Unsqueeze", ["mask", "mask_axes"], ["mask4"]),
             helper.make_node("Add", ["mask4", "causal"], ["bias"]),
             helper.make_node("Add", ["scores", "bias"], ["masked"]),
             helper.make_node("Softmax", ["masked"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "present.0.value"], ["o"]),
             helper.make_node("Transpose", ["o"], ["o2"], perm=[0, 2, 1, 3]),
             helper.make_node("Reshape", ["o2", "flat_shape"], ["h"]),
             helper.make_node("MatMul", ["h", "head"], ["logits"])]
    cache = [1, heads, past, head_dim]
    inputs = [value("input_ids", TensorProto.INT64, [1, 1]), value("attention_mask", TensorProto.INT64, [1, total]),
              value("position_ids", TensorProto.INT64, [1, 1]),
              value("past_key_values.0.key", TensorProto.FLOAT, cache),
              value("past_key_values.0.value", TensorProto.FLOAT, cache)]
    outputs = [value("logits", TensorProto.FLOAT, [1, 1, vocab]),
               value("present.0.key", TensorProto.FLOAT, [1, heads, total, head_dim]),
               value("present.0.value", TensorProto.FLOAT, [1, heads, total, head_dim])]
    model = helper.make_model(helper.make_graph(nodes, "decode", inputs, outputs, inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return model


def test_a_decode_step_with_a_fixed_past_is_refused_in_one_line_naming_the_axis(tmp_path):
    from lpx_tvm.app.llm.generate import generate

    path = tmp_path / "decode.onnx"
    model = _fixed_length_decode_step(path)
    # the graph is sound as exported: ONNX Runtime runs it at its own lengths
    rng = np.random.default_rng(1)
    cache = rng.standard_normal((1, 2, 16, 4)).astype(np.float32)
    (logits, key, _) = ort_reference(model, {"input_ids": np.array([[3]]), "attention_mask": np.ones((1, 17), np.int64),
                                             "position_ids": np.array([[16]]), "past_key_values.0.key": cache,
                                             "past_key_values.0.value": cache})
    assert logits.shape == (1, 1, 32) and key.shape == (1, 2, 17, 4)
    with pytest.raises(ValueError) as refused:
        generate(path, tokens=2)
    message = str(refused.value)
    assert "\n" not in message
    assert "'past_key_values.0.key' has its past length (axis 2) fixed at 16 (and 4 more past or sequence axes " \
           "too)" in message
    assert "dynamic_shapes" in message and "symbolic" in message


def test_a_decode_step_with_a_fixed_past_alone_names_the_cache_axis(tmp_path):
    """Token inputs free, the cache fixed at 16: the cache's axis is the one named."""
    from lpx_tvm.app.llm.generate import generate

    path = tmp_path / "decode.onnx"
    model = _fixed_length_decode_step(path)
    for value_info in model.graph.input:
        dims = value_info.type.tensor_type.shape.dim
        if value_info.name in ("input_ids", "attention_mask", "position_ids"):
            dims[1].dim_param = "sequence" if value_info.name != "attention_mask" else "total"
    onnx.save(model, str(path))
    with pytest.raises(ValueError, match=r"^[^\n]*'past_key_values\.0\.key' has its past length \(axis 2\) fixed at "
                                         r"16 \(and 1 more past or sequence axes too\); lpx needs the past and "
                                         r"sequence lengths symbolic[^\n]*dynamic_shapes[^\n]*$"):
        generate(path, tokens=2)


def test_pinning_an_axis_the_model_fixes_names_it_when_the_fold_fails(tmp_path):
    """Below generate: the frontend pinned the cache to 1 slot over a graph traced at 16; ONNX Runtime's
    'Incompatible dimensions' alone did not say which pin broke it."""
    from lpx_tvm.frontend import FrontendError

    model = _fixed_length_decode_step(tmp_path / "decode.onnx")
    model.graph.node.append(helper.make_node("Shape", ["present.0.key"], ["shape"]))  # a shape computation
    model.graph.output.append(helper.make_tensor_value_info("shape", TensorProto.INT64, [4]))
    shapes = {"input_ids": [1, 1], "attention_mask": [1, 2], "position_ids": [1, 1],
              "past_key_values.0.key": [1, 2, 1, 4], "past_key_values.0.value": [1, 2, 1, 4]}
    with pytest.raises(FrontendError, match=r"^model: cannot fold its shape computations: input 'attention_mask' has "
                                            r"axis 1 fixed at 17, pinned to 2 \(and 2 more fixed axes pinned to "
                                            r"other values\); export that axis dynamic \(torch\.onnx\.export\(\.\.\., "
                                            r"dynamic_shapes=\.\.\.\)\) or pin it to 17 \(ONNX Runtime: [^\n]*\)$"):
        lpx_tvm.from_onnx(model, input_shapes=shapes)


def test_generate_help_says_the_lengths_must_be_symbolic(capsys):
    from lpx_tvm.app.cli import main

    with pytest.raises(SystemExit) as done:
        main(["generate", "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the help to the terminal
    assert "its past and sequence lengths must be symbolic, not fixed (export them dynamic: torch.onnx.export " \
           "dynamic_shapes, as optimum does)" in text


# ---------------------------------------------------------------------------
# folding shape computations without the weights
# ---------------------------------------------------------------------------
def _reshaped_product(rng, rows=4, width=16, out=64):
    """y = reshape(x, [batch * rows, width]) @ w, the reshape's target computed from x's shape at run time
    (as exporters write it), so the frontend folds it with ONNX Runtime; ``w`` a weight of 4 KiB."""
    w = (rng.standard_normal((width, out)) * 0.3).astype(np.float32)
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array([0], np.int64), "zero"),
             numpy_helper.from_array(np.array([rows], np.int64), "rows"),
             numpy_helper.from_array(np.array([width], np.int64), "width")]
    nodes = [helper.make_node("Shape", ["x"], ["shape"]),
             helper.make_node("Gather", ["shape", "zero"], ["batch"], axis=0),
             helper.make_node("Mul", ["batch", "rows"], ["flat"]),
             helper.make_node("Concat", ["flat", "width"], ["target"], axis=0),
             helper.make_node("Reshape", ["x", "target"], ["x2"]),
             helper.make_node("MatMul", ["x2", "w"], ["y"])]
    graph = helper.make_graph(nodes, "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", rows, width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), w


@pytest.mark.parametrize("external", [False, True])
def test_folding_hands_onnx_runtime_the_graph_without_its_weights(rng, tmp_path, monkeypatch, external):
    """What ONNX Runtime is given to fold holds neither the weight's bytes nor room for them (protobuf stops at
    2 GB, and a copy would cost their size), whether the weights are inside the model or external data it
    loaded from its file; the model then runs on lpx as ONNX Runtime runs it."""
    import onnxruntime as ort

    model, w = _reshaped_product(rng)
    if external:  # as a large model is stored: the weights beside the graph, loaded with it
        onnx.save_model(model, str(tmp_path / "m.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                        location="m.data", size_threshold=1024)
        model = onnx.load(str(tmp_path / "m.onnx"))
        assert w.tobytes() == model.graph.initializer[0].raw_data  # (loaded)
    given = []
    real = ort.InferenceSession

    def recorded(source, *args, **kwargs):
        given.append(source)
        return real(source, *args, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", recorded)
    compiled = lpx_tvm.compile(model, input_shapes={"x": [2, 4, 16]})
    monkeypatch.setattr(ort, "InferenceSession", real)
    (folded,) = given
    assert isinstance(folded, bytes) and w.tobytes() not in folded and len(folded) < w.nbytes // 4
    x = rng.standard_normal((2, 4, 16)).astype(np.float32)
    (out,) = run_on_lpx(compiled, [x], programs=1)
    assert_close(out, x.reshape(8, 16) @ w, 1e-5)
    assert_close(out, ort_reference(model, {"x": x})[0], 1e-5)


def test_folding_a_graph_whose_weights_are_held_apart(rng, tmp_path):
    """Weights held as external data not loaded, given as arrays (``weights=``): the graph's shape
    computations are folded too (it was refused: folding serialised the weights, which were not there)."""
    model, w = _reshaped_product(rng)
    onnx.save_model(model, str(tmp_path / "m.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="m.data", size_threshold=1024)
    graph = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False)
    from lpx_tvm.runtime_sim.program import aligned_copy

    compiled = lpx_tvm.compile(graph, input_shapes={"x": [2, 4, 16]}, weights={"w": aligned_copy(w)})
    x = rng.standard_normal((2, 4, 16)).astype(np.float32)
    (out,) = run_on_lpx(compiled, [x], programs=1)
    assert_close(out, x.reshape(8, 16) @ w, 1e-5)


@pytest.mark.slow
def test_a_decoder_past_2_gb_generates_equal_to_ort_near_its_weights_in_memory():
    """scripts/large_decoder.py: a Hugging Face Llama of 2.2 GB (fp32, seeded random weights) exported by
    torch.onnx with its weights as external data, through ``generate`` and ``compile``, each in a process of
    its own. It failed with "cannot fold its shape computations (Failed to serialize proto)" at 21.5 GB; then
    generate peaked at 8.2 GB (3.7 x its weights). Now the weights are mapped from their file and read in place
    by ONNX Runtime, TVM and the programs (the head's streamed column blocks too); ``compile -o`` peaked at
    8.3 GB until the library carried its large constants in a section of its own (lpx_tvm.library). About 5 min
    here."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "large_decoder.py"
    done = subprocess.run([sys.executable, str(script), "--gb", "2.2", "--tokens", "2", "--compile", "library"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    weights = report["weights_gb"]
    assert weights > 2.147483648  # past protobuf's limit of 2 GiB
    generate = report["generate"]
    assert generate["tokens"] == generate["reference_tokens"]
    assert len(generate["tokens"]) == 3  # the prefill's token and two steps'
    assert generate["lpx_programs"] == {"prefill": 1, "decode": 1}
    # within 1.5 x the weights, plus 1 GB for Python, TVM, ONNX Runtime and torch's libraries
    assert generate["peak_gb"] <= 1.5 * weights + 1.0, generate
    library = report["compile_library"]
    assert library["returncode"] == 0
    assert library["peak_gb"] <= 1.5 * weights + 1.0, library
    run = report["run_library"]  # the library reloaded, one decode step: ORT's logits and token
    assert run["lpx_calls"] == 1
    assert run["same_token"] and run["max_abs_err"] < 1e-3, run

