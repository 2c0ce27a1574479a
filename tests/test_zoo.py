"""The smallest zoo model of each family against ONNX Runtime, with its offload share."""

import importlib.util
import json

import numpy as np
import pytest

from lpx_tvm.app.cli import main
from lpx_tvm.app.tools.zoo import ZOO, run_model


NO_RAPIDOCR = importlib.util.find_spec("rapidocr_onnxruntime") is None


@pytest.mark.parametrize("name, min_pct", [
    ("squeezenet", 99.0), ("bert_encoder", 95.0), ("gpt2_decoder", 95.0),
    pytest.param("ppocr_cls", 95.0, marks=pytest.mark.skipif(
        NO_RAPIDOCR, reason="optional rapidocr-onnxruntime (the models extra) is not installed")),
])
@pytest.mark.slow
def test_smallest_model_of_each_family(name, min_pct):
    record = run_model(ZOO[name], config="tsp", llvm=False, repeat=1)
    print(f"\n{name}: {record['flops_offloaded_pct']:.2f}% FLOPs on lpx, max rel err {record['max_rel_err']:.2e}, "
          f"cosine {record['cosine']:.6f}")
    assert record["ok"], record.get("error")
    assert record["max_rel_err"] <= 1e-3 and record["cosine"] >= 0.9999
    assert record["flops_offloaded_pct"] >= min_pct
    assert record["predicted_latency_s"] == pytest.approx(record["predicted_cycles"] / 900e6, rel=1e-12)  # tsp
    assert record["lpx_calls"] == record["lpx_subgraphs"] >= 1, "each offloaded subgraph runs on lpx once a call"


@pytest.mark.slow
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


def test_seeded_inputs_are_what_each_input_is():
    """Ids within the table they index (a vocabulary of 30), masks of ones, token types of zeros, positions
    counting up: ids in 0-999 everywhere made ONNX Runtime fail on token types and gave masks of 0-999."""
    from onnx import TensorProto, helper, numpy_helper

    from lpx_tvm.app.tools.zoo import seeded_inputs

    table = numpy_helper.from_array(np.zeros((30, 4), np.float32), "table")
    ints = lambda n: helper.make_tensor_value_info(n, TensorProto.INT64, [2, 5])
    graph = helper.make_graph([helper.make_node("Gather", ["table", "input_ids"], ["e"])], "g",
                              [ints("input_ids"), ints("attention_mask"), ints("token_type_ids"), ints("position_ids")],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, [2, 5, 4])], [table])
    feeds = seeded_inputs(helper.make_model(graph))
    assert feeds["input_ids"].min() >= 0 and feeds["input_ids"].max() < 30 and feeds["input_ids"].dtype == np.int64
    np.testing.assert_array_equal(feeds["attention_mask"], np.ones((2, 5)))
    np.testing.assert_array_equal(feeds["token_type_ids"], np.zeros((2, 5)))
    np.testing.assert_array_equal(feeds["position_ids"], [[0, 1, 2, 3, 4]] * 2)


@pytest.mark.slow
def test_a_model_s_peak_memory_is_what_a_process_running_it_alone_peaks_at():
    """The zoo samples a model's resident set while it runs and leaves the kernel's high-water mark alone
    (it reset it, so /usr/bin/time reported a third of the zoo's own figure). In a fresh process that runs
    only squeezenet, the zoo's figure for it is the process's own peak within 5% (the kernel's VmHWM: its
    getrusage would count the memory of the pytest process it was forked from, which survives the exec)."""
    import json
    import subprocess
    import sys

    code = ("import json; from lpx_tvm.app.tools.zoo import run_zoo; "
            "r = run_zoo(['squeezenet'], llvm=False)[0]; "
            "hwm = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM')); "
            "print(json.dumps([r['peak_rss_mb'], hwm / 1024]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    sampled, process = json.loads(done.stdout.strip().splitlines()[-1])
    assert sampled == pytest.approx(process, rel=0.05)


def test_the_bench_s_compile_scaling_compiles_two_chains_of_distinct_layers():
    """(A timing is not asserted: only that the two chains are what the ratio claims to compare.)"""
    from lpx_tvm.app.tools.bench import _layer_chain, compile_scaling

    chain = _layer_chain(3, width=8, rows=2)
    assert [n.op_type for n in chain.graph.node] == ["MatMul", "Add", "Relu"] * 3
    weights = [i for i in chain.graph.initializer if i.name.startswith("w")]
    assert len({w.raw_data for w in weights}) == 3  # distinct, so TVM merges no two layers into one function
    result = compile_scaling(layers=2, factor=2)
    assert (result["layers"], result["factor"], sorted(result["seconds"])) == (2, 2, [2, 4])
