"""Design sweeps: specs validated up front, points keyed by content, resumed after an interruption, failures
recorded, the same figures on Ray as in-process, and the cost proxy and Pareto fronts worked by hand."""

import csv
import json
from math import ceil

import onnx
import pytest

from conftest import add_model, cnn_model, mlp_model
from lpx_tvm.app.tools import sweep
from lpx_tvm.app.cli import main
from lpx_tvm.app.plan.cost import AreaModel, pareto_front
from lpx_tvm.runtime_sim import derive_config, load_config


@pytest.fixture
def model_files(tmp_path):
    paths = []
    for name, model in (("cnn", cnn_model()), ("mlp", mlp_model())):
        path = tmp_path / f"{name}.onnx"
        onnx.save(model, str(path))
        paths.append(str(path))
    return paths


def _spec(models, **extra):
    return sweep.spec_from_dict({"base": "tiny", "models": models, "grid": {"mxm_planes": [1, 2]}, **extra})


@pytest.mark.parametrize("data, named", [
    ({"models": ["squeezenet"], "colour": 1}, "unknown key colour"),
    ({"models": ["squeezenet"], "grid": {"lanes": [0]}}, "lanes must be a positive integer"),
    ({"models": ["squeezenet"], "grid": {"sram_size": [1]}}, "no parameter sram_size"),
    ({"models": ["squeezenet"], "grid": {"mxm_passes": ["2x"]}}, "mxm_passes = '2x': only an integer"),
    ({"models": ["squeezenet"], "metrics": ["joules"]}, "unknown metric joules"),
    ({"models": ["no_such_model"]}, "'no_such_model' is neither a zoo model"),
    ({"models": ["squeezenet"], "dtypes": ["fp8"]}, "has no fp8 matrix unit"),
    ({"models": ["squeezenet"], "base": "tpu"}, "unknown chip config 'tpu'"),
])
def test_a_bad_spec_is_rejected_before_anything_runs_naming_the_field(data, named):
    with pytest.raises(sweep.SpecError, match=named):
        sweep.spec_from_dict(data)


def test_multiples_of_the_base_and_the_grid_expand_to_every_combination():
    spec = sweep.spec_from_dict({"base": "tiny", "models": ["squeezenet"], "dtypes": ["fp32", "int8"],
                                 "grid": {"sram_bytes": ["1x", "1.5x"], "mxm_planes": [1, 2]},
                                 "variants": [{"mxm_rows": 64, "mxm_cols": 64}]})
    tiny = load_config("tiny")
    assert len(spec.variants) == 2 * 2 + 1
    assert {v.get("sram_bytes") for v in spec.variants[:4]} == {tiny.sram_bytes, tiny.sram_bytes * 3 // 2}
    assert len(sweep.plan_tasks(spec)) == 5 * 1 * 2


def test_point_keys_follow_content_not_names(model_files, tmp_path):
    tiny = load_config("tiny")
    same = derive_config("tiny", {"mxm_planes": tiny.mxm_planes}, name="tiny-renamed")
    assert sweep.point_key(tiny, model_files[0], "fp32") == sweep.point_key(same, model_files[0], "fp32")
    assert sweep.point_key(tiny, model_files[0], "fp32") != sweep.point_key(tiny, model_files[0], "int8")
    assert sweep.point_key(tiny, model_files[0], "fp32") != sweep.point_key(tiny, model_files[0], "fp32", "9.9")
    copy = tmp_path / "copy.onnx"
    copy.write_bytes(open(model_files[0], "rb").read())
    assert sweep.point_key(tiny, model_files[0], "fp32") == sweep.point_key(tiny, str(copy), "fp32")
    assert sweep.point_key(tiny, model_files[0], "fp32") != sweep.point_key(tiny, model_files[1], "fp32")


def test_an_interrupted_sweep_resumes_without_redoing_finished_points(model_files, tmp_path, monkeypatch):
    spec = _spec(model_files)
    store = tmp_path / "results.jsonl"
    real_run, calls = sweep.run_task, []

    def interrupted_after_two(task):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(task)
        return real_run(task)

    monkeypatch.setattr(sweep, "run_task", interrupted_after_two)
    with pytest.raises(KeyboardInterrupt):
        sweep.run_sweep(spec, store, workers=0, progress=False)
    first = [json.loads(line) for line in store.read_text().splitlines()]
    assert len(first) == 2 and all(r["ok"] for r in first)

    rerun = []
    monkeypatch.setattr(sweep, "run_task", lambda task: rerun.append(task) or real_run(task))
    records = sweep.run_sweep(spec, store, workers=0, progress=False)
    assert len(rerun) == 2 and len(records) == 4 and all(r["ok"] for r in records)
    assert {(t["model"], t["points"][0]["variant"]) for t in rerun}.isdisjoint(
        {(t["model"], t["points"][0]["variant"]) for t in calls})
    kept = {r["key"]: r for r in records}
    assert all(kept[r["key"]]["task_s"] == r["task_s"] for r in first)  # read back, not run again
    assert sweep.plan_tasks(spec, sweep.ResultStore(store).done) == []


def test_a_failing_point_is_recorded_and_the_sweep_goes_on(model_files, tmp_path):
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not an onnx model")
    records = sweep.run_sweep(_spec([model_files[1], str(broken)]), tmp_path / "r.jsonl", workers=0, progress=False)
    assert [r["ok"] for r in records] == [True, False, True, False]
    assert all("not a readable ONNX model" in r["error"] for r in records if not r["ok"])
    assert "failed points:" in str(sweep.table(records))


ADD_GRID = {"host_bytes_per_s": ["1x", "2x"], "mxm_planes": [1, 2]}
ADD_VARIANTS = [f"tiny[host_bytes_per_s={h},mxm_planes={p}]" for h in (10**9, 2 * 10**9) for p in (1, 2)]


# tiny.json's parameters the add's cycles are worked from, by hand: the test checks the preset still has them
TINY_BY_HAND = {"clock_hz": 100_000_000, "host_bytes_per_s": 1_000_000_000, "lanes": 32, "streams_per_direction": 8}
TINY_LATENCY_BY_HAND = {"MEM": 4, "VXM": 4}


def _add_cycles(host_scale: int) -> int:
    """x + y on [100, 32] fp32 tensors crossing the host link, by hand from tiny.json's parameters (100 MHz, a
    1 GB/s host link, 32 lanes, 8 streams a direction, MEM and VXM latency 4 cycles each).

    A tensor is 100 x 32 x 4 = 12,800 bytes: 1,280 cycles on the link at 10 bytes a cycle (640 at twice the
    bandwidth). The add moves 12 bytes an element, 12 streams a vector: more than a direction's 8, so each of
    its 100 vectors takes 2 cycles, one at a time: 200. Two inputs in turn, the MEM latency, the add, the VXM
    latency, the result back, the MEM latency: 4,052 cycles at 1x, 2,132 at 2x. Planes do not matter:
    nothing multiplies."""
    link = ceil(12_800 / (10 * host_scale))  # bytes a tensor over bytes a cycle (1 GB/s at 100 MHz: 10)
    add = 100 * ceil(12 / 8)  # 3,200 elements over 32 lanes: 100 vectors, each 12 streams over a direction's 8
    mem = vxm = 4
    return 2 * link + mem + add + vxm + link + mem


ADD_CYCLES = [_add_cycles(scale) for scale in (1, 2) for _planes in (1, 2)]


def _add_sweep(tmp_path, workers: int) -> list:
    path = tmp_path / "add.onnx"
    onnx.save(add_model(100, 32), str(path))
    spec = sweep.spec_from_dict({"base": "tiny", "models": [str(path)], "grid": ADD_GRID})
    return sweep.run_sweep(spec, tmp_path / f"r{workers}.jsonl", workers=workers, progress=False)


def test_each_point_is_timed_on_its_own_chip(tmp_path):
    """Each point's cycles are its own chip's (``ADD_CYCLES``, by hand), and a second plane adds its 32 x 32
    MACs' share of the matrix block's assumed 27% of 725 mm²."""
    tiny = load_config("tiny")
    assert {k: getattr(tiny, k) for k in TINY_BY_HAND} == TINY_BY_HAND  # what the sums were worked from
    assert {k: tiny.latency_cycles[k] for k in TINY_LATENCY_BY_HAND} == TINY_LATENCY_BY_HAND
    records = _add_sweep(tmp_path, workers=0)
    assert [r["variant"] for r in records] == ADD_VARIANTS
    assert all(r["fits"] for r in records)
    assert [r["cycles"] for r in records] == ADD_CYCLES == [4052, 4052, 2132, 2132]  # (the docstring's sums)
    one_plane, two_planes = records[0]["area_mm2"], records[1]["area_mm2"]
    assert two_planes - one_plane == pytest.approx(0.27 * 725 * (32 * 32) / (4 * 320 * 320))


@pytest.mark.slow
def test_two_ray_workers_give_the_figures_worked_by_hand(tmp_path):
    pytest.importorskip("ray", reason="the sweep extra (ray) is not installed")
    on_ray = _add_sweep(tmp_path, workers=2)
    assert [r["cycles"] for r in on_ray] == ADD_CYCLES
    assert [r["variant"] for r in on_ray] == ADD_VARIANTS


def test_the_cli_writes_the_table_columns_first_and_resumes(model_files, tmp_path, capsys):
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps({"base": "tiny", "models": model_files[1:], "grid": {"mxm_planes": [1, 2]}}))
    out = tmp_path / "results.csv"
    assert main(["sweep", str(spec_file), "--workers", "0", "--out", str(out), "--no-progress"]) == 0
    assert "2/2 points ok" in capsys.readouterr().out
    header = next(csv.reader(out.open()))
    assert header[:len(sweep.COLUMNS)] == [k for k, _ in sweep.COLUMNS]
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 2
    assert main(["sweep", str(spec_file), "--workers", "0", "--out", str(out), "--no-progress"]) == 0
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 2  # nothing ran twice


def test_the_area_proxy_by_hand():
    area = AreaModel.from_tsp()
    assert area.area_mm2(load_config("tsp")) == pytest.approx(725)  # the TSP's published die (ISCA 2020)
    tsp = load_config("tsp")
    # twice the SRAM adds the SRAM block's assumed 40 % of the die again; six planes instead of four add half
    # the matrix block's 27 %
    bigger = derive_config("tsp", {"sram_bytes": 2 * tsp.sram_bytes, "mxm_planes": 6})
    assert area.area_mm2(bigger) == pytest.approx(725 + 0.40 * 725 + 0.27 * 725 / 2)


def test_pareto_front_by_hand():
    points = [{"c": 1, "v": 9}, {"c": 2, "v": 5}, {"c": 3, "v": 6}, {"c": 4, "v": 1}, {"c": 2, "v": 7}]
    assert pareto_front(points, "c", "v") == [0, 1, 3]


@pytest.mark.slow
def test_an_llm_point_is_planned_on_a_system_of_the_variants_chips(tmp_path):
    """llama-small (hidden 256, 4 layers, 8 heads of 32 dims, 4 KV heads, FFN 512, vocab 1024, untied) in fp16
    on tsp-node, by hand from its config and tsp.json:

    - the chips hold every parameter but the token-embedding table (looked up on the host): 4 blocks of
      256 x 32 x (2 x 8 + 2 x 4) + 3 x 256 x 512 + 2 x 256 = 590,336, an LM head of 1024 x 256 and a final
      norm of 256: 2,623,744 parameters, 5,247,488 bytes; the KV cache holds 2 x 4 layers x 4 heads x 32 dims
      x 4096 positions x 2 bytes = 8,388,608 bytes. On a tsp with 5% of its SRAM (11,534,336 bytes) that
      takes two chips at least.
    - the quickest mapping on both is 8-way tensor parallel on one stage (tsp-node is all to all: each
      block's two all-reduces send the whole hidden state, 256 x 2 = 512 bytes, to each peer over its own
      link, one hop): at tsp's 15 GB/s a link and 900 MHz, 16.67 bytes a cycle, 31 cycles; at four times
      that, 8. Nothing else in a step uses a link: the faster link saves 8 all-reduces x (31 - 8) cycles a
      token."""
    spec = sweep.spec_from_dict({"base": "tsp", "models": ["plan:llama-small@tsp-node"], "dtypes": ["fp16"],
                                 "grid": {"sram_bytes": ["1x", "0.05x"]},
                                 "variants": [{"sram_bytes": "0.05x", "c2c_bytes_per_s_per_link": "4x"}]})
    records = sweep.run_sweep(spec, tmp_path / "r.jsonl", workers=0, progress=False)
    assert [r["ok"] for r in records] == [True, True, True]
    big, small, small_fast_links = records
    needed = 2 * 2_623_744 + 8_388_608
    sram = 11_534_336
    assert round(load_config("tsp").sram_bytes * 0.05) == sram
    assert needed > sram and small["chips"] == small_fast_links["chips"] == 8
    tsp = load_config("tsp")
    assert (tsp.clock_hz, tsp.c2c_bytes_per_s_per_link) == (900_000_000, 15_000_000_000)  # worked from these
    # the hidden state, 256 x 2 bytes, at 15 GB/s / 900 MHz = 16.67 bytes a cycle: 30.7, so 31; at 4x, 7.7: 8
    assert small["cycles"] - small_fast_links["cycles"] == 4 * 2 * (31 - 8)
    assert tsp.sram_bytes > needed  # the full chip holds what the model needs, yet 8 chips are quicker
    # one user at batch 1: a token a step, a step its cycles at 900 MHz (the cycles rounded from the plan's µs)
    assert big["chips"] == 8
    assert big["latency_us"] == pytest.approx(big["cycles"] / 900, abs=1 / 900)
    assert big["tokens_per_s_per_user"] == pytest.approx(900e6 / big["cycles"], rel=1 / big["cycles"])
    # the silicon of an LLM point is every chip its plan takes: a tsp (725 mm²) less the part of its SRAM
    # block (an assumed 40%) it lacks
    assert small["area_mm2"] == pytest.approx(small["chips"] * (725 - 0.40 * 725 * (1 - sram / tsp.sram_bytes)))
    assert big["area_mm2"] == pytest.approx(big["chips"] * 725)


@pytest.mark.parametrize("model, named", [("plan:llama-small", "plan:MODEL@SYSTEM"),
                                          ("plan:gpt-5@tsp-node", "neither a preset"),
                                          ("plan:llama-small@tsp-galaxy", "tsp-galaxy")])
def test_a_bad_llm_point_is_rejected_naming_it(model, named):
    with pytest.raises(sweep.SpecError, match=named):
        sweep.spec_from_dict({"base": "tsp", "models": [model]})


def test_each_sweep_point_builds_one_target_of_its_own_chip(tmp_path, targets_made):
    """A sweep's door is its spec: each point's chip is built once (``variant_config``) and parsed into one
    Target for its compile, the variant's own."""
    records = _add_sweep(tmp_path, workers=0)
    wanted = [sweep.variant_config("tiny", r["overrides"]) for r in records]
    assert [(t.chip.digest, t.dtype) for t in targets_made] == [(chip.digest, "fp32") for chip in wanted]
    assert len({chip.digest for chip in wanted}) == 4
