"""The decode plans of issue 49's table: five models on lpx-rack (fp8) and on TSP systems (int8).

    python scripts/plan_table.py [--markdown] [--only NAME]

Each row: tokens/s per user, chips and mapping, the floor the preset's figures set (``floor_us``, where the
plan gives one) and the plan's ratio to it, and what bounds the plan.
"""

import argparse
import time
from pathlib import Path

from lpx_tvm.app.plan.search import plan

CONFIGS = Path(__file__).with_name("configs")
ROWS = [(model, system, dtype) for model in ("llama-3-8b", "llama-3-70b", str(CONFIGS / "dense-31b.json"),
                                             "mixtral-8x7b", "llama-3.1-405b")
        for system, dtype in (("lpx-rack", "fp8"), ("tsp-rack", "int8"), ("tsp-system-576", "int8"))] + [
    ("llama-3.1-405b", "lpx-system-4", "fp8")]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--only", default=None, help="rows whose model or system contains this")
    args = parser.parse_args()
    print("| model | system | dtype | tokens/s per user | µs a token | chips | mapping | floor_us | ratio | bound | s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for model, system, dtype in ROWS:
        if args.only and args.only not in model and args.only not in system:
            continue
        start = time.perf_counter()
        name = Path(model).stem
        try:
            r = plan(model, system, dtype=dtype, context=args.context, prompt=128)
        except Exception as err:  # a model a system cannot hold: its row says why
            print(f"| {name} | {system} | {dtype} | – | – | – | {str(err)[:90]} | – | – | – | "
                  f"{time.perf_counter() - start:.0f} |", flush=True)
            continue
        m = r["mapping"]
        floor = r.get("floor_us")
        ratio = f"{r['per_token_us'] / floor:.2f}" if floor else "–"
        print(f"| {name} | {system} | {dtype} | {r['tokens_per_s_per_user']:.0f} | {r['per_token_us']:.1f} | "
              f"{r['chips']} | {m['pipeline_stages']}×{m['tensor_parallel']} | "
              f"{'–' if floor is None else f'{floor:.1f}'} | {ratio} | {r['bottleneck']} | "
              f"{time.perf_counter() - start:.0f} |", flush=True)


if __name__ == "__main__":
    main()
