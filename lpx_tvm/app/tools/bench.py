"""Benchmark the flow itself, side by side in one run: simulator vs ONNX Runtime, lpx compile vs TVM llvm.

Times are medians over repeated calls in one fresh process a model, the
engines timed in turns (these machines are noisy, so only ratios taken
together mean anything). Peak RSS is measured in a fresh child process per
engine, each reporting its own high-water mark. The
simulator runs with its schedule checks on: they happen once, at program load.
"""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np

from ..output import Report, Table

DEFAULT_BENCH_MODELS = ("resnet50", "bert_encoder", "ppocr_rec")


def _child_peak_rss_mb(model: str, engine: str) -> float:
    code = f"""
from lpx_tvm.app.tools.zoo import ZOO
entry = ZOO[{model!r}]; m = entry.load(); feeds = entry.feeds(m)
if {engine!r} == "ort":
    import onnxruntime as ort
    s = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    for _ in range(3): s.run(None, feeds)
else:
    import lpx_tvm
    c = lpx_tvm.compile(m, config="tsp", input_shapes=entry.input_shapes)
    args = [feeds[n] for n, _, _ in c.input_signature]
    for _ in range(3): c(*args)
# VmHWM, not ru_maxrss: Linux carries the parent's ru_maxrss across fork+exec
print(next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) / 1024)
"""
    return float(_child_line(code, f"{engine} child for {model}"))


def _child_line(code: str, what: str) -> str:
    """The last line ``code`` prints, run in a fresh Python process; its last error line where it fails."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{what} failed: {(out.stderr.strip().splitlines() or ['?'])[-1]}")
    return out.stdout.strip().splitlines()[-1]


def engine_times(model: str, repeat: int) -> list:
    """Median seconds of the simulator (fast), the simulator tile by tile and ONNX Runtime on ``model``'s seeded
    inputs, timed in turns (:func:`side_by_side`)."""
    import onnxruntime as ort

    from ... import compile as lpx_compile
    from ...runtime_sim import reference_arithmetic
    from .zoo import ZOO

    entry = ZOO[model]
    onnx_model = entry.load()
    feeds = entry.feeds(onnx_model)
    compiled = lpx_compile(onnx_model, config="tsp", input_shapes=entry.input_shapes)
    args = [feeds[n] for n, _, _ in compiled.input_signature]
    sess = ort.InferenceSession(onnx_model.SerializeToString(), providers=["CPUExecutionProvider"])

    def reference():
        with reference_arithmetic():
            compiled(*args)
    return side_by_side([lambda: compiled(*args), reference, lambda: sess.run(None, feeds)], repeat)


def _child_engine_times(model: str, repeat: int) -> list:
    """:func:`engine_times` in a fresh process: what this one ran before (TVM's llvm builds slowed a 3 ms
    simulation after them by a third) does not fall on it."""
    code = f"from lpx_tvm.app.tools.bench import engine_times; print(*engine_times({model!r}, {repeat}))"
    return [float(v) for v in _child_line(code, f"timing child for {model}").split()]


COMPILE_REPEATS = 3  # each compile, lpx's and TVM llvm's in turn


def bench_model(model: str, repeat: int = 10) -> dict:
    """One model's record: times, the two ratios, and peak RSS of each engine.

    Returns
    -------
    dict
        Keys ``model``, ``sim_s``, ``reference_s`` (tile by tile), ``ort_s``, ``sim_over_ort``,
        ``reference_over_ort``, ``gemm_floor_over_ort`` (the model's FLOPs at numpy's best fp32 GEMM rate, over
        ORT's time), ``lpx_compile_s`` and ``tvm_llvm_compile_s`` (medians of :data:`COMPILE_REPEATS` compiles
        each, in turn), ``compile_over_tvm``, ``sim_peak_rss_mb``, ``ort_peak_rss_mb``.
    """
    from ... import compile as lpx_compile
    from .zoo import ZOO, llvm_build

    entry = ZOO[model]
    onnx_model = entry.load()
    # each compile in turn, the median of each: the first of either pays what the process had not yet done
    # (TVM's passes built, lpx's patterns registered), which once fell on whichever ran first
    lpx_times, llvm_times = [], []
    for _ in range(COMPILE_REPEATS):
        start = time.perf_counter()
        compiled = lpx_compile(onnx_model, config="tsp", input_shapes=entry.input_shapes)
        lpx_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        llvm_build(onnx_model, entry.input_shapes)
        llvm_times.append(time.perf_counter() - start)
    lpx_compile_s, llvm_compile_s = float(np.median(lpx_times)), float(np.median(llvm_times))
    sim_s, reference_s, ort_s = _child_engine_times(model, repeat)
    # the model's FLOPs at numpy's best GEMM rate here: no simulator that multiplies with numpy runs faster
    floor_s = compiled.report.flops_total / numpy_gemm_flops()
    return {"model": model, "sim_s": sim_s, "reference_s": reference_s, "ort_s": ort_s, "sim_over_ort": sim_s / ort_s,
            "reference_over_ort": reference_s / ort_s, "gemm_floor_over_ort": floor_s / ort_s,
            "lpx_compile_s": lpx_compile_s, "tvm_llvm_compile_s": llvm_compile_s,
            "compile_over_tvm": lpx_compile_s / llvm_compile_s,
            "sim_peak_rss_mb": _child_peak_rss_mb(model, "lpx"), "ort_peak_rss_mb": _child_peak_rss_mb(model, "ort")}


_QUIET_S = 0.3  # before each turn: the thread pools of what ran before (ONNX Runtime's, OpenBLAS's) stop spinning


def side_by_side(functions, repeat: int, turns: int = 5) -> list:
    """Median wall seconds of each of ``functions``, timed in turns: each in turn is called ``repeat // turns``
    times, after a pause in which the thread pools of what ran before stop spinning on the cores (ONNX
    Runtime's after its runs doubled a 3 ms simulation's time) and one call that is not timed, so that a
    machine that slows down or speeds up meanwhile does so for all of them alike."""
    times = [[] for _ in functions]
    for _ in range(turns):
        for fn, taken in zip(functions, times):
            time.sleep(_QUIET_S)
            fn()
            for _ in range(max(1, repeat // turns)):
                start = time.perf_counter()
                fn()
                taken.append(time.perf_counter() - start)
    return [float(np.median(taken)) for taken in times]


def numpy_gemm_flops(size: int = 1024, repeat: int = 5) -> float:
    """numpy's fp32 GEMM rate in this process, on one large square product (its best case), in flop/s."""
    import numpy as np

    a = np.random.default_rng(0).standard_normal((size, size), dtype=np.float32)
    out = np.empty_like(a)
    np.matmul(a, a, out=out)
    start = time.perf_counter()
    for _ in range(repeat):
        np.matmul(a, a, out=out)
    return 2 * size ** 3 * repeat / (time.perf_counter() - start)


def run_bench(models=DEFAULT_BENCH_MODELS, repeat: int = 10, progress=None) -> list:
    """Benchmark several models; a model that fails gets a record with its error and the run goes on."""
    progress = progress or sys.stderr  # looked up per call: a stream bound at import may be closed by now
    records = []
    for model in models:
        print(f"bench {model} ...", file=progress, flush=True)
        try:
            records.append(bench_model(model, repeat))
        except Exception as err:  # one model's failure must not stop the sweep
            records.append({"model": model, "error": f"{type(err).__name__}: {str(err).strip()[:200]}"})
    return records


def bench_table(records: list) -> Table:
    """The speed table: a row a model, its error in place of its figures where it failed."""
    rows = []
    for r in records:
        if "error" in r:
            rows.append([r["model"], r["error"]] + [""] * 10)
            continue
        rows.append([r["model"], f"{r['sim_s'] * 1e3:.1f}", f"{r['reference_s'] * 1e3:.1f}", f"{r['ort_s'] * 1e3:.1f}",
                     f"{r['sim_over_ort']:.2f}", f"{r['reference_over_ort']:.2f}", f"{r['gemm_floor_over_ort']:.2f}",
                     f"{r['lpx_compile_s']:.2f}", f"{r['tvm_llvm_compile_s']:.2f}", f"{r['compile_over_tvm']:.2f}",
                     f"{r['sim_peak_rss_mb']:.0f}", f"{r['ort_peak_rss_mb']:.0f}"])
    return Table(["model", "sim ms", "tile by tile ms", "ORT ms", "sim/ORT", "tile by tile/ORT", "GEMM floor/ORT",
                  "lpx compile s", "llvm compile s", "compile/llvm", "sim RSS MB", "ORT RSS MB"], rows,
                 name="The simulator against ONNX Runtime, and the compile against TVM's llvm",
                 numparse=False)  # (its digits as formatted: tabulate would print 0.50 as 0.5)


SCHEDULE_DTYPES = ("int8", "fp16", "fp32")
# the schedule table's workloads: (model, dtypes); bert_base is BERT-base's 12 layers at sequence 128, and
# llama_prefill the 12 decoder blocks of llama-gpt2s (GPT-2 small's sizes) on a 512-token prompt
SCHEDULE_WORKLOADS = (("resnet50", SCHEDULE_DTYPES), ("bert_base", ("fp16", "int8")), ("llama_prefill", ("fp16",)))
PREFILL_TOKENS = 512


def _workload(model: str, dtype: str):
    """``(ONNX model, input shapes)`` of a schedule-table row: a zoo model, BERT-base (int8: quantised by
    ONNX Runtime's quantiser on two seeded calibration inputs), or a decoder's prefill blocks."""
    from ... import quantize
    from .zoo import ZOO, quantized_for_zoo

    if model == "llama_prefill":
        from ..models.llama import build_prefill_blocks, get_config

        config = get_config("llama-gpt2s").replace(dtype="fp32")  # lpx stores it in ``dtype``; the graph is fp32
        return build_prefill_blocks(config, PREFILL_TOKENS), None
    if model != "bert_base":
        entry = ZOO[model]
        float_model = entry.load()
        return (quantized_for_zoo(entry, float_model) if dtype == "int8" else float_model), entry.input_shapes
    import numpy as np

    from ..models.transformers import bert_base

    float_model = bert_base()
    if dtype != "int8":
        return float_model, None
    rng = np.random.default_rng(0)
    calibration = [{"hidden_states": rng.standard_normal((1, 128, 768)).astype(np.float32)} for _ in range(2)]
    return quantize(float_model, calibration_inputs=calibration), None


def schedule_bench(model: str = "resnet50", config: str = "tsp", dtypes=SCHEDULE_DTYPES) -> list:
    """How well the static schedule uses the chip, per dtype: cycles, µs, useful-MAC utilisation, plane shares,
    the number of lpx programs and of ops left on the host.

    Useful-MAC utilisation is MACs ÷ (peak MACs per cycle at the dtype × cycles);
    each plane's share is the fraction of the cycles its array streamed.
    """
    from ... import compile as lpx_compile

    records = []
    for dtype in dtypes:
        source, shapes = _workload(model, dtype)
        compiled = lpx_compile(source, config=config, input_shapes=shapes, dtype=dtype)
        figures = compiled.stats  # the model's cycles, µs and useful-MAC utilisation (report.ModelStats)
        stats = [sim.stats for sim in compiled.simulators.values()]
        planes = [sum(s.plane_busy[p] for s in stats) / figures.cycles for p in range(len(stats[0].plane_busy))]
        records.append({"model": model, "dtype": dtype, "config": config, "cycles": figures.cycles,
                        "microseconds": figures.microseconds, "macs": sum(s.macs for s in stats),
                        "mac_utilisation": figures.mac_utilisation,
                        "plane_busy_share": planes, "programs": len(stats),
                        "host_ops": sum(compiled.report.host_ops.values()),
                        "streamed_weights": sum(len(sim.program.streamed) for sim in compiled.simulators.values()),
                        "instructions": sum(len(sim.program.instructions)
                                            for sim in compiled.simulators.values())})
    return records


def schedule_table(records: list) -> Table:
    """The static schedule's table: a row a workload and dtype."""
    rows = [[r["model"], r["dtype"], r["cycles"], f"{r['microseconds']:.1f}", f"{100 * r['mac_utilisation']:.1f}",
             " ".join(f"{100 * p:.0f}" for p in r["plane_busy_share"]), r["programs"], r["host_ops"],
             r["streamed_weights"], r["instructions"]] for r in records]
    return Table(["model", "dtype", "cycles", "µs", "useful-MAC util %", "plane busy %", "programs", "host ops",
                  "streamed weights", "instructions"], rows, name="The static schedule",
                 above="On tsp, the static schedule (bert_base: BERT-base's 12 layers at sequence 128; llama_prefill: "
                       "llama-gpt2s's 12 decoder blocks on a 512-token prompt):")


def table(record: dict) -> Report:
    """The bench's :class:`~lpx_tvm.app.output.Report` of ``{"speed": run_bench's records, "schedule":
    schedule_bench's, "compile_scaling": compile_scaling's}``."""
    scaling = record["compile_scaling"]
    n, m = scaling["layers"], scaling["layers"] * scaling["factor"]
    growth = (f"Compile time against model size: a chain of {n} layers {scaling['seconds'][n]:.2f} s, of {m} layers "
              f"{scaling['seconds'][m]:.2f} s: {scaling['ratio']:.2f}× for {scaling['factor']}× the layers (linear: "
              f"{scaling['factor']})")
    return Report("The flow's own speed", [bench_table(record["speed"]), schedule_table(record["schedule"]), growth],
                  record)


def _layer_chain(layers: int, width: int = 256, rows: int = 64, seed: int = 0):
    """``layers`` MatMul + Add + Relu layers of distinct seeded weights (so TVM merges none of them)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes, inits, x = [], [], "x"
    for k in range(layers):
        w = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{k}"), numpy_helper.from_array(np.zeros(width, np.float32), f"b{k}")]
        nodes += [helper.make_node("MatMul", [x, f"w{k}"], [f"m{k}"]), helper.make_node("Add", [f"m{k}", f"b{k}"], [f"a{k}"]),
                  helper.make_node("Relu", [f"a{k}"], [f"r{k}"])]
        x = f"r{k}"
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, width])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [rows, width])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def compile_scaling(layers: int = 16, factor: int = 4, config: str = "tsp") -> dict:
    """Compile a chain of ``layers`` layers and one ``factor`` times as long, in this process, one after the other
    (each after a warm-up compile); their times' ratio should be about ``factor`` where compile time grows
    linearly with the model."""
    import lpx_tvm

    lpx_tvm.compile(_layer_chain(2), config=config)  # TVM's and the codegen's first-call costs
    times = {}
    for n in (layers, layers * factor):
        model = _layer_chain(n)
        start = time.perf_counter()
        lpx_tvm.compile(model, config=config)
        times[n] = time.perf_counter() - start
    return {"layers": layers, "factor": factor, "seconds": times,
            "ratio": times[layers * factor] / times[layers]}
