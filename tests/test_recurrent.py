"""ONNX LSTM and GRU, which TVM's importer lacks, unrolled over their sequence (lpx_tvm.recurrent): each
variant against ONNX Runtime's own operator, with its products and gates on lpx."""

import copy

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import lpx_tvm
from conftest import make_model, ort_run, run_on_lpx, tensor_info

SEQ, BATCH, INPUT, HIDDEN = 5, 2, 6, 4


def _recurrent_model(kind, rng, direction="forward", layout=0, initial=False, outputs=("Y", "Y_h"), **attrs):
    gates = {"LSTM": 4, "GRU": 3}[kind]
    dirs = 2 if direction == "bidirectional" else 1
    w = numpy_helper.from_array(rng.normal(0, 0.5, (dirs, gates * HIDDEN, INPUT)).astype(np.float32), "W")
    r = numpy_helper.from_array(rng.normal(0, 0.5, (dirs, gates * HIDDEN, HIDDEN)).astype(np.float32), "R")
    b = numpy_helper.from_array(rng.normal(0, 0.3, (dirs, 2 * gates * HIDDEN)).astype(np.float32), "B")
    x_shape = [SEQ, BATCH, INPUT] if layout == 0 else [BATCH, SEQ, INPUT]
    state = [dirs, BATCH, HIDDEN] if layout == 0 else [BATCH, dirs, HIDDEN]
    inputs = [tensor_info("x", x_shape)]
    node_inputs = ["x", "W", "R", "B", ""]
    if initial:
        inputs.append(tensor_info("h0", state))
        node_inputs.append("h0")
        if kind == "LSTM":
            inputs.append(tensor_info("c0", state))
            node_inputs.append("c0")
    y_shape = [SEQ, dirs, BATCH, HIDDEN] if layout == 0 else [BATCH, SEQ, dirs, HIDDEN]
    shapes = {"Y": y_shape, "Y_h": state, "Y_c": state}
    node = helper.make_node(kind, node_inputs, list(outputs), hidden_size=HIDDEN, direction=direction,
                            layout=layout, **attrs)
    return make_model([node], inputs, [tensor_info(n, shapes[n]) for n in outputs if n], [w, r, b])


CASES = [
    ("LSTM", {}), ("LSTM", {"direction": "reverse"}), ("LSTM", {"direction": "bidirectional"}),
    ("LSTM", {"layout": 1, "initial": True, "outputs": ("Y", "Y_h", "Y_c")}),
    ("LSTM", {"outputs": ("", "Y_h")}),
    ("GRU", {}), ("GRU", {"linear_before_reset": 1}), ("GRU", {"direction": "bidirectional", "initial": True}),
    ("GRU", {"layout": 1, "linear_before_reset": 1, "initial": True}),
]


def _ort_reference(model, feeds, layout: int) -> list:
    """ORT's own operator; ORT takes only layout 0, so a batch-first model runs as its layout-0 twin on
    transposed inputs, its outputs transposed back."""
    if layout == 0:
        return ort_run(model, feeds)
    twin = copy.deepcopy(model)
    (node,) = twin.graph.node
    for attr in node.attribute:
        if attr.name == "layout":
            attr.i = 0
    del twin.graph.output[:]
    twin.graph.output.extend(helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in node.output if n)
    swapped = {k: np.swapaxes(v, 0, 1) for k, v in feeds.items()}  # [B, S, I] ─► [S, B, I]; [B, D, H] ─► [D, B, H]
    del twin.graph.input[:]
    twin.graph.input.extend(tensor_info(k, list(v.shape)) for k, v in swapped.items())
    outs = ort_run(twin, swapped)
    return [np.transpose(o, (2, 0, 1, 3)) if o.ndim == 4 else np.swapaxes(o, 0, 1) for o in outs]


@pytest.mark.parametrize("kind, options", CASES, ids=lambda c: str(c))
def test_an_unrolled_recurrent_layer_matches_onnx_runtime_and_runs_on_lpx(rng, kind, options):
    model = _recurrent_model(kind, rng, **options)
    feeds = {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
             for i in model.graph.input}
    compiled = lpx_tvm.compile(model, config="tsp")
    assert compiled.report.offloaded_pct == 100.0, compiled.report.summary()
    outputs = run_on_lpx(compiled, list(feeds.values()), programs=1)
    for got, want in zip(outputs, _ort_reference(model, feeds, options.get("layout", 0)), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("attrs, inputs, message", [
    ({"clip": 3.0}, [], "clip is not implemented"),
    ({"activations": ["Relu", "Tanh", "Tanh"]}, [], r"activations \['Relu', 'Tanh', 'Tanh'\] are not implemented"),
    ({}, ["", "", "", "P"], r"peepholes \(input P\) are not implemented"),
])
def test_what_the_unrolling_does_not_implement_is_named(rng, attrs, inputs, message):
    w = numpy_helper.from_array(np.zeros((1, 4 * HIDDEN, INPUT), np.float32), "W")
    r = numpy_helper.from_array(np.zeros((1, 4 * HIDDEN, HIDDEN), np.float32), "R")
    p = numpy_helper.from_array(np.zeros((1, 3 * HIDDEN), np.float32), "P")
    node = helper.make_node("LSTM", ["x", "W", "R", "", *inputs], ["Y"], hidden_size=HIDDEN, name="lstm1", **attrs)
    model = make_model([node], [tensor_info("x", [SEQ, BATCH, INPUT])], [tensor_info("Y", [SEQ, 1, BATCH, HIDDEN])],
                       [w, r, p])
    with pytest.raises(ValueError, match=f"LSTM 'lstm1': {message}"):
        lpx_tvm.compile(model, config="tsp")


def test_an_unpinned_sequence_is_named_with_the_way_out():
    w = numpy_helper.from_array(np.zeros((1, 3 * HIDDEN, INPUT), np.float32), "W")
    r = numpy_helper.from_array(np.zeros((1, 3 * HIDDEN, HIDDEN), np.float32), "R")
    node = helper.make_node("GRU", ["x", "W", "R"], ["Y"], hidden_size=HIDDEN, name="gru1")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["seq", BATCH, INPUT])
    model = make_model([node], [x], [tensor_info("Y", [SEQ, 1, BATCH, HIDDEN])], [w, r])
    with pytest.raises(ValueError, match=r"GRU 'gru1': its input 'x' has shape \[None, 2, 6\].*--input-shape"):
        lpx_tvm.compile(model, config="tsp")
