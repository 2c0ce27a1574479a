"""The bench's own pieces: its table and the chain it times compiles on."""

import numpy as np

import lpx_tvm
from lpx_tvm.app.tools.bench import _layer_chain, bench_table
from conftest import ort_run, run_on_lpx


def test_the_table_formats_each_figure_as_the_readme_shows_it():
    """A record of 12.34 ms simulated (20.1 tile by tile), 6.02 ms in ORT (ratios 2.05 and 3.34; a GEMM floor of
    1.37), 1.5 s compile against 3.0 s llvm (0.50), and
    RSS of 600.4 and 250.6 MB becomes one row: ms to a tenth, ratios to a hundredth, MB whole, each with its
    digits as formatted (tabulate printed 0.50 as 0.5 and 6.0 as 6 until the bench told it not to parse them);
    a failed model is its name and its error."""
    record = {"model": "m", "sim_s": 0.01234, "reference_s": 0.0201, "ort_s": 0.00602,
              "sim_over_ort": 0.01234 / 0.00602, "reference_over_ort": 0.0201 / 0.00602, "gemm_floor_over_ort": 1.3712, "lpx_compile_s": 1.5, "tvm_llvm_compile_s": 3.0, "compile_over_tvm": 0.5, "sim_peak_rss_mb": 600.4,
              "ort_peak_rss_mb": 250.6}
    lines = str(bench_table([record, {"model": "broken", "error": "it failed"}])).splitlines()
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells == ["m", "12.3", "20.1", "6.0", "2.05", "3.34", "1.37", "1.50", "3.00", "0.50", "600", "251"]
    assert [c.strip() for c in lines[3].strip("|").split("|")][:2] == ["broken", "it failed"]


def test_the_chain_is_layers_of_distinct_weights_that_run_on_lpx():
    """Three layers: 9 nodes (MatMul, Add, Relu each), 6 initializers, no two weights equal (TVM would merge
    equal layers into one function and the chain would stop growing); compiled for tiny, the chain is one lpx
    program with nothing on the host, and agrees with ONNX Runtime."""
    model = _layer_chain(3, width=32, rows=4)
    assert [n.op_type for n in model.graph.node] == ["MatMul", "Add", "Relu"] * 3
    weights = [np.frombuffer(i.raw_data, np.float32) for i in model.graph.initializer if i.name.startswith("w")]
    assert len(model.graph.initializer) == 6 and len(weights) == 3
    assert not any(np.array_equal(a, b) for k, a in enumerate(weights) for b in weights[k + 1:])
    compiled = lpx_tvm.compile(model, config="tiny")
    x = np.random.default_rng(0).standard_normal((4, 32)).astype(np.float32)
    (y,) = run_on_lpx(compiled, [x], programs=1)
    np.testing.assert_allclose(y, ort_run(model, {"x": x})[0], rtol=1e-4, atol=1e-4)



def test_the_engines_are_timed_in_turns(monkeypatch):
    """Ten calls of each of two engines in five turns: each turn a pause, one untimed call, then two timed, engine
    after engine; each median from its own calls' times (a clock that advances 1 s in the first engine's calls and
    3 s in the second's)."""
    from lpx_tvm.app.tools import bench

    log, clock = [], [0.0]
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(bench.time, "sleep", lambda seconds: log.append("pause"))

    def engine(name, seconds):
        def call():
            log.append(name)
            clock[0] += seconds
        return call
    medians = bench.side_by_side([engine("sim", 1.0), engine("ort", 3.0)], repeat=10, turns=5)
    assert log == (["pause"] + ["sim"] * 3 + ["pause"] + ["ort"] * 3) * 5
    assert medians == [1.0, 3.0]
