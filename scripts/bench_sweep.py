"""Sweep throughput and the timing-only simulator's speed, measured side by side in one run.

    python scripts/bench_sweep.py [--json out.json]

1. Points per minute of a 24-point sweep (3 chip variants × 4 zoo models × 2 dtypes) on a local Ray with
   1 worker, then with 2 (fresh stores, so nothing is skipped); the ratio is the scaling.
2. ResNet-50 on tsp, in fp32, fp16, bf16 and int8 (the zoo's QDQ model): a timing-only simulator (schedule
   verified, cycles counted) against a full one (also placing the weights, binding every instruction and
   running the arithmetic once), medians of 7, each on a freshly decoded program after a garbage collection,
   all four compiled before any is timed. Also timed: loading without the schedule check (validation, each
   instruction's timing and the statistics only), the part of a load that no check can speed up; full ÷ that
   is the ceiling on the speed-up a faster check could give.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from tabulate import tabulate

SPEC = {"base": "tsp", "models": ["squeezenet", "shufflenet", "bert_encoder", "ppocr_cls"],
        "dtypes": ["fp32", "fp16"], "grid": {"mxm_planes": [2, 4, 6]}}


def _warm(_):
    import lpx_tvm.compiler  # noqa: F401  (the worker's one-time import of TVM and lpx_tvm)

    time.sleep(1.0)  # long enough that every worker gets one
    return True


def sweep_rate(workers: int) -> dict:
    """Steady-state points per minute: Ray started and its workers' imports done before the clock starts
    (both are reported too: a sweep pays them once)."""
    import ray

    from lpx_tvm.app.tools.sweep import ONE_THREAD, run_sweep, spec_from_dict

    spec = spec_from_dict(SPEC)
    start = time.perf_counter()
    ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": ONE_THREAD})
    try:
        ray.get([ray.remote(num_cpus=1)(_warm).remote(k) for k in range(workers)])
        startup = time.perf_counter() - start
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            records = run_sweep(spec, Path(tmp) / "r.jsonl", workers=workers, progress=False)
            seconds = time.perf_counter() - start
    finally:
        ray.shutdown()
    return {"workers": workers, "points": len(records), "ok": sum(bool(r["ok"]) for r in records),
            "startup_s": startup, "seconds": seconds, "points_per_min": 60 * len(records) / seconds}


def compiled_blob(model: str = "resnet50", dtype: str = "fp32") -> bytes:
    """The model's one program on tsp, encoded."""
    import lpx_tvm
    from lpx_tvm.app.tools.zoo import ZOO, quantized_for_zoo
    from lpx_tvm.runtime_sim import encode

    entry = ZOO[model]
    onnx_model = quantized_for_zoo(entry, entry.load()) if dtype == "int8" else entry.load()
    programs, _ = lpx_tvm.compile_programs(onnx_model, config="tsp", input_shapes=entry.input_shapes, dtype=dtype)
    (program,) = programs.values()
    return bytes(encode(program))


def timing_only_speed(blob: bytes, model: str, dtype: str, repeat: int = 7) -> dict:
    """Timing-only, full and unchecked loads of ``blob``, each run on a freshly decoded program (nothing one
    run derives is cached for the next), alternated, medians of ``repeat``."""
    from lpx_tvm.runtime_sim import Simulator, decode

    program = decode(blob)
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(t.shape).astype(t.dtype.np) for t in program.inputs]

    def timing(p):
        return Simulator(p, timing_only=True).stats.cycles

    def full(p):
        sim = Simulator(p)
        sim.run(inputs)
        return sim.stats.cycles

    def unchecked(p):
        return Simulator(p, timing_only=True, check_schedule=False).stats.cycles

    assert timing(decode(blob)) == full(decode(blob)) == unchecked(decode(blob))
    times = {"timing_only_s": [], "full_s": [], "unchecked_s": []}
    for _ in range(repeat):  # alternated, so all see the same machine
        for key, fn in (("timing_only_s", timing), ("full_s", full), ("unchecked_s", unchecked)):
            fresh = decode(blob)
            gc.collect()  # the last run's garbage (a full simulator's) is not collected inside this one's timing
            start = time.perf_counter()
            fn(fresh)
            times[key].append(time.perf_counter() - start)
    result = {k: statistics.median(v) for k, v in times.items()}
    result["speedup"] = result["full_s"] / result["timing_only_s"]
    result["ceiling"] = result["full_s"] / result["unchecked_s"]
    result["model"], result["dtype"], result["instructions"] = model, dtype, len(program.instructions)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the figures as JSON")
    args = parser.parse_args(argv)
    one, two = sweep_rate(1), sweep_rate(2)
    # everything compiled first: the int8 model's calibration runs ONNX Runtime, whose threads spin on after it
    blobs = {dtype: compiled_blob("resnet50", dtype) for dtype in ("fp32", "fp16", "bf16", "int8")}
    time.sleep(2.0)
    speeds = [timing_only_speed(blob, "resnet50", dtype) for dtype, blob in blobs.items()]
    report = {"sweep": [one, two], "scaling_2_over_1": two["points_per_min"] / one["points_per_min"],
              "timing_only": speeds}
    for r in (one, two):
        print(f"sweep, {r['workers']} worker(s): {r['points']} points ({r['ok']} ok) in {r['seconds']:.1f} s = "
              f"{r['points_per_min']:.1f} points/min (after {r['startup_s']:.1f} s starting Ray and its workers)")
    print(f"2 workers ÷ 1 worker: {report['scaling_2_over_1']:.2f}×")
    print(tabulate([[f"{s['model']} {s['dtype']}", s["instructions"], f"{s['timing_only_s']:.3f}",
                     f"{s['full_s']:.3f}", f"{s['speedup']:.1f}×", f"{s['unchecked_s']:.3f}", f"{s['ceiling']:.1f}×"]
                    for s in speeds],
                   headers=["on tsp", "instructions", "timing-only s", "full s", "full ÷ timing-only",
                            "unchecked s", "full ÷ unchecked"], disable_numparse=True))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
