"""The model zoo: every model, how to get it offline, its inputs and tolerance, and the runner.

Each run compares lpx with ONNX Runtime on the same seeded inputs and measures,
side by side in one process: compile time, simulator time, ONNX Runtime time and
TVM-llvm-only time, plus the predicted LPX latency on the chosen chip.
"""

from __future__ import annotations

import copy
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import onnx.numpy_helper

from ...runtime_sim.errors import LpxUserError
from ..models.light_models import LIGHT_MODELS, light_model
from ..models.trained import OCR_MODELS, ocr_input_shapes, ocr_model, text_image
from ..models.transformers import bert_encoder, gpt2_decoder
from ..output import Report, Table


@dataclass(frozen=True)
class ZooModel:
    """One zoo entry: a name, a family, an offline loader and a tolerance (max relative error)."""

    name: str
    family: str
    load: Callable[[], onnx.ModelProto]
    rtol: float = 1e-3
    min_cosine: float = 0.9999
    input_shapes: dict | None = None  # pins dynamic input dimensions, {input name: dims}
    inputs: Callable[[], dict] | None = None  # feeds; seeded normal (or token ids) by default

    def feeds(self, model: onnx.ModelProto) -> dict:
        """The inputs this model is compared on."""
        return self.inputs() if self.inputs else seeded_inputs(model)


ZOO = {m.name: m for m in (
    [ZooModel(name, "cnn", lambda name=name: light_model(name)) for name in LIGHT_MODELS]
    + [ZooModel("bert_encoder", "encoder", bert_encoder), ZooModel("gpt2_decoder", "decoder", gpt2_decoder)]
    + [ZooModel(name, "trained", lambda name=name: ocr_model(name), input_shapes=ocr_input_shapes(name),
                inputs=lambda name=name: {"x": text_image(ocr_input_shapes(name)["x"])}) for name in OCR_MODELS]
)}
DEFAULT_MODELS = tuple(ZOO)


_INTEGER_TYPES = (onnx.TensorProto.INT64, onnx.TensorProto.INT32)


def _index_rows(model: onnx.ModelProto, name: str) -> int | None:
    """The rows of the constant table a Gather looks ``name`` up in (an embedding's vocabulary), or None."""
    tables = {i.name: tuple(i.dims) for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Gather" and len(node.input) > 1 and node.input[1] == name and node.input[0] in tables:
            axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
            return tables[node.input[0]][axis]
    return None


def seeded_inputs(model: onnx.ModelProto, seed: int = 1) -> dict:
    """Seeded inputs for every graph input, each as what it is: an attention mask of ones, token types of zeros,
    position ids counting up, token ids within the rows of the table they index (0-999 where none is found),
    and floats from a standard normal."""
    rng = np.random.default_rng(seed)
    feeds = {}
    init_names = {i.name for i in model.graph.initializer}
    for inp in model.graph.input:
        if inp.name in init_names:
            continue
        tt = inp.type.tensor_type
        shape = [d.dim_value for d in tt.shape.dim]
        name = inp.name.lower()
        if tt.elem_type == onnx.TensorProto.BOOL or (tt.elem_type in _INTEGER_TYPES and "mask" in name):
            feeds[inp.name] = np.ones(shape, onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type))
        elif tt.elem_type in _INTEGER_TYPES:
            dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)
            if "token_type" in name:
                feeds[inp.name] = np.zeros(shape, dtype)
            elif "position" in name and shape:
                feeds[inp.name] = np.broadcast_to(np.arange(shape[-1]), shape).astype(dtype)
            else:
                feeds[inp.name] = rng.integers(0, _index_rows(model, inp.name) or 1000, shape).astype(dtype)
        else:
            feeds[inp.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def file_inputs(model: onnx.ModelProto, path, seed: int = 1) -> dict:
    """The graph inputs from an ``.npz`` file (``numpy.savez``: one array per input name); the inputs it
    leaves out are seeded (:func:`seeded_inputs`).

    Raises
    ------
    ValueError
        The file is not an npz of arrays, names an input the model lacks, or holds one of another shape or
        element type than the model's.
    """
    try:
        with np.load(path, allow_pickle=False) as archive:
            given = {name: archive[name] for name in archive.files}
    except (OSError, ValueError) as err:
        raise LpxUserError(f"--inputs {path}: not an .npz of arrays (numpy.savez writes one): {err}") from None
    feeds = seeded_inputs(model, seed)
    unknown = sorted(set(given) - set(feeds))
    if unknown:
        raise LpxUserError(f"--inputs {path}: the model has no input {', '.join(map(repr, unknown))} "
                           f"(its inputs: {', '.join(feeds)})")
    for name, array in given.items():
        want = feeds[name]
        if array.shape != want.shape or array.dtype != want.dtype:
            raise LpxUserError(f"--inputs {path}: {name!r} is {array.dtype}{list(array.shape)}, the model takes "
                               f"{want.dtype}{list(want.shape)}")
        feeds[name] = array
    return feeds


def timed(fn, repeat: int) -> float:
    """Median wall seconds of ``repeat`` calls (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def compare(outputs, references) -> dict:
    """Max abs error, max error relative to the reference's magnitude, and cosine similarity."""
    a = np.concatenate([np.asarray(o, np.float64).ravel() for o in outputs])
    b = np.concatenate([np.asarray(r, np.float64).ravel() for r in references])
    abs_err = float(np.abs(a - b).max())
    rel = abs_err / max(float(np.abs(b).max()), 1e-30)
    cosine = float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-300))
    return {"max_abs_err": abs_err, "max_rel_err": rel, "cosine": cosine}


FAST_PATH_FP32_TOLERANCE = 1e-4  # over the output's largest magnitude; the zoo's worst is 1.2e-5 (ppocr_det)
REDUCED_PRECISION_MIN_COSINE = {"fp16": 0.999, "bf16": 0.999, "fp8": 0.99}  # against ORT in fp32


def run_model(entry: ZooModel, config: str = "tsp", llvm: bool = True, repeat: int = 3, dtype: str = "fp32") -> dict:
    """Run one zoo model through lpx and ONNX Runtime (and TVM llvm) and return its record.

    With ``dtype`` fp16, bf16 or fp8 the reference is still ONNX Runtime in fp32, and the model passes at
    cosine >= 0.999 (fp8: 0.99, on the logits: a trailing Softmax is removed, as for int8); relative error
    is reported, not judged.
    """
    import onnxruntime as ort
    import tvm
    from tvm import relax

    from ... import compile as lpx_compile
    from ...runtime import total_offloaded_calls

    record = {"model": entry.name, "family": entry.family, "ok": False, "config": config, "dtype": dtype}
    with tempfile.TemporaryDirectory(prefix="lpx-zoo-") as tmp:
        # one phase at a time, each freed before the next, reading the model from a file: a large model's
        # weights would otherwise sit in the ONNX model, its serialised bytes, ONNX Runtime's session, TVM's
        # llvm build and lpx's programs all at once
        path, feeds, step = _saved_for_run(entry, dtype, Path(tmp))
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        references = sess.run(None, feeds)
        record["ort_s"] = timed(lambda: sess.run(None, feeds), repeat)
        sess = None  # its weights go before the next phase
        record["tvm_llvm_s"] = None
        if llvm:
            ex = llvm_build(path)
            vm = relax.VirtualMachine(ex, tvm.cpu())
            tensors = [tvm.runtime.tensor(value) for value in feeds.values()]
            record["tvm_llvm_s"] = timed(lambda: vm["main"](*tensors), 1)
            del ex, vm, tensors
        start = time.perf_counter()
        compiled = lpx_compile(path, config=config, dtype=dtype)
        record["compile_s"] = time.perf_counter() - start
    args = [feeds[name] for name, _, _ in compiled.input_signature]
    calls_before = total_offloaded_calls()
    outputs = compiled(*args)
    record["lpx_calls"] = total_offloaded_calls() - calls_before
    record.update(compare(outputs, references))
    record.update(fast_against_reference(compiled, args, outputs))
    record["lpx_subgraphs"] = compiled.report.lpx_functions
    record["flops_offloaded_pct"] = compiled.report.offloaded_pct
    record["gflops"] = compiled.report.flops_total / 1e9
    record["host_ops"] = sorted(op.removeprefix("relax.") for op in compiled.report.host_ops)
    record["sim_s"] = timed(lambda: compiled(*args), repeat)
    stats = [sim.stats for sim in compiled.simulators.values()]
    record["predicted_cycles"] = sum(s.cycles for s in stats)
    record["predicted_latency_s"] = sum(s.seconds for s in stats)
    record["throughput_per_s"] = 1.0 / record["predicted_latency_s"] if record["predicted_latency_s"] else None
    if dtype == "fp32":
        record["ok"] = record["max_rel_err"] <= entry.rtol and record["cosine"] >= entry.min_cosine
    elif dtype == "int8" and step is not None:
        # outputs are dequantised integers, so a difference in steps is a whole number up to float rounding
        steps = np.rint(np.abs(np.asarray(outputs[0], np.float64) - references[0]) / step)
        record["within_one_step_pct"] = 100.0 * float(np.mean(steps <= 1))
        record["max_steps"] = float(steps.max())
        record["top1_agree"] = bool(np.array_equal(np.asarray(outputs[0]).reshape(len(outputs[0]), -1).argmax(1),
                                                   references[0].reshape(len(references[0]), -1).argmax(1)))
        record["ok"] = record["within_one_step_pct"] >= 99.0 and record["top1_agree"]
    else:
        record["ok"] = record["cosine"] >= REDUCED_PRECISION_MIN_COSINE[dtype]
    # the fast path against the tile-by-tile reference: integer sums are exact, so int8 is bit-equal; fp32
    # differs by the order a BLAS kernel adds in (a reduced-precision type's rounding can magnify that: it is
    # judged against ONNX Runtime above, not here)
    fast_ok = record["fast_bit_equal"] if dtype == "int8" else \
        record["fast_max_diff"] <= FAST_PATH_FP32_TOLERANCE if dtype == "fp32" else True
    if not fast_ok:
        record["ok"] = False
        record["error"] = f"the fast path differs from the tile-by-tile reference by {record['fast_max_diff']:.2e}"
    if not record["ok"] and "error" not in record:
        record["error"] = (f"outside tolerance (rel {record['max_rel_err']:.2e}, cosine {record['cosine']:.6f}, "
                           f"{dtype})")
    return record


def fast_against_reference(compiled, args, outputs) -> dict:
    """The model run again tile by tile (:func:`reference_arithmetic`), against the fast path's ``outputs``:
    ``fast_bit_equal``, and ``fast_max_diff``, the largest difference over the output's largest magnitude."""
    from ...runtime_sim import reference_arithmetic

    with reference_arithmetic():
        references = compiled(*args)
    pairs = [(np.asarray(f, np.float64), np.asarray(r, np.float64)) for f, r in zip(outputs, references)]
    equal = all(np.array_equal(f, r, equal_nan=True) for f, r in pairs)
    worst = max((float(np.nanmax(np.abs(f - r))) / max(float(np.nanmax(np.abs(r))), 1e-30) if r.size else 0.0
                 for f, r in pairs), default=0.0)
    return {"fast_bit_equal": equal, "fast_max_diff": 0.0 if equal else worst}


def llvm_build(model, input_shapes: dict | None = None):
    """TVM's own llvm build of an ONNX model (the host-only baseline), its native log lines kept for --debug."""
    import tvm

    from ...diagnostics import native_output_to_log
    from ...frontend import from_onnx

    mod = from_onnx(model, input_shapes)
    with native_output_to_log("TVM llvm build"):
        return tvm.compile(mod, target="llvm")


def summary(records: list) -> str:
    """The line under the table: how many passed, and the process's peak memory over the run."""
    passed = sum(bool(r["ok"]) for r in records)
    peaks = [r["peak_rss_mb"] for r in records if r.get("peak_rss_mb")]
    largest = max(records, key=lambda r: r.get("peak_rss_mb") or 0)["model"] if peaks else None
    memory = f"; peak memory {_process_peak_rss_mb():.0f} MB over the run" + (
        f" (the largest model's: {max(peaks):.0f} MB, {largest})" if peaks else "")
    return f"{passed}/{len(records)} ok{memory}"


class _PeakRss:
    """The largest resident set seen while a model runs: sampled from ``/proc/self/statm`` every 2 ms by a
    thread (Linux), so the kernel's high-water mark, which ``/usr/bin/time`` and the summary report, is left
    as it is. ``peak_mb`` is None where there is no ``/proc``."""

    def __init__(self):
        self.peak_mb, self._stop = None, threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

    def _sample(self) -> float | None:
        try:
            with open("/proc/self/statm") as fh:
                return int(fh.read().split()[1]) * self._page / 2**20
        except (OSError, ValueError, IndexError):
            return None

    def _run(self) -> None:
        while True:
            value = self._sample()
            if value is None:
                return
            self.peak_mb = max(self.peak_mb or 0.0, value)
            if self._stop.wait(0.002):
                return

    def __enter__(self):
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        last = self._sample()
        if last is not None:
            self.peak_mb = max(self.peak_mb or 0.0, last)
        return False


def _process_peak_rss_mb() -> float:
    """The process's peak resident set so far (the kernel's high-water mark, what ``/usr/bin/time`` reports):
    VmHWM where there is ``/proc`` (getrusage's counts the memory of a process this one was forked from)."""
    try:
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) / 1024 for line in fh if line.startswith("VmHWM"))
    except (OSError, StopIteration, ValueError):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / (1024 * 1024 if sys.platform == "darwin" else 1024)


def constant_weights(model: onnx.ModelProto) -> bool:
    """Whether every matrix weight (a Conv, Gemm or MatMul's second input) is one value repeated: made by
    ``ConstantOfShape`` (onnx's light models; a ``Constant`` once the frontend folds it) or a constant
    holding a single value."""
    from ...frontend import onnx_constants

    constants = onnx_constants(model.graph)
    made_constant = {n.output[0] for n in model.graph.node if n.op_type == "ConstantOfShape"}
    weights = [n.input[1] for n in model.graph.node if n.op_type in ("Conv", "Gemm", "MatMul") and len(n.input) > 1]
    weights = [w for w in weights if w in constants or w in made_constant]
    if not weights:
        return False
    for name in weights:
        if name in constants:
            values = onnx.numpy_helper.to_array(constants[name])
            if values.size and not np.all(values == values.flat[0]):
                return False
    return True


def _saved_for_run(entry: ZooModel, dtype: str, directory: Path) -> tuple:
    """Write the model a run compares (quantised for int8) to ``directory``; its path, feeds and, for int8,
    its output's quantisation step. Only the file holds the weights afterwards."""
    model = entry.load()
    feeds = entry.feeds(model)
    if dtype == "int8":  # the reference is ONNX Runtime running the same QDQ model
        model = quantized_for_zoo(entry, model)
    elif dtype == "fp8":  # judged on the logits, as int8 is: a softmax magnifies a 3-bit mantissa's rounding
        model = without_final_softmax(model)
    from ...frontend import set_shape

    for value_info in model.graph.input:  # the shapes it is compared at: `lpx-tvm run FILE` needs no flags
        if value_info.name in feeds:
            set_shape(value_info, feeds[value_info.name].shape)
    path = directory / f"{entry.name}{'_int8' if dtype == 'int8' else ''}.onnx"
    onnx.save(model, str(path))
    return path, feeds, output_step(model) if dtype == "int8" else None


def save(name: str, path, dtype: str = "fp32") -> Path:
    """Write zoo model ``name`` as an ONNX file with its seeded weights and the input shapes the zoo runs it
    with (``dtype="int8"``: the QDQ model the int8 zoo compares). Returns the file's path.

    Parameters
    ----------
    name : str
        A zoo model (``lpx-tvm zoo --help`` lists them).
    path : str or Path
        A ``.onnx`` file, or a directory (created when missing) to write ``<name>.onnx``
        (``<name>_int8.onnx``) into.
    dtype : str
        ``"fp32"`` (the model itself) or ``"int8"`` (quantised).
    """
    check_names([name])
    if dtype not in ("fp32", "int8"):
        raise LpxUserError(f"zoo models are saved as fp32 or int8 (other dtypes are a compile option), not {dtype!r}")
    path = Path(path)
    if path.suffix != ".onnx":
        path.mkdir(parents=True, exist_ok=True)
    directory = path if path.is_dir() else path.parent
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: no such directory")
    written, _, _ = _saved_for_run(ZOO[name], dtype, directory)
    if not path.is_dir() and written != path:
        written.replace(path)
        written = path
    return written


def without_final_softmax(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with a trailing Softmax removed, so its output is the logits (int8 is judged on those)."""
    graph = model.graph
    last = next((n for n in graph.node if graph.output and n.output[0] == graph.output[0].name), None)
    if last is None or last.op_type != "Softmax":
        return model
    model = copy.deepcopy(model)
    graph = model.graph
    node = next(n for n in graph.node if n.output[0] == graph.output[0].name)
    graph.output[0].name = node.input[0]
    graph.node.remove(node)
    return model


def quantized_for_zoo(entry: ZooModel, model: onnx.ModelProto) -> onnx.ModelProto:
    """``lpx_tvm.quantize`` of a zoo model (trailing Softmax removed), calibrated on four seeded inputs."""
    from ...quantization import quantize

    prepared = without_final_softmax(model)
    # a model with its own (fixed) input calibrates on it once; min/max calibration needs no copies
    calibration = ([entry.feeds(prepared)] if entry.inputs else
                   [seeded_inputs(prepared, seed) for seed in range(2, 6)])
    return quantize(prepared, calibration, input_shapes=entry.input_shapes)


def output_step(model: onnx.ModelProto) -> float | None:
    """The quantisation step of the first output, when a DequantizeLinear produces it."""
    producer = next((n for n in model.graph.node if n.output[0] == model.graph.output[0].name), None)
    if producer is None or producer.op_type != "DequantizeLinear":
        return None
    inits = {i.name: i for i in model.graph.initializer}
    scale = inits.get(producer.input[1])
    return None if scale is None else float(onnx.numpy_helper.to_array(scale).reshape(-1)[0])


def check_names(names) -> list:
    """``names`` as a list, or a ValueError naming the ones the zoo does not have."""
    unknown = [n for n in names if n not in ZOO]
    if unknown:
        raise LpxUserError(f"unknown zoo models {unknown}; choose from {', '.join(ZOO)}")
    return list(names)


def run_zoo(names=None, config: str = "tsp", llvm: bool = True, progress=None, dtype: str = "fp32") -> list:
    """Run several zoo models; a model that fails gets a record saying why and the run goes on."""
    progress = progress or sys.stderr  # looked up per call: a stream bound at import may be closed by now
    names = check_names(names or DEFAULT_MODELS)
    records, began = [], time.perf_counter()
    for i, name in enumerate(names, 1):
        left = ""
        if i > 1:  # models differ a lot (vgg19 takes a hundred times bert_encoder's time): a rough guide
            average = (time.perf_counter() - began) / (i - 1)
            left = f" (about {average * (len(names) - i + 1):.0f} s left at the average so far)"
        print(f"[{i}/{len(names)}] {name} ...{left}", file=progress, flush=True)
        start = time.perf_counter()
        with _PeakRss() as peak:
            try:
                record = run_model(ZOO[name], config, llvm, dtype=dtype)
            except Exception as err:  # one model's failure must not stop the sweep
                record = {"model": name, "family": ZOO[name].family, "ok": False, "config": config, "dtype": dtype,
                          "error": f"{type(err).__name__}: "
                                   f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}"}
        record["peak_rss_mb"] = peak.peak_mb
        print(f"[{i}/{len(names)}] {name}: {'ok' if record['ok'] else 'FAILED'} "
              f"({time.perf_counter() - start:.1f} s)", file=progress, flush=True)
        records.append(record)
    return records


COLUMNS = [("model", "model"), ("dtype", "dtype"), ("ok", "ok"), ("lpx_subgraphs", "lpx fns"),
           ("flops_offloaded_pct", "% FLOPs lpx"),
           ("max_abs_err", "max abs err"), ("max_rel_err", "max rel err"), ("cosine", "cosine"),
           ("compile_s", "compile s"), ("sim_s", "sim s"), ("ort_s", "ORT s"), ("tvm_llvm_s", "TVM llvm s"),
           ("predicted_latency_s", "LPX latency s"), ("throughput_per_s", "LPX inf/s"),
           ("within_one_step_pct", "% within 1 step"), ("top1_agree", "top-1 agrees"),
           ("peak_rss_mb", "peak MB")]


def table(records: list) -> Report:
    """The zoo's :class:`~lpx_tvm.app.output.Report`: a row a model (columns no record fills, int8's in an fp32
    run say, left out), the failures, then :func:`summary`."""
    columns = [(key, head) for key, head in COLUMNS if any(r.get(key) is not None for r in records)]
    rows = []
    for r in records:
        row = []
        for key, _ in columns:
            value = r.get(key)
            if isinstance(value, float):
                value = (f"{value:.6f}" if key == "cosine" else f"{value:.2f}" if key == "flops_offloaded_pct"
                         else f"{value:.0f}" if key in ("throughput_per_s", "peak_rss_mb") else f"{value:.3g}")
            row.append("" if value is None else value)
        rows.append(row)
    blocks = [Table([h for _, h in columns], rows, numparse=False)]
    failures = [f"{r['model']}: {r['error']}" for r in records if r.get("error")]
    if failures:
        blocks.append("failures:\n  " + "\n  ".join(failures))
    return Report("The model zoo against ONNX Runtime", blocks, records, notes=[summary(records)])
