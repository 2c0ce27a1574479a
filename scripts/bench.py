"""Benchmark the flow itself, side by side in one run: simulator vs ONNX Runtime, lpx compile vs TVM llvm.

    python scripts/bench.py [--models resnet50 bert_encoder] [--json out.json]

Times are medians over repeated calls in the same process (these machines are
noisy, so only ratios taken together mean anything). Peak RSS is measured in a
fresh child process per engine, each reporting its own high-water mark.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def _child_peak_rss_mb(model: str, engine: str) -> float:
    code = f"""
from lpx_tvm.zoo import ZOO, seeded_inputs
m = ZOO[{model!r}].load(); feeds = seeded_inputs(m)
if {engine!r} == "ort":
    import onnxruntime as ort
    s = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    for _ in range(3): s.run(None, feeds)
else:
    import lpx_tvm
    c = lpx_tvm.compile(m, config="tsp"); args = [feeds[n] for n, _, _ in c.input_signature]
    for _ in range(3): c(*args)
# VmHWM, not ru_maxrss: Linux carries the parent's ru_maxrss across fork+exec
print(next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) / 1024)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def bench(model: str, repeat: int) -> dict:
    import onnxruntime as ort
    import tvm

    import lpx_tvm
    from lpx_tvm.frontend import from_onnx
    from lpx_tvm.zoo import ZOO, seeded_inputs, timed

    onnx_model = ZOO[model].load()
    feeds = seeded_inputs(onnx_model)
    start = time.perf_counter()
    compiled = lpx_tvm.compile(onnx_model, config="tsp")
    lpx_compile = time.perf_counter() - start
    start = time.perf_counter()
    tvm.compile(from_onnx(onnx_model), target="llvm")
    llvm_compile = time.perf_counter() - start
    args = [feeds[n] for n, _, _ in compiled.input_signature]
    sess = ort.InferenceSession(onnx_model.SerializeToString(), providers=["CPUExecutionProvider"])
    sim_s = timed(lambda: compiled(*args), repeat)
    ort_s = timed(lambda: sess.run(None, feeds), repeat)
    sim_rss, ort_rss = _child_peak_rss_mb(model, "lpx"), _child_peak_rss_mb(model, "ort")
    return {"model": model, "sim_s": sim_s, "ort_s": ort_s, "sim_over_ort": sim_s / ort_s,
            "lpx_compile_s": lpx_compile, "tvm_llvm_compile_s": llvm_compile,
            "compile_over_tvm": lpx_compile / llvm_compile,
            "sim_peak_rss_mb": sim_rss, "ort_peak_rss_mb": ort_rss}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["resnet50", "bert_encoder"])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--json")
    args = parser.parse_args()
    from tabulate import tabulate

    rows = [bench(m, args.repeat) for m in args.models]
    print(tabulate([[r["model"], f"{r['sim_s'] * 1e3:.1f}", f"{r['ort_s'] * 1e3:.1f}", f"{r['sim_over_ort']:.2f}",
                     f"{r['lpx_compile_s']:.2f}", f"{r['tvm_llvm_compile_s']:.2f}", f"{r['compile_over_tvm']:.2f}",
                     f"{r['sim_peak_rss_mb']:.0f}", f"{r['ort_peak_rss_mb']:.0f}"] for r in rows],
                   headers=["model", "sim ms", "ORT ms", "sim/ORT", "lpx compile s", "llvm compile s",
                            "compile/llvm", "sim RSS MB", "ORT RSS MB"], tablefmt="github"))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
