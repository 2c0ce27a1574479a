"""Every zoo model in every dtype, fast path against the tile-by-tile reference (and both against ORT).

    python scripts/fast_path.py [--models resnet50 ...] [--dtypes fp32 fp16 bf16 int8 fp8] [--json out.json]
    python scripts/fast_path.py --speed [--models resnet50 bert_encoder ppocr_rec]

fp8 runs on lp30 (tsp has no fp8 matrix unit), the rest on tsp. A row is ``fast=ref`` when the two are
bit-equal (int8 must be), else the largest difference over the output's largest magnitude. Exits 1 when an
int8 model is not bit-equal or an fp32 one differs by more than the zoo's tolerance. ``--speed`` instead
times each model's programs (fp32, tsp) tile by tile, fast, and fast without the host kernels (every
elementwise step, IM2COL and max pool by numpy), in turns in one process.
"""

import argparse
import json
import sys
import time

import numpy as np

from tabulate import tabulate

from lpx_tvm.app.tools.zoo import FAST_PATH_FP32_TOLERANCE, ZOO, run_model

DTYPES = ("fp32", "fp16", "bf16", "int8", "fp8")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(ZOO), help="default: the zoo (--speed: the bench's three)")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--speed", action="store_true", help="time fast against tile by tile instead")
    args = parser.parse_args(argv)
    if args.speed:
        models = args.models or ["resnet50", "bert_encoder", "ppocr_rec"]
        print(tabulate([speed(name) for name in models], headers=["model", "tile by tile ms", "fast ms", "ratio",
                                                                  "numpy steps ms", "ratio", "instructions",
                                                                  "fast calls"],
                       tablefmt="github", disable_numparse=True))
        return 0
    records, rows, bad = [], [], 0
    for dtype in args.dtypes:
        for name in args.models or list(ZOO):
            start = time.perf_counter()
            config = "lp30" if dtype == "fp8" else "tsp"
            try:
                record = run_model(ZOO[name], config=config, llvm=False, repeat=1, dtype=dtype)
            except Exception as err:  # one model's failure must not stop the sweep
                record = {"model": name, "dtype": dtype, "error": f"{type(err).__name__}: {err}"[:160]}
            record["wall_s"] = time.perf_counter() - start
            records.append(record)
            if "fast_bit_equal" not in record:
                rows.append([name, dtype, config, record.get("error", "?"), "", "", f"{record['wall_s']:.1f}"])
                continue
            fast = "fast=ref" if record["fast_bit_equal"] else f"{record['fast_max_diff']:.2e}"
            failed = (dtype == "int8" and not record["fast_bit_equal"]) or \
                (dtype == "fp32" and record["fast_max_diff"] > FAST_PATH_FP32_TOLERANCE)
            bad += failed
            rows.append([name, dtype, config, fast, f"{record['cosine']:.6f}", "FAIL" if failed else "ok",
                         f"{record['wall_s']:.1f}"])
            print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
    print(tabulate(rows, headers=["model", "dtype", "config", "fast vs tile by tile", "cosine vs ORT fp32",
                                  "fast path", "s"], tablefmt="github", disable_numparse=True))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1, default=str)
    return 1 if bad else 0


def speed(name: str, calls: int = 10) -> list:
    """Medians of ``calls`` runs of every program of ``name`` (fp32 on tsp), timed in turns: tile by tile, fast,
    and fast with every elementwise step, IM2COL and max pool by numpy (no host kernel: the simulator as
    ``runtime_sim`` alone runs it)."""
    import lpx_tvm
    import tvm  # noqa: F401  (lpx_tvm installs the host kernels when TVM loads)
    from lpx_tvm.app.tools.bench import side_by_side
    from lpx_tvm.runtime_sim import Simulator, fusion, semantics

    entry = ZOO[name]
    model = entry.load()
    feeds = entry.feeds(model)
    compiled = lpx_tvm.compile(model, config="tsp", input_shapes=entry.input_shapes)
    captured, run = {}, Simulator.run

    def capture(sim, inputs, outputs=None, reference=None):  # each program's own inputs, from one real call
        captured.setdefault(id(sim), (sim, [np.array(x) for x in inputs]))
        return run(sim, inputs, outputs, reference)
    Simulator.run = capture
    try:
        compiled(*[feeds[n] for n, _, _ in compiled.input_signature])
    finally:
        Simulator.run = run
    kernels = fusion.use_elementwise_kernels(None)
    numpy_steps = [(Simulator(sim.program, check_schedule=False), inputs) for sim, inputs in captured.values()]
    fusion.use_elementwise_kernels(kernels)
    windows = semantics.use_window_kernels(None)
    semantics.use_window_kernels(*windows)

    def runs(pairs, reference=False, window_kernels=windows):
        def run_all():
            semantics.use_window_kernels(*(window_kernels or (None,)))
            for sim, inputs in pairs:
                sim.run(inputs, reference=reference)
        return run_all
    pairs = list(captured.values())
    try:
        slow, fast, by_numpy = side_by_side([runs(pairs, reference=True), runs(pairs),
                                             runs(numpy_steps, window_kernels=None)], calls)
    finally:
        semantics.use_window_kernels(*windows)
    sims = [sim for sim, _ in captured.values()]
    return [name, f"{slow * 1e3:.1f}", f"{fast * 1e3:.1f}", f"{slow / fast:.2f}", f"{by_numpy * 1e3:.1f}",
            f"{by_numpy / fast:.2f}", str(sum(len(s.program.instructions) for s in sims)),
            str(sum(len(s._fast) for s in sims))]


if __name__ == "__main__":
    sys.exit(main())
