"""lpx-tvm profile: per-layer table, JSON report and trace; SRAM capacity fallback."""

import json

import numpy as np
import onnx
import pytest
from onnx import helper

import lpx_tvm
from lpx_tvm.cli import main
from lpx_tvm.patterns import CapacityWarning
from conftest import assert_close, cnn_model, make_model, ort_run, tensor_info, weights


def test_profile_writes_report_and_trace(tmp_path, capsys):
    path = tmp_path / "cnn.onnx"
    onnx.save(cnn_model(), path)
    report, trace = tmp_path / "report.json", tmp_path / "trace.json"
    assert main(["profile", str(path), "--config", "tiny", "--json", str(report), "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "conv2d" in out and "% peak" in out
    data = json.loads(report.read_text())
    assert data["predicted_cycles"] == data["simulated_cycles"] > 0
    assert data["units"]["MXM"]["busy_cycles"] > 0 and 0 < data["units"]["MXM"]["utilisation"] <= 1
    assert any("conv2d" in layer["layer"] and layer["flops"] > 0 for layer in data["layers"])
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["tid"] for e in events if e["ph"] == "X"} and all(
        {"ph", "ts", "dur", "pid", "tid"} <= set(e) for e in events if e["ph"] == "X")


def test_layer_too_big_for_sram_falls_back_with_a_warning(rng):
    # a 2048x2048 fp32 weight (16 MiB) cannot fit the tiny chip's 16 MiB SRAM with its activations
    big = weights(rng, "w", (2048, 2048), 0.02)
    small = weights(rng, "v", (2048, 16), 0.1)
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
                        helper.make_node("MatMul", ["r", "v"], ["y"])],
                       [tensor_info("x", [2, 2048])], [tensor_info("y", [2, 16])], [big, small])
    with pytest.warns(CapacityWarning, match="needs .* bytes of SRAM"):
        compiled = lpx_tvm.compile(model, config="tiny")
    assert compiled.report.host_ops["relax.matmul"] == 1
    assert compiled.report.lpx_functions == 1
    x = rng.standard_normal((2, 2048)).astype(np.float32)
    assert_close(compiled(x)[0], ort_run(model, {"x": x})[0], 1e-4)
