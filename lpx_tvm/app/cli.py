"""The ``lpx-tvm`` command: compile, run, profile, compare, quantize, disasm, zoo, generate, plan, sweep, bench.

Every error becomes one line on stderr and exit status 1. A user's mistake (an
:class:`~lpx_tvm.LpxUserError`, or a file the system cannot read or write) reads
``lpx-tvm <command>: error: ...``; anything else is a bug in lpx-tvm and reads
``lpx-tvm <command>: internal error: ...`` with a hint to rerun with ``--debug``,
which prints the traceback.
"""

from __future__ import annotations

import argparse
import csv
import logging
import os
import sys
import traceback
import warnings

from ..runtime_sim.errors import LpxUserError
from .output import FORMATS, Report, write


def _at_least(lowest: int):
    """An argparse type: an integer no less than ``lowest``."""
    def parse(text: str) -> int:
        value = int(text)
        if value < lowest:
            raise ValueError(text)
        return value
    parse.__name__ = {0: "non-negative integer", 1: "positive integer"}[lowest]  # (argparse's error names it)
    return parse


def _show(args, report: Report) -> None:
    """Print a command's result in its ``--format``, and write its JSON to ``--json PATH`` where given."""
    write(report, args.format, sys.stdout)
    if getattr(args, "json", None):
        with open(args.json, "w") as fh:
            write(report, "json", fh)
        _say(args, f"wrote {args.json}")


def _say(args, line: str) -> None:
    """A line about a file written: on stdout beside text, on stderr beside JSON or markdown (stdout stays the
    one document)."""
    print(line, file=sys.stdout if getattr(args, "format", "text") == "text" else sys.stderr)


def _input_shapes(values) -> dict:
    shapes = {}
    for value in values or []:
        name, _, dims = value.rpartition("=")
        try:
            shapes[name] = [int(d) for d in dims.split(",")]
        except ValueError:
            raise LpxUserError(f"--input-shape {value!r}: expected name=d0,d1,...") from None
        if not name:
            raise LpxUserError(f"--input-shape {value!r}: expected name=d0,d1,...")
    return shapes


def _model(args):
    """The model a command runs: the file, or the QDQ model ``--dtype int8`` made of a float one."""
    return getattr(args, "qdq", None) or args.model


def _pinned(args, model=None):
    """``model`` (default: the command's) loaded with the ``--input-shape`` pins."""
    from ..frontend import load_onnx, prepare_onnx

    return prepare_onnx(load_onnx(model if model is not None else _model(args)), _input_shapes(args.input_shape))


def _static(args, proto):
    """``proto``, whose every input has a size (seeded or calibration inputs need them); else an error naming
    the symbolic dims and the pin to add."""
    from ..frontend import dynamic_inputs, pin_advice

    if dynamic_inputs(proto.graph):
        raise LpxUserError(f"{args.model}: {pin_advice(dynamic_inputs(proto.graph))}")
    return proto


def _seeded_calibration(model, count: int) -> list:
    from .tools.zoo import seeded_inputs

    return [seeded_inputs(model, seed) for seed in range(1, count + 1)]


def _compile(args):
    import lpx_tvm

    # (under expert or auto parallelism, compile rewrites a mixture of experts as exporters write it so that
    # its experts spread, and says why where it cannot)
    from ..codegen import Target

    return lpx_tvm.compile(_model(args), input_shapes=_input_shapes(args.input_shape), target=Target.from_args(args))


def placement(compiled) -> list:
    """One line per lpx program of a model compiled for a system: the chips it runs on and how it was mapped.

    A program that runs on fewer chips than asked (a function with no experts, a short pipeline) is then
    never silent, and ``auto`` says what it chose.

    Parameters
    ----------
    compiled : lpx_tvm.compiler.CompiledModel

    Returns
    -------
    list of str
        ``"<function>: <n> chips [<ids>], <strategy>: <notes>"`` for each system program; none on one chip.
    """
    lines = []
    for name, sim in compiled.simulators.items():
        program = getattr(sim, "program", None)
        chips = getattr(program, "chips", None)
        if chips is None or not hasattr(sim, "sims"):
            continue
        lines.append(f"{name}: {len(chips)} chip{'s' if len(chips) != 1 else ''} {list(chips)}, "
                     f"{program.parallel}: {program.notes}")
    return lines


def _offload(compiled) -> dict:
    """What went to lpx and where, for a record: the offload's figures and the placement lines."""
    return {"offload": compiled.report.to_dict(), "placement": placement(compiled)}


def cmd_compile(args) -> int:
    if not args.output and not args.emit_program:
        raise LpxUserError("say what to write: -o MODEL.so (the library) and/or --emit-program PROGRAM.bin")
    compiled = _compile(args)
    lines, record = [], {"library": args.output, **_offload(compiled), "programs": []}
    if args.output:
        compiled.export_library(args.output)
        lines += [f"wrote {args.output}: {compiled.report.summary()}", *record["placement"]]
    if args.emit_program:
        record["programs"] = emit_programs(compiled, args.emit_program)
        lines += [f"wrote {path} (read it with: lpx-tvm disasm {path})" for path in record["programs"]]
    _show(args, Report(f"{args.model} compiled", ["\n".join(lines)], record))
    return 0


def emit_programs(compiled, path) -> list:
    """Write a compiled model's encoded LPX programs: ``path`` for one, ``<stem>.<k><suffix>`` for several."""
    from pathlib import Path

    path = Path(path)
    names = list(compiled.programs)
    if not names:
        raise LpxUserError("nothing was offloaded to lpx, so there is no program to write")
    paths = [path] if len(names) == 1 else [path.with_name(f"{path.stem}.{k}{path.suffix}") for k in range(len(names))]
    for target, name in zip(paths, names):
        compiled.programs.write(name, target)  # (from where the executable holds it: a program is mostly weights)
    return [str(p) for p in paths]


def cmd_run(args) -> int:
    from .tools.zoo import compare, constant_weights, file_inputs, seeded_inputs

    model = _static(args, _pinned(args))
    feeds = file_inputs(model, args.inputs) if args.inputs else seeded_inputs(model)
    if constant_weights(model):
        warnings.warn(f"{args.model}: every weight is one constant value, so agreeing with ONNX Runtime proves "
                      "little (lpx-tvm zoo --save DIR writes the zoo's models with seeded random weights)",
                      UserWarning, stacklevel=1)
    compiled = _compile(args)
    outputs = compiled(*[feeds[name] for name, _, _ in compiled.input_signature])
    record = {**_offload(compiled), "outputs": [{"dtype": str(out.dtype), "shape": list(out.shape),
                                                 "mean": float(out.mean())} for out in outputs]}
    lines = [compiled.report.summary(), *record["placement"]]
    lines += [f"output {i}: {o['dtype']}{o['shape']} mean {o['mean']:.6g}" for i, o in enumerate(record["outputs"])]
    try:
        import onnxruntime as ort
    except ImportError:
        ort = None
    if ort is not None:
        refs = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
        record["vs_onnxruntime"] = compare(outputs, refs)
        lines.append("vs ONNX Runtime: " + ", ".join(f"{k} {v:.3g}" for k, v in record["vs_onnxruntime"].items()))
    _show(args, Report(f"{args.model} on lpx", ["\n".join(lines)], record))
    return 0


def cmd_profile(args) -> int:
    from ..runtime_sim.trace import write_trace
    from .tools.profile import profile, table

    if args.stream and getattr(args, "system", None):
        raise LpxUserError("--stream times one chip; leave out --system")
    compiled = _compile(args)
    report = {**profile(compiled), **_offload(compiled)}
    notes = [compiled.report.summary(), *report["placement"]]
    if args.stream:
        from .tools.profile import stream

        run = report["stream"] = stream(_model(args), args.stream, args.config, _input_shapes(args.input_shape),
                                        args.dtype)
        notes.append(f"stream of {run['copies']} back-to-back inferences: {run['cycles']} cycles, "
                     f"{run['cycles_per_inference']:.0f} per inference = {run['inferences_per_s']:.0f} inferences/s "
                     f"(one alone: {report['simulated_cycles']} cycles, {report['microseconds']:.1f} µs latency, "
                     f"{1e6 / report['microseconds']:.0f} inferences/s)")
    result = table(report, args.top)
    result.notes += notes
    _show(args, result)
    if args.trace:
        write_trace(args.trace, list(compiled.simulators.items()))
        _say(args, f"wrote {args.trace}: open it in https://ui.perfetto.dev or chrome://tracing")
    if args.plot:
        from .tools.plots import roofline

        report["model"] = args.model
        _say(args, f"wrote {roofline(report, args.plot)} (the layers' roofline)")
    if args.timeline:
        import tempfile

        from .tools.plots import timeline

        with tempfile.TemporaryDirectory() as tmp:
            trace = args.trace or os.path.join(tmp, f"{os.path.splitext(os.path.basename(args.model))[0]}.json")
            if not args.trace:
                write_trace(trace, list(compiled.simulators.items()))
            _say(args, f"wrote {timeline(trace, args.timeline)} (the programs' timeline, a row per track)")
    return 0


def cmd_compare(args) -> int:
    from .tools.compare import compare, table

    feeds = None
    if args.inputs:
        from .tools.zoo import file_inputs

        feeds = file_inputs(_static(args, _pinned(args)), args.inputs)
    report = compare(_model(args), config=args.config or "tsp", dtype=args.dtype, input_shapes=_input_shapes(args.input_shape),
                     min_cosine=args.min_cosine, feeds=feeds)
    _show(args, table(report))
    return 0


def cmd_quantize(args) -> int:
    from collections import Counter

    import onnx

    import lpx_tvm

    from .tools.zoo import file_inputs

    model = _static(args, _pinned(args))
    if args.inputs:
        feeds, source = [file_inputs(model, args.inputs)], args.inputs
    else:
        feeds = _seeded_calibration(model, args.seeded)
        source = f"{args.seeded} seeded input(s): real inputs (--calibration FILE.npz) calibrate better"
    qdq = lpx_tvm.quantize(model, feeds, per_channel=args.per_channel, activations=args.activations)
    onnx.save(qdq, args.output)
    counts = Counter(node.op_type for node in qdq.graph.node)
    print(f"wrote {args.output}: {counts.get('QuantizeLinear', 0)} QuantizeLinear, "
          f"{counts.get('DequantizeLinear', 0)} DequantizeLinear, calibrated on {source}; run it with "
          f"--dtype int8")
    return 0


def cmd_zoo(args) -> int:
    from ..codegen.target import chip_of
    from .tools.zoo import COLUMNS, DEFAULT_MODELS, check_names, run_zoo, save, table

    names = check_names(args.models or DEFAULT_MODELS)
    if args.save:
        if len(names) > 1 and args.save.endswith(".onnx"):
            raise LpxUserError(f"--save {args.save}: a .onnx file holds one model; give a directory for "
                               f"{len(names)}")
        for name in names:
            _say(args, f"wrote {save(name, args.save, 'int8' if args.dtype == 'int8' else 'fp32')}")
        return 0
    chip_of(args.config)  # a bad --config fails once, before any model
    records = run_zoo(names, config=args.config, llvm=not args.skip_llvm, dtype=args.dtype)
    _show(args, table(records))
    if args.csv:  # the table's columns in its order, then the rest of each record
        shown = [key for key, _ in COLUMNS]
        keys = shown + sorted({k for r in records for k in r} - set(shown))
        with open(args.csv, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=keys)
            writer.writeheader()
            writer.writerows(records)
    return 0 if all(r["ok"] for r in records) else 1


def cmd_bench(args) -> int:
    from .tools.bench import SCHEDULE_WORKLOADS, compile_scaling, run_bench, schedule_bench, table
    from .tools.zoo import check_names

    records = run_bench(check_names(args.models), args.repeat)
    schedule = [row for model, dtypes in SCHEDULE_WORKLOADS for row in schedule_bench(model, dtypes=dtypes)]
    report = table({"speed": records, "schedule": schedule, "compile_scaling": compile_scaling()})
    _show(args, report)
    if args.markdown:
        from .output import write_into

        write_into(report, args.markdown, "lpx-tvm bench --markdown")
        _say(args, f"wrote {args.markdown}")
    return 0 if all("error" not in r for r in records) else 1


def cmd_sweep(args) -> int:
    from .tools.sweep import load_spec, run_sweep, store_path, table, write_results

    spec = load_spec(args.spec)
    out = args.out or str(args.spec).rsplit(".", 1)[0] + ".csv"
    records = run_sweep(spec, store_path(out), workers=args.workers, address=args.address,
                        progress=not args.no_progress)
    _show(args, table(records, spec.metrics))
    ok = sum(bool(r.get("ok")) for r in records)
    _say(args, f"{ok}/{len(records)} points ok; wrote {write_results(records, out)} (every point also in "
         f"{store_path(out)}: a re-run skips what is there)")
    if args.plot:
        from .tools.plots import pareto

        _say(args, f"wrote {pareto(records, args.plot)} (latency against the die-area proxy; Pareto fronts in red)")
    return 0 if ok == len(records) else 1


def cmd_generate(args) -> int:
    from .llm.generate import generate, table

    prompt_ids = None
    if args.prompt_ids is not None:
        try:
            prompt_ids = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise LpxUserError(f"--prompt-ids {args.prompt_ids!r}: expected token ids, as 1,2,3") from None
    if args.users is not None and args.users > 1:
        from .llm.users import generate_users, table as users_table

        if (args.parallel or "pipeline") != "pipeline":
            raise LpxUserError("--users runs users through a pipeline: leave --parallel out or give pipeline")
        if args.prompt_ids is not None or args.prompt is not None or args.temperature:
            raise LpxUserError("--users seeds each user's prompt (--seed) and decodes greedily: leave --prompt, "
                               "--prompt-ids and --temperature out")
        report = generate_users(args.model, users=args.users, tokens=args.tokens, system=args.system,
                                chips=args.chips, dtype=args.dtype, prompt_len=args.prompt_len, seed=args.seed,
                                context=args.context, progress=lambda text: print(text, file=sys.stderr, flush=True))
        _show(args, users_table(report))
        return 0 if report["agree"] else 1
    report = generate(args.model, tokens=args.tokens, system=args.system, parallel=args.parallel or "pipeline",
                      config=args.config, chips=args.chips, dtype=args.dtype, prompt_len=args.prompt_len,
                      progress=lambda text: print(text, file=sys.stderr, flush=True), prompt_ids=prompt_ids,
                      prompt=args.prompt, temperature=args.temperature, top_k=args.top_k, seed=args.seed,
                      context=args.context)
    _show(args, table(report))
    return 0 if report["agree"] else 1


# plan's flags for LPX alone, and for LPX beside GPUs, with their defaults
_PLAN_LPX_ALONE = {"batch": 1, "batches": [1, 4], "chips": None, "users": None, "target_ttft_ms": None,
                   "prefill_chips": None, "draft_tokens": None}
_PLAN_BESIDE_GPUS = {"gpu_link": None, "gpu_quant": None, "lpx_chip_watts": None, "max_racks": None}


def cmd_plan(args) -> int:
    from ..codegen import Target
    from .plan.search import plan, table

    target = args.target_tps_per_user
    if args.target_tpot_ms is not None:
        if not 0 < args.target_tpot_ms < float("inf"):
            raise LpxUserError(f"--target-tpot-ms must be a positive number of milliseconds, got {args.target_tpot_ms}")
        target = 1000 / args.target_tpot_ms
    beside_gpus = args.gpu is not None or args.mode not in (None, "lpx-only")
    # each path's own flags: a flag the chosen path would not use is refused, never dropped
    unused = _PLAN_LPX_ALONE if beside_gpus else _PLAN_BESIDE_GPUS
    given = [f"--{name.replace('_', '-')}" for name, default in unused.items() if getattr(args, name) != default]
    if given and beside_gpus:
        raise LpxUserError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for a plan of LPX alone, not "
                           "one beside GPUs (--gpu, --mode)")
    if given:
        raise LpxUserError(f"{', '.join(given)} {'needs' if len(given) == 1 else 'need'} --gpu (a plan beside GPUs, "
                           "e.g. --gpu gb300:72)")
    if beside_gpus:
        return _plan_beside_gpus(args, target)
    where = Target.parse(system=args.system or "tsp-rack", dtype=args.dtype or "fp16")  # parsed once, here
    report = plan(args.model, target=where, context=args.context, prompt=args.prompt,
                  batch=args.batch, chips=args.chips, target_tps_per_user=target,
                  batches=args.batches, progress=lambda line: print(line, file=sys.stderr, flush=True),
                  users=args.users, target_ttft_ms=args.target_ttft_ms, draft=args.draft,
                  draft_tokens=args.draft_tokens, accept_rate=args.accept_rate, prefill_chips=args.prefill_chips,
                  verify=args.verify)
    _show(args, table(report))
    if args.plot:
        from .tools.plots import plan_frontier

        _say(args, f"wrote {plan_frontier(report, args.plot)} (tokens/s per user against tokens/s per chip)")
    return 0


def _plan_beside_gpus(args, target) -> int:
    """``plan --gpu``: LPX beside GPUs in one mode or all (:mod:`.hetero`)."""
    from ..codegen import Target
    from .plan.gpu import gpu_system, require_aiconfigurator
    from .plan.hetero import hetero_plan, lpx_system, plot, table

    if args.gpu is None:
        raise LpxUserError(f"--mode {args.mode} needs --gpu (the GPUs beside LPX, e.g. --gpu gb300:72)")
    require_aiconfigurator()
    where = Target.parse(system=lpx_system(args.system or "lpx-rack"), dtype=args.dtype or "fp8",
                         gpu=gpu_system(args.gpu, args.gpu_link))  # parsed once, here
    report = hetero_plan(args.model, target=where, context=args.context, prompt=args.prompt,
                         mode=args.mode or "auto", lpx_chip_watts=args.lpx_chip_watts, max_racks=args.max_racks,
                         target_tps_per_user=target, draft=args.draft,
                         accept_rate=0.7 if args.accept_rate is None else args.accept_rate,
                         progress=lambda line: print(line, file=sys.stderr, flush=True), gpu_quant=args.gpu_quant,
                         verify=args.verify)
    _show(args, table(report))
    if args.plot:
        _say(args, f"wrote {plot(report, args.plot)} (tokens/s per MW against tokens/s per user, every mode)")
    return 0


def cmd_disasm(args) -> int:
    from ..runtime_sim import decode, disassemble

    if args.model.endswith(".onnx"):
        for name, blob in _compile(args).programs.items():
            print(f"; ---- {name}")
            print(disassemble(decode(blob)))
    else:
        with open(args.model, "rb") as fh:
            print(disassemble(decode(fh.read())))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from importlib.metadata import PackageNotFoundError, version

    from ..codegen import DTYPES, Target
    from ..runtime_sim import available_configs
    from ..runtime_sim.system import available_systems
    from .tools.zoo import ZOO

    try:
        release = version("lpx-tvm")
    except PackageNotFoundError:  # run from a source tree that was never installed
        release = "unknown (not installed)"
    parser = argparse.ArgumentParser(prog="lpx-tvm", description="Compile and run ONNX models on the LPX simulator.")
    parser.add_argument("--version", action="version", version=f"lpx-tvm {release}")
    parser.add_argument("--debug", action="store_true", help="show Python tracebacks and TVM's own log on errors")
    # --debug is accepted after the subcommand too; SUPPRESS keeps a subcommand from resetting the top-level one
    debug_anywhere = argparse.ArgumentParser(add_help=False)
    debug_anywhere.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                                help="show Python tracebacks and TVM's own log on errors")
    sub = parser.add_subparsers(dest="command", required=True)
    config_help = f"chip preset ({', '.join(available_configs())}) or a JSON preset file (default tsp)"

    def model_command(name, help_text, func):
        p = sub.add_parser(name, help=help_text, parents=[debug_anywhere])
        p.add_argument("model", help="an ONNX file or an encoded program (compile --emit-program)"
                       if name == "disasm" else "an ONNX file")
        Target.add_arguments(p, system=name in ("compile", "run", "profile"))
        p.add_argument("--input-shape", action="append", metavar="NAME=D0,D1,...", help="pin an input's shape")
        p.set_defaults(func=func)
        return p

    p = model_command("compile", "compile to a shared library and/or write the LPX program", cmd_compile)
    p.add_argument("-o", "--output", help="the .so to write (tvm.runtime.load_module reloads it)")
    p.add_argument("--emit-program", metavar="PROGRAM.bin", help="write the encoded LPX program (lpx-tvm disasm reads it)")
    inputs_help = ("an .npz of input arrays by name (numpy.savez); inputs it leaves out are seeded as what they "
                   "are (ids within their table, masks of ones, token types of zeros, floats from a normal)")
    p = model_command("run", "run on seeded inputs (or --inputs) and compare with ONNX Runtime", cmd_run)
    p.add_argument("--inputs", metavar="FILE.npz", help=inputs_help)
    from ..runtime_sim.critical import LEGEND as BOUND_LEGEND

    p = model_command("profile", "per-layer cycles, roofline and utilisation", cmd_profile)
    p.description = ("Per layer: its start, span (first issue to last result; layers overlap), exclusive share "
                     "(each cycle split among the layers busy in it: the shares add up to the program), MACs and "
                     "what bound it. " + BOUND_LEGEND + ".")
    p.add_argument("--trace", help="write a Chrome/Perfetto trace-event file")
    p.add_argument("--json", help="write the profile as JSON")
    p.add_argument("--top", type=_at_least(0), default=20, help="show the N slowest layers (0: all; default 20)")
    p.add_argument("--plot", metavar="ROOFLINE.png", help="draw the layers' roofline (needs lpx-tvm[plot])")
    p.add_argument("--timeline", metavar="TIMELINE.png", help="draw the trace's timeline, a row per track (needs "
                   "lpx-tvm[plot])")
    p.add_argument("--stream", type=_at_least(1), metavar="N", help="also time N back-to-back inferences as one "
                   "schedule (each next input's transfer overlaps the current compute): inferences/s")
    model_command("disasm", "print the LPX programs (an ONNX file or an encoded program)", cmd_disasm)
    p = model_command("compare", "compare every layer's output with ONNX Runtime's", cmd_compare)
    p.add_argument("--min-cosine", type=float, default=0.999, help="a layer below this parts ways (default 0.999)")
    p.add_argument("--json", help="write the per-layer comparison as JSON")
    p.add_argument("--inputs", metavar="FILE.npz", help=inputs_help)
    p = sub.add_parser("quantize", help="quantise an fp32 model with ONNX Runtime's static quantiser (QDQ) for "
                       "--dtype int8", parents=[debug_anywhere])
    p.add_argument("model", help="an fp32 ONNX file")
    p.add_argument("-o", "--output", required=True, help="the QDQ ONNX file to write")
    p.add_argument("--input-shape", action="append", metavar="NAME=D0,D1,...", help="pin an input's shape")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--calibration", "--inputs", dest="inputs", metavar="FILE.npz",
                       help="calibrate on these inputs (" + inputs_help + ")")
    group.add_argument("--seeded", type=_at_least(1), default=4, help="calibrate on this many seeded inputs "
                       "(default 4, without --calibration)")
    p.add_argument("--activations", default="int8", choices=["int8", "uint8"], help="activation type (default int8)")
    p.add_argument("--per-channel", action=argparse.BooleanOptionalAction, default=True,
                   help="a scale per output channel of each weight (default; lpx's int8 kernels expect it)")
    p.set_defaults(func=cmd_quantize)
    p = sub.add_parser("zoo", help="run the model zoo against ONNX Runtime", parents=[debug_anywhere])
    p.add_argument("--models", nargs="+", metavar="NAME", help=f"zoo models (default: all): {', '.join(ZOO)}")
    p.add_argument("--config", default="tsp", help=config_help)
    p.add_argument("--save", metavar="DIR", help="write the models as ONNX files with their seeded weights (int8 "
                   "with --dtype int8) into DIR (created when missing; FILE.onnx for one model) instead of running "
                   "them")
    p.add_argument("--json", help="write one record per model")
    p.add_argument("--csv", help="write the table as CSV")
    p.add_argument("--skip-llvm", action="store_true", help="do not time TVM's llvm-only build")
    p.add_argument("--dtype", default="fp32", choices=DTYPES,
                   help="storage type on lpx; int8 quantises each model with lpx_tvm.quantize first")
    p.set_defaults(func=cmd_zoo)
    from .models.llama import PRESETS as LLAMA_PRESETS

    p = sub.add_parser("generate", help="a decoder LLM: prefill and greedy decode steps, each checked against "
                       "ONNX Runtime", parents=[debug_anywhere])
    p.add_argument("model", help=f"a preset ({', '.join(LLAMA_PRESETS)}), a directory of prefill.onnx and "
                   "decode.onnx (lpx_tvm.app.models.llama.save_llama), or a decoder in Hugging Face form: an .onnx graph "
                   "with past_key_values.N inputs and present.N outputs, or an optimum export folder; its past "
                   "and sequence lengths must be symbolic, not fixed (export them dynamic: torch.onnx.export "
                   "dynamic_shapes, as optimum does)")
    p.add_argument("--tokens", type=int, default=16, help="decode steps after the prefill (default 16)")
    p.add_argument("--prompt-len", type=int, default=8, help="seeded prompt tokens, where no prompt is given "
                   "(default 8)")
    p.add_argument("--context", type=_at_least(1), help="cache slots on the chips (default: a preset's context; "
                   "a Hugging Face graph's prompt and new tokens)")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt-ids", metavar="1,2,3", help="the prompt's token ids")
    prompt.add_argument("--prompt", metavar="TEXT", help="the prompt as text (a folder with a tokenizer.json; "
                        "needs the tokenizers package); the generated text comes back too")
    p.add_argument("--temperature", type=float, default=0.0, help="sample at this temperature (default 0: greedy); "
                   "each step's one seeded draw picks lpx's token and ORT's alike")
    p.add_argument("--top-k", type=_at_least(1), help="sample from the k most likely tokens only")
    p.add_argument("--seed", type=int, default=0, help="the seeded weights', prompt's and draws' seed (default 0)")
    Target.add_arguments(p, dtypes=("fp32", "fp16", "bf16", "int8", "fp8"), dtype_help="storage type on the chips "
                         "(int8: a float decoder is quantised with ONNX Runtime's static quantiser first, on seeded "
                         "steps, and ORT runs the same QDQ graphs; fp8 needs an fp8 chip: --config lp30)")
    p.add_argument("--users", type=_at_least(1), help="decode this many users' sequences through the --system "
                   "pipeline at once (each its own seeded prompt and cache, each checked against ONNX Runtime), "
                   "and time the steady state: how soon each chip may take the next user's step")
    p.add_argument("--json", help="write the run as JSON")
    p.set_defaults(func=cmd_generate)
    from .plan.search import PRESETS as PLAN_PRESETS

    p = sub.add_parser("plan", help="chips and racks an LLM needs for a decode speed, and what bounds it",
                       parents=[debug_anywhere])
    p.add_argument("--model", required=True, help=f"a config.json or a preset: {', '.join(PLAN_PRESETS)}, "
                   f"{', '.join(LLAMA_PRESETS)}")
    p.add_argument("--system", help=f"{', '.join(available_systems())} (default tsp-rack; with --gpu lpx-rack)")
    p.add_argument("--dtype", choices=["int8", "fp8", "fp16", "bf16", "fp32"],
                   help="storage type of weights, cache and activations (the chip must run it; default fp16, "
                   "with --gpu fp8)")
    p.add_argument("--context", type=int, default=4096, help="KV-cache positions per sequence (default 4096)")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens, for the time to first token")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together (default 1)")
    p.add_argument("--batches", type=int, nargs="*", default=[1, 4], help="batch sizes on the frontier "
                   "(default 1 4; each costs a block's compile per width)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--chips", type=int, help="use at most this many chips")
    group.add_argument("--target-tps-per-user", type=float, help="the fewest chips that reach this speed")
    group.add_argument("--target-tpot-ms", type=float, help="the fewest chips whose time per output token is at "
                       "most this (the same as --target-tps-per-user 1000/T)")
    p.add_argument("--target-ttft-ms", type=float, help="the time to first token (--prompt tokens through every "
                   "stage) must be at most this: the cheapest mapping that meets it and the other targets")
    p.add_argument("--users", type=_at_least(1), help="the fewest chips that hold this many users in flight, "
                   "each one's KV cache at --context on the chips (with a target: that meet it too)")
    p.add_argument("--prefill-chips", type=_at_least(1), metavar="N", help="a separate prefill pool of N chips: "
                   "decode takes the others, and the KV cache is handed over the network (timed)")
    p.add_argument("--draft", metavar="MODEL", help="speculative decoding: this draft model (a preset or a config "
                   "file) on the chips the target leaves; the target verifies its tokens in one step. With --gpu, "
                   "lpx-draft's draft (default: the target's own, e.g. qwen3-0.6b for qwen3-235b-a22b, "
                   "deepseek-v3-nextn for deepseek-v3; one of another vocabulary is refused)")
    p.add_argument("--draft-tokens", type=_at_least(1), metavar="K", help="tokens the draft proposes a round "
                   "(default: the k that serves a user fastest)")
    p.add_argument("--accept-rate", type=float, metavar="A", help="the chance the target accepts a draft token "
                   "(default 0.7)")
    p.add_argument("--verify", action="store_true", help="compile and time every stage of the chosen mapping "
                   "whole (its layers as one program) and print the plan's error (the JSON's verify_error); "
                   "with --gpu, the LPX half of lpx-only, lpx-decode and afd (AFD: a stage's FFN layers)")
    p.add_argument("--gpu", metavar="NAME[:N]", help="plan LPX beside N GPUs (default one rack), priced by NVIDIA's "
                   "AIConfigurator (needs lpx-tvm[gpu]): gb300, gb200, b200, h200, h100 (measured kernel tables), "
                   "gb300-sol, vr200 (speed of light; vr200 derived from NVIDIA's preliminary Rubin figures)")
    p.add_argument("--gpu-link", metavar="GBPS[,US]", help="the GPU-LPX link: GB/s a GPU each way and optionally "
                   "its latency in µs (default: the GPU's system file's figure, assumed: no official one)")
    p.add_argument("--gpu-quant", metavar="auto|checkpoint|FAMILY=MODE[,...]", help="with --gpu: the GPU side's "
                   "AIConfigurator quantisation modes. auto (default): --dtype's where its tables hold them, else "
                   "as it deploys the published checkpoint (the report names each mode and why); checkpoint: its "
                   "reading of the model's quantization_config throughout; or modes by family, gemm, moe, fmha, "
                   "kv (e.g. moe=w4a8_mxfp4_mxfp8,fmha=bfloat16)")
    p.add_argument("--mode", choices=["gpu-only", "lpx-only", "lpx-decode", "afd", "lpx-draft", "auto"],
                   help="with --gpu: gpu-only (AIConfigurator's figures alone), lpx-only (this plan), lpx-decode "
                   "(GPU prefill, KV cache handed to LPX, LPX decodes), afd (GPU attention, LPX FFN, activations "
                   "exchanged each layer), lpx-draft (draft on LPX, verify on the GPUs), auto (every one and the "
                   "frontier; the default)")
    p.add_argument("--lpx-chip-watts", type=float, metavar="W", help="an LP30's power (no public figure): needed "
                   "for tokens/s per MW of the modes that use LPX")
    p.add_argument("--max-racks", type=_at_least(1), metavar="N", help="with --gpu: a mode needing more racks (GPU "
                   "and LPX) says so and names what binds")
    p.add_argument("--json", help="write the plan as JSON")
    p.add_argument("--plot", metavar="FRONTIER.png", help="draw the frontier (needs lpx-tvm[plot]); with --gpu, "
                   "tokens/s per MW against tokens/s per user for every mode")
    p.set_defaults(func=cmd_plan)
    p = sub.add_parser("sweep", help="chip variants × models × dtypes: compiled, timed, Pareto fronts (on Ray)",
                       parents=[debug_anywhere])
    p.add_argument("spec", help="a sweep spec (.json, .toml or .yaml): base, grid/variants, models, dtypes")
    p.add_argument("--address", help="a Ray cluster to join (ray://HOST:PORT); default: a local Ray")
    p.add_argument("--workers", type=_at_least(0), help="Ray worker processes (default: the cores; 0: no Ray, here)")
    p.add_argument("--out", help="results .csv or .parquet (default: beside the spec); the .jsonl beside it "
                   "keeps every point, so a re-run resumes")
    p.add_argument("--plot", metavar="PARETO.png", help="draw the Pareto fronts (needs lpx-tvm[plot])")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_sweep)
    from .tools.bench import DEFAULT_BENCH_MODELS

    p = sub.add_parser("bench", help="time the flow itself: simulator vs ORT, compile vs TVM llvm, peak RSS",
                       parents=[debug_anywhere])
    p.add_argument("--models", nargs="+", metavar="NAME", default=list(DEFAULT_BENCH_MODELS),
                   help=f"zoo models (default: {' '.join(DEFAULT_BENCH_MODELS)})")
    p.add_argument("--repeat", type=_at_least(1), default=10, help="timed calls per engine (median)")
    p.add_argument("--json", help="write the run as JSON (its speed, schedule and compile-scaling records)")
    p.add_argument("--markdown", metavar="PAGE", help="write the tables into a markdown page (docs/results.md) "
                   "between this command's markers, with the commit, machine and day that measured them")
    p.set_defaults(func=cmd_bench)
    for name in ("compile", "run", "profile", "compare", "zoo", "generate", "plan", "sweep", "bench"):
        sub.choices[name].add_argument("--format", choices=FORMATS, default="text", help="print the result as "
                                       "text, markdown or json (the record --json writes; lines about files written "
                                       "then go to stderr)")
    return parser


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"lpx-tvm: warning: {category.__name__}: {message}\n"


_OUTPUTS = ("output", "emit_program", "json", "trace", "plot", "out")  # the options that name a file to write


def quantised_if_float(args) -> None:
    """``--dtype int8`` on a float ONNX model: quantise it first, on seeded inputs, and say so (``args.qdq``
    holds the QDQ model, which the command then runs in its place)."""
    if getattr(args, "dtype", None) != "int8" or not str(args.model).endswith(".onnx"):
        return
    import lpx_tvm

    model = _pinned(args, args.model)
    if any(node.op_type == "QuantizeLinear" for node in model.graph.node):
        return
    _static(args, model)
    print(f"lpx-tvm: note: {args.model} is a float model: quantised with ONNX Runtime's static quantiser on 4 "
          "seeded inputs first (lpx-tvm quantize --calibration FILE.npz calibrates on real ones)",
          file=sys.stderr)
    args.qdq = lpx_tvm.quantize(model, _seeded_calibration(model, 4))


def _check_before_running(args) -> None:
    """What the arguments get wrong that would only show after the work: a file to write in a folder that
    does not exist, or a multi-chip option without a system."""
    from pathlib import Path

    for name in _OUTPUTS:
        path = getattr(args, name, None)
        if path and not Path(path).resolve().parent.is_dir():
            flag = "-o/--output" if name == "output" else "--" + name.replace("_", "-")
            raise LpxUserError(f"{flag} {path}: the folder {Path(path).resolve().parent} does not exist")
    for name in ("parallel", "chips"):  # (plan's system has a default)
        if getattr(args, name, None) is not None and getattr(args, "system", None) is None and args.command != "plan":
            raise LpxUserError(f"--{name} needs --system (a system of chips to run on)")


def is_user_error(err: BaseException) -> bool:
    """Whether ``err`` is the user's to fix rather than a bug in lpx-tvm.

    Parameters
    ----------
    err : BaseException
        What a command raised.

    Returns
    -------
    bool
        True for an :class:`~lpx_tvm.LpxUserError`, and for an ``OSError`` (a file that is missing,
        unreadable or on a full disk is the user's environment, not the compiler); False otherwise.
    """
    return isinstance(err, (LpxUserError, OSError))


def error_line(command: str, err: BaseException) -> str:
    """The one line the CLI prints for an error a command raised.

    Parameters
    ----------
    command : str
        The subcommand that raised, as typed (``run``, ``plan``, ...).
    err : BaseException
        What it raised.

    Returns
    -------
    str
        ``lpx-tvm <command>: error: <type>: <message>`` for a user's mistake (:func:`is_user_error`; no
        type when it is the bare :class:`~lpx_tvm.LpxUserError`);
        ``lpx-tvm <command>: internal error: <type>: <message> (...rerun with --debug...)`` for anything
        else. Only the message's first line is kept.
    """
    # a named class says which stage refused (FrontendError, CapacityError); the bare root says nothing
    what = (str(err) if type(err) is LpxUserError else f"{type(err).__name__}: {err}").splitlines()[0]
    if is_user_error(err):
        return f"lpx-tvm {command}: error: {what}"
    return (f"lpx-tvm {command}: internal error: {what} (a bug in lpx-tvm, not in your input; rerun with --debug "
            "for the traceback, and report it with that)")


def main(argv=None) -> int:
    """Entry point of the ``lpx-tvm`` command."""
    args = build_parser().parse_args(argv)
    # --debug lasts one command: a later main() in the same process (a notebook's, a test's) keeps TVM's native
    # output from the user again
    logger, root = logging.getLogger("lpx_tvm"), logging.getLogger()
    previous_level, previous_handlers = logger.level, list(root.handlers)
    if args.debug:  # TVM's native log lines (kept from the user otherwise) and lpx's own, as they happen
        logging.basicConfig(format="lpx-tvm: debug: %(name)s: %(message)s")
        logger.setLevel(logging.DEBUG)
    previous_format = warnings.formatwarning
    if not args.debug:  # warnings as one line each, without the source line they were raised from
        warnings.formatwarning = _one_line_warning
    try:
        _check_before_running(args)
        if args.command in ("compile", "run", "profile", "compare", "disasm"):
            quantised_if_float(args)
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `lpx-tvm disasm ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as err:  # the CLI's contract: one line, no traceback unless --debug
        print(error_line(args.command, err), file=sys.stderr)
        if args.debug:
            traceback.print_exc()
        return 1
    finally:
        warnings.formatwarning = previous_format
        logger.setLevel(previous_level)
        for handler in set(root.handlers) - set(previous_handlers):
            root.removeHandler(handler)


if __name__ == "__main__":
    sys.exit(main())
