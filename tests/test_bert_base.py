"""BERT-base (12 layers, hidden 768, seq 128) on one tsp chip, against ONNX Runtime: fp16 against ORT in fp32,
int8 against ORT running the same QDQ model. One program each, nothing on the host, every weight resident."""

import numpy as np
import pytest

import lpx_tvm
from conftest import ort_run, run_on_lpx
from lpx_tvm.app.models.transformers import bert_base


def _cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.fixture(scope="module")
def model():
    return bert_base()


@pytest.mark.slow
def test_bert_base_fp16_matches_onnx_runtime_fp32(model):
    compiled = lpx_tvm.compile(model, config="tsp", dtype="fp16")
    (sim,) = compiled.simulators.values()
    assert not sim.program.streamed
    x = np.random.default_rng(1).standard_normal((1, 128, 768)).astype(np.float32)
    (out,) = run_on_lpx(compiled, [x], programs=1)
    assert _cosine(out, ort_run(model, {"hidden_states": x})[0]) >= 0.999


@pytest.mark.slow
def test_bert_base_int8_matches_onnx_runtime_on_the_same_qdq_model(model):
    rng = np.random.default_rng(0)
    calibration = [{"hidden_states": rng.standard_normal((1, 128, 768)).astype(np.float32)} for _ in range(2)]
    qdq = lpx_tvm.quantize(model, calibration_inputs=calibration)
    compiled = lpx_tvm.compile(qdq, config="tsp", dtype="int8")
    (sim,) = compiled.simulators.values()
    assert not sim.program.streamed
    x = rng.standard_normal((1, 128, 768)).astype(np.float32)
    (out,) = run_on_lpx(compiled, [x], programs=1)
    assert _cosine(out, ort_run(qdq, {"hidden_states": x})[0]) >= 0.999
