"""The closing table of LPX beside GPUs (issue 51): each model on one NVL72 beside the LPX system that holds it.

For every model: the smallest of ``--systems`` (1, 2 or 4 LPX racks) whose SRAM holds its weights and one
sequence's cache (the plan's own check; the smallest where none does), and with ``--every-system`` every one of
them, those that do not hold it too: lpx-draft needs only its draft to fit (the target verifies on the GPUs), and
the modes that put the target on LPX say the racks they need and what binds (the plan's own error). One ``plan
--gpu --mode auto`` a model and system, one at a time, each in a child process with ``--timeout`` (a run past it
is named and skipped); a markdown row per mode and target speed is printed as each mode is
planned: racks, tokens/s per user, tokens/s per MW (with ``--lpx-chip-watts``, an assumed figure: LP30 has no
public one) and the ratio to gpu-only's tokens/s per MW at the same target.

    python scripts/hetero_table.py --lpx-chip-watts 400 > table.md
    python scripts/hetero_table.py --models gpt-oss-120b --gpu vr200:72   # Rubin: speed-of-light bounds
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time

MODELS = ("kimi-k2", "deepseek-v3", "gpt-oss-120b", "llama-3.3-70b", "qwen3-235b-a22b")
SYSTEMS = ("lpx-rack", "lpx-system-2", "lpx-system-4")
HEADER = ("| model | LPX | mode | target tok/s/user | configuration | tok/s/user | tok/s per MW | racks GPU+LPX "
          "| × gpu-only | × gpu-only best | bound / note |\n|---|---|---|---|---|---|---|---|---|---|---|")


def holding_system(model: str, systems, dtype: str, context: int):
    """The first of ``systems`` whose chips' SRAM holds the model's weights and one sequence's cache, and None;
    or None and the LPX racks it would need at least (256 LP30s a rack)."""
    from lpx_tvm.app.plan.search import _chips_per_rack, model_spec
    from lpx_tvm.runtime_sim import DType
    from lpx_tvm.runtime_sim.system import load_system

    spec = model_spec(model)
    need = spec.chip_params() * DType.from_name(dtype).itemsize + spec.cache_bytes(context, 1, dtype)
    for name in systems:
        system = load_system(name)
        if need <= system.chips * system.chip.sram_bytes:
            return name, None
    system = load_system(systems[0])
    per_rack = _chips_per_rack(system) * system.chip.sram_bytes
    return None, -(-need // per_rack)


def _speed(target) -> str:
    return target if isinstance(target, str) else format(target, "g")


def _row(model, lpx, mode, target, r, base, best=None):
    """A markdown row; ``base`` gpu-only's report at the same target, ``best`` its most tokens/s per MW at any
    speed (its throughput configuration)."""
    from lpx_tvm.app.plan.hetero import _config

    if "error" in r:
        return f"| {model} | {lpx} | {mode} | {_speed(target)} | - | - | - | - | - | - | {r['error']} |"
    mw = r["tokens_per_s_per_mw"]
    ratio = "-"
    if mw is not None and base and "error" not in base and base.get("tokens_per_s_per_mw"):
        ratio = f"{mw / base['tokens_per_s_per_mw']:.2f}"
    elif mode != "gpu-only" and base and "error" in base:
        ratio = "gpu-only cannot"
    return (f"| {model} | {lpx} | {mode} | {_speed(target)} | {_config(r)} | {r['tokens_per_s_per_user']:.0f} "
            f"| "
            f"{'unknown' if mw is None else format(mw, ',.0f')} | {r['gpu_racks']}+{r['lpx_racks']} | {ratio} | "
            f"{'-' if mw is None or not best else f'{mw / best:.2f}'} | {r['bound']} |")


def one(args) -> int:
    """The child: one model's plan, a row per mode and target as each mode is done."""
    import logging

    from lpx_tvm.app.plan.hetero import _choose, hetero_plan

    logging.disable(logging.WARNING)
    system = args.system
    bases = {}

    from lpx_tvm.app.plan.gpu import gpu_system

    count = gpu_system(args.gpu).gpus

    def on_mode(name, report, points):
        for target in args.targets:
            r = report if "error" in report else _choose(name, points, None, target, count)
            if name == "gpu-only":
                bases[target] = r
                fits = [p["tokens_per_s_per_mw"] for p in points if p["fits"] and p["tokens_per_s_per_mw"]]
                bases["best"] = max(fits, default=None)
            print(_row(args.model, system, name, target, r, bases.get(target), bases.get("best")), flush=True)
        if name == "gpu-only" and points:  # the GPUs at their most tokens/s per MW, whatever the speed
            fits = [p for p in points if p["fits"]]
            if fits:
                top = max(fits, key=lambda p: p["tokens_per_s_per_mw"] or p["tokens_per_s_per_rack"])
                print(_row(args.model, system, name, "any (most per MW)", top, top, bases.get("best")), flush=True)

    start = time.perf_counter()
    # (lpx-draft's draft: the target's own, lpx_tvm.app.plan.hetero.DRAFTS)
    report = hetero_plan(args.model, system, args.gpu, dtype=args.dtype, context=args.context, prompt=args.prompt,
                         mode="auto", lpx_chip_watts=args.lpx_chip_watts, on_mode=on_mode)
    q = report["gpu"]["quant"]
    print(f"<!-- {args.model}: GPU side {q.get('text') or q.get('error')}; planned in "
          f"{time.perf_counter() - start:.0f} s -->", flush=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), help="LPX systems, smallest first")
    p.add_argument("--gpu", default="gb300:72")
    p.add_argument("--dtype", default="fp8")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--targets", type=float, nargs="+", default=[400, 1000], help="tokens/s per user")
    p.add_argument("--lpx-chip-watts", type=float, help="an LP30's power, assumed (none is published)")
    p.add_argument("--timeout", type=float, default=600, help="seconds a model's plan may take (default 600)")
    p.add_argument("--every-system", action="store_true",
                   help="plan each model beside every one of --systems, not only the smallest that holds it")
    p.add_argument("--one", metavar="MODEL", help=argparse.SUPPRESS)
    p.add_argument("--system", default=SYSTEMS[0], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        args.model = args.one
        return one(args)
    print(f"<!-- {args.gpu} beside LPX, {args.dtype}, {args.context}-position context, {args.prompt}-token prompt; "
          f"LP30 {'power unknown' if args.lpx_chip_watts is None else f'{args.lpx_chip_watts:g} W assumed'} -->")
    print(HEADER, flush=True)
    runs = []
    for model in args.models:
        system, _ = holding_system(model, args.systems, args.dtype, args.context)
        # with --every-system beside each system, one that does not hold the model too (lpx-draft needs only its
        # draft to fit; the modes with the target on LPX say the racks they need); else the smallest that holds it,
        # or the smallest where none does
        runs += [(model, s) for s in args.systems] if args.every_system else [(model, system or args.systems[0])]
    for model, system in runs:
        cmd = [sys.executable, os.path.abspath(__file__), "--one", model, "--gpu", args.gpu, "--dtype", args.dtype,
               "--context", str(args.context), "--prompt", str(args.prompt), "--targets",
               *map(str, args.targets)]
        cmd += ["--system", system]
        if args.lpx_chip_watts is not None:
            cmd += ["--lpx-chip-watts", str(args.lpx_chip_watts)]
        start = time.perf_counter()
        child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        late = threading.Event()

        def stop(child=child):
            late.set()
            child.kill()
        timer = threading.Timer(args.timeout, stop)
        timer.start()
        for line in child.stdout:  # each row as the child prints it
            sys.stdout.write(line)
            sys.stdout.flush()
        child.wait()
        timer.cancel()
        where = system
        if late.is_set():
            print(f"| {model} | {where} | (the rest) | - | - | - | - | - | - | - | skipped: the plan took over "
                  f"{args.timeout:.0f} s |")
        elif child.returncode:
            print(f"| {model} | {where} | - | - | - | - | - | - | - | - | the plan failed (exit {child.returncode}) |")
        sys.stdout.flush()
        print(f"<!-- {model}: {time.perf_counter() - start:.0f} s -->", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
