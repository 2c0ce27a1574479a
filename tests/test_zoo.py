"""The smallest zoo model of each family against ONNX Runtime, with its offload share."""

import importlib.util
import json

import pytest

from lpx_tvm.app.cli import main
from lpx_tvm.app.zoo import ZOO, run_model


NO_RAPIDOCR = importlib.util.find_spec("rapidocr_onnxruntime") is None


@pytest.mark.parametrize("name, min_pct", [
    ("squeezenet", 99.0), ("bert_encoder", 95.0), ("gpt2_decoder", 95.0),
    pytest.param("ppocr_cls", 95.0, marks=pytest.mark.skipif(
        NO_RAPIDOCR, reason="optional rapidocr-onnxruntime (the models extra) is not installed")),
])
def test_smallest_model_of_each_family(name, min_pct):
    record = run_model(ZOO[name], config="tsp", llvm=False, repeat=1)
    print(f"\n{name}: {record['flops_offloaded_pct']:.2f}% FLOPs on lpx, max rel err {record['max_rel_err']:.2e}, "
          f"cosine {record['cosine']:.6f}")
    assert record["ok"], record.get("error")
    assert record["max_rel_err"] <= 1e-3 and record["cosine"] >= 0.9999
    assert record["flops_offloaded_pct"] >= min_pct
    assert record["lpx_subgraphs"] >= 1 and record["predicted_latency_s"] > 0
    assert record["lpx_calls"] >= record["lpx_subgraphs"], "the offloaded subgraphs did not run on lpx"


def test_zoo_command_writes_json_records(tmp_path, capsys):
    out = tmp_path / "zoo.json"
    assert main(["zoo", "--models", "bert_encoder", "--skip-llvm", "--json", str(out)]) == 0
    (record,) = json.loads(out.read_text())
    for key in ("model", "ok", "flops_offloaded_pct", "max_rel_err", "cosine", "compile_s", "sim_s", "ort_s",
                "tvm_llvm_s", "predicted_latency_s"):
        assert key in record
    assert record["ok"] and "bert_encoder" in capsys.readouterr().out


def test_unknown_model_is_one_line_error(capsys):
    assert main(["zoo", "--models", "nonesuch"]) == 1
    err = capsys.readouterr().err.strip()
    assert "unknown zoo models" in err and len(err.splitlines()) == 1
