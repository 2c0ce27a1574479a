"""``lpx-tvm sweep``: chip variants × models × dtypes, compiled and timed, on Ray.

A spec (JSON, TOML or YAML) names a base preset, the parameters to vary, the
models and the dtypes::

    base = "tsp"
    models = ["resnet50", "squeezenet"]          # zoo names, ONNX files, or "plan:MODEL@SYSTEM"
    dtypes = ["int8", "fp16"]
    [grid]                                       # every combination ...
    sram_bytes = ["1x", "1.5x"]                  # a number, or a multiple of the base's value
    mxm_planes = [4, 6]
    # [[variants]] tables add single variants: {mxm_rows = 256, mxm_cols = 256}

Each point is compiled with the real codegen for its chip and timed by a
timing-only simulator (the schedule verified, the cycles counted, no
arithmetic). Every variant is validated before anything runs. Finished points
are appended to a JSON-lines store as they come, keyed by a hash of (chip
parameters, model, dtype, project version), so an interrupted sweep loses
nothing and a re-run skips what is done. Ray (``pip install lpx-tvm[sweep]``)
runs the points: a local Ray with ``--workers`` processes, or a cluster at
``--address``; ``--workers 0`` runs them here, one after the other.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

from ...codegen.target import chip_of
from ...runtime_sim import ChipConfig, derive_config
from ...runtime_sim.config import ConfigError
from ...runtime_sim.errors import LpxUserError
from ..output import Report, Table
from ..plan.cost import AreaModel, pareto_front

METRICS = ("cycles", "latency_us", "mac_utilisation", "offloaded_pct", "fits", "streamed_mb", "host_fallbacks",
           "sram_high_water_mb", "area_mm2", "chips", "tokens_per_s_per_user")
SPEC_KEYS = {"base", "grid", "variants", "models", "dtypes", "metrics"}
# a Ray worker runs one point at a time on one core: its BLAS and OpenMP pools get one thread
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# an LLM planned on a system of the variant's chips (``lpx-tvm plan``): "plan:llama-3-8b@tsp-rack"
PLAN_PREFIX = "plan:"
# parameters a single-chip compile never reads: variants differing only in these share one compile
_NOT_COMPILED = ("c2c_links", "c2c_bytes_per_s_per_link")


class SpecError(LpxUserError):
    """A sweep spec that cannot run, naming the key or field at fault."""


@dataclass(frozen=True)
class SweepSpec:
    """A validated sweep: the base preset, one overrides dict per chip variant, models, dtypes, metrics."""

    base: str
    variants: tuple
    models: tuple
    dtypes: tuple
    metrics: tuple = METRICS

    def configs(self) -> list:
        """Each variant's config (validated)."""
        return [variant_config(self.base, overrides) for overrides in self.variants]


def variant_config(base: str, overrides: dict) -> ChipConfig:
    """The base preset with ``overrides`` (validated), or the base itself."""
    return derive_config(base, overrides) if overrides else chip_of(base)


def load_spec(path) -> SweepSpec:
    """Read and validate a spec file (``.json``, ``.toml``, ``.yaml``/``.yml``)."""
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"{path}: no such file")
    text = path.read_text()
    try:
        if path.suffix == ".json":
            data = json.loads(text)
        elif path.suffix == ".toml":
            import tomllib

            data = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError:
                raise SpecError(f"{path}: reading YAML needs PyYAML (pip install pyyaml), or write the spec as "
                                "JSON or TOML") from None
            data = yaml.safe_load(text)
        else:
            raise SpecError(f"{path}: a spec is .json, .toml or .yaml, not {path.suffix or 'extensionless'}")
    except SpecError:
        raise
    except Exception as err:  # each parser has its own error types
        raise SpecError(f"{path}: not valid {path.suffix[1:].upper()} ({err})") from None
    return spec_from_dict(data, str(path))


def spec_from_dict(data: dict, where: str = "spec") -> SweepSpec:
    """Validate a spec given as a dict; every chip variant is built (and checked) here."""
    from .zoo import ZOO

    if not isinstance(data, dict):
        raise SpecError(f"{where}: a spec is a table of keys {sorted(SPEC_KEYS)}")
    unknown = sorted(set(data) - SPEC_KEYS)
    if unknown:
        raise SpecError(f"{where}: unknown key {', '.join(unknown)} (a spec has {', '.join(sorted(SPEC_KEYS))})")
    base = str(data.get("base", "tsp"))
    try:
        base_config = chip_of(base)
    except ValueError as err:
        raise SpecError(f"{where}: base: {err}") from None
    grid = data.get("grid", {}) or {}
    if not isinstance(grid, dict) or any(not isinstance(v, list) or not v for v in grid.values()):
        raise SpecError(f"{where}: grid maps a chip parameter to a non-empty list of values")
    listed = data.get("variants", []) or []
    if not isinstance(listed, list) or any(not isinstance(v, dict) for v in listed):
        raise SpecError(f"{where}: variants is a list of tables of chip parameters")
    combos = [dict(zip(grid, values)) for values in itertools.product(*grid.values())] if grid else []
    variants = [_resolved(base_config, v, where) for v in combos + listed] or [{}]
    models = data.get("models")
    if not isinstance(models, list) or not models:
        raise SpecError(f"{where}: models is a non-empty list of zoo names or ONNX files")
    for model in models:
        if str(model).startswith(PLAN_PREFIX):
            _plan_target(str(model), where)
        elif str(model) not in ZOO and not Path(str(model)).is_file():
            raise SpecError(f"{where}: model {model!r} is neither a zoo model ({', '.join(ZOO)}), a file, nor "
                            f"{PLAN_PREFIX}MODEL@SYSTEM")
    dtypes = data.get("dtypes", ["fp32"])
    metrics = data.get("metrics", list(METRICS))
    bad = sorted(set(metrics) - set(METRICS))
    if bad:
        raise SpecError(f"{where}: unknown metric {', '.join(bad)} (metrics: {', '.join(METRICS)})")
    spec = SweepSpec(base, tuple(variants), tuple(str(m) for m in models), tuple(dtypes), tuple(metrics))
    for overrides, config in zip(spec.variants, spec.configs()):
        for dtype in spec.dtypes:
            try:
                config.check_dtype(dtype)
            except ValueError as err:
                raise SpecError(f"{where}: dtypes: {err}") from None
    return spec


def _plan_target(model: str, where: str = "spec") -> tuple:
    """``plan:MODEL@SYSTEM`` ─► (ModelSpec, SystemConfig), both checked."""
    from ...codegen.target import system_of
    from ..plan.search import PlanError, model_spec

    name, at, system = model[len(PLAN_PREFIX):].partition("@")
    if not at or not name or not system:
        raise SpecError(f"{where}: model {model!r}: an LLM point is written {PLAN_PREFIX}MODEL@SYSTEM, e.g. "
                        f"{PLAN_PREFIX}llama-3-8b@tsp-rack")
    try:
        return model_spec(name), system_of(system)
    except (PlanError, ValueError) as err:
        raise SpecError(f"{where}: model {model!r}: {err}") from None


def _resolved(base: ChipConfig, overrides: dict, where: str) -> dict:
    """Overrides with multiples (``"1.5x"``) turned into values, checked by building the variant."""
    resolved = {}
    for key, value in overrides.items():
        if isinstance(value, str) and value.endswith("x"):
            try:
                factor = float(value[:-1])
            except ValueError:
                raise SpecError(f"{where}: {key} = {value!r}: a multiple is written like \"1.5x\"") from None
            if not isinstance(getattr(base, key, None), int):
                raise SpecError(f"{where}: {key} = {value!r}: only an integer parameter takes a multiple")
            value = round(getattr(base, key) * factor)
        resolved[key] = value
    try:
        derive_config(base, resolved)
    except ConfigError as err:
        raise SpecError(f"{where}: {err}") from None
    return resolved


# ---- points, their keys and the tasks that run them ------------------------------------------------------
def project_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lpx-tvm")
    except PackageNotFoundError:
        return "unknown"


def model_id(model: str) -> str:
    """What identifies a model's content: a zoo name (seeded, so fixed), a plan target, or a file's hash."""
    if model.startswith(PLAN_PREFIX):  # a config.json or a system file is known by its content
        name, _, system = model[len(PLAN_PREFIX):].partition("@")
        return model + "".join(":" + _file_digest(f) for f in (name, system) if Path(f).is_file())
    if Path(model).is_file():
        return "file:" + _file_digest(model)
    return "zoo:" + model


def _file_digest(path: str) -> str:
    stat = Path(path).stat()
    return _digest(str(Path(path).resolve()), stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=64)
def _digest(path: str, mtime_ns: int, size: int) -> str:
    """A file's SHA-256, read once while it is unchanged (every variant and dtype of a point asks for it)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def point_key(config: ChipConfig, model: str, dtype: str, version: str | None = None) -> str:
    """The content hash a result is stored under: chip parameters (not the name), model, dtype, version."""
    parameters = {k: v for k, v in asdict(config).items() if k not in ("name", "description", "sources")}
    payload = json.dumps({"chip": parameters, "model": model_id(model), "dtype": dtype,
                          "version": version or project_version()}, sort_keys=True, default=dict)
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


def plan_tasks(spec: SweepSpec, done=frozenset()) -> list:
    """Tasks (one compile each) covering the points not yet ``done``; each task lists its points."""
    version = project_version()
    tasks = {}
    for overrides, config in zip(spec.variants, spec.configs()):
        for model in spec.models:
            # a plan's network model reads the links; a single-chip compile does not
            compiled_as = overrides if model.startswith(PLAN_PREFIX) else {
                k: v for k, v in overrides.items() if k not in _NOT_COMPILED}
            for dtype in spec.dtypes:
                key = point_key(config, model, dtype, version)
                if key in done:
                    continue
                task = tasks.setdefault(json.dumps([compiled_as, model, dtype], sort_keys=True, default=str),
                                        {"base": spec.base, "overrides": compiled_as, "model": model,
                                         "dtype": dtype, "points": []})
                task["points"].append({"key": key, "overrides": overrides, "variant": config.name})
    return list(tasks.values())


def run_task(task: dict) -> list:
    """Compile one model for one chip and time it: one record per point of the task (plain dicts).

    A failure is recorded in each point's record, never raised: one bad point does not stop a sweep.
    """
    start = time.perf_counter()
    base = {"model": task["model"], "dtype": task["dtype"]}
    try:
        figures = _measure(task)
    except Exception as err:  # recorded, the sweep goes on
        message = str(err).strip().splitlines()[0] if str(err).strip() else ""
        figures = {"ok": False, "error": f"{type(err).__name__}: {message}"}
    figures["task_s"] = time.perf_counter() - start
    area = AreaModel.from_tsp()  # an LLM point's area is its system's: every chip it plans on
    records = []
    for point in task["points"]:
        config = variant_config(task["base"], point["overrides"])
        records.append({"key": point["key"], "variant": point["variant"], "overrides": point["overrides"], **base,
                        **figures, "area_mm2": area.area_mm2(config) * (figures.get("chips") or 1)})
    return records


def _measure(task: dict) -> dict:
    from ... import compile_programs
    from ...patterns import CapacityWarning
    from ...report import model_stats
    from ...runtime_sim import Simulator
    from .zoo import ZOO, quantized_for_zoo, seeded_inputs

    config = variant_config(task["base"], task["overrides"])
    model, dtype = task["model"], task["dtype"]
    if model.startswith(PLAN_PREFIX):
        return _measure_plan(model, config, dtype)
    entry = ZOO.get(model)
    proto = entry.load() if entry is not None else model
    input_shapes = entry.input_shapes if entry is not None else None
    if dtype == "int8":
        if entry is not None:
            proto = quantized_for_zoo(entry, proto)
        else:
            from ...frontend import load_onnx
            from ...quantization import quantize

            loaded = load_onnx(model)
            proto = quantize(loaded, [seeded_inputs(loaded, seed) for seed in range(2, 6)])
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        programs, report = compile_programs(proto, config=config, input_shapes=input_shapes, dtype=dtype)
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    simulators = {name: Simulator(program, config, timing_only=True) for name, program in programs.items()}
    stats = [sim.stats for sim in simulators.values()]
    figures = model_stats(simulators)  # the model's cycles, µs and useful-MAC utilisation
    streamed = sum(w.data.nbytes for p in programs.values() for w in p.streamed)
    fallbacks = sum(issubclass(w.category, CapacityWarning) for w in caught)
    return {"ok": True, "cycles": figures.cycles, "latency_us": figures.microseconds,
            "mac_utilisation": figures.mac_utilisation,
            "offloaded_pct": report.offloaded_pct, "fits": streamed == 0 and fallbacks == 0,
            "streamed_mb": streamed / 1e6, "host_fallbacks": fallbacks,
            "sram_high_water_mb": max((s.sram_high_water for s in stats), default=0) / 1e6,
            "compile_s": compile_s, "timing_s": time.perf_counter() - start}


def _measure_plan(model: str, config: ChipConfig, dtype: str) -> dict:
    """An LLM's decode planned on its system with every chip replaced by the variant."""
    from dataclasses import replace

    from ..plan.search import plan

    start = time.perf_counter()
    spec, system = _plan_target(model)
    report = plan(spec, replace(system, chip=config), dtype=dtype, batches=())
    cycles = round(report["per_token_us"] * config.clock_hz / 1e6)
    return {"ok": True, "cycles": cycles, "latency_us": report["per_token_us"], "chips": report["chips"],
            "tokens_per_s_per_user": report["tokens_per_s_per_user"], "fits": True,
            "bound": report["bottleneck"], "compile_s": time.perf_counter() - start, "timing_s": 0.0}


# ---- the store, the executors and the run -----------------------------------------------------------------
class ResultStore:
    """Finished points, one JSON object per line, appended (and flushed) as each arrives.

    Parameters
    ----------
    path : str or Path
        The ``.jsonl`` file; created when missing, read when present (a re-run resumes from it).
    """

    def __init__(self, path):
        self.path = Path(path)
        self.records = {}
        if self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by an interruption: that point runs again
                    continue
                self.records[record["key"]] = record

    @property
    def done(self) -> frozenset:
        """Keys of the points that finished well (failed ones run again)."""
        return frozenset(k for k, r in self.records.items() if r.get("ok"))

    def add(self, records) -> None:
        with self.path.open("a") as fh:
            for record in records:
                fh.write(json.dumps(record, sort_keys=True, default=str) + "\n")
                self.records[record["key"]] = record
            fh.flush()
            os.fsync(fh.fileno())


def run_sweep(spec: SweepSpec, store, workers: int | None = None, address: str | None = None,
              progress: bool = True) -> list:
    """Run the points of ``spec`` not yet in ``store``; return every point's record, in spec order.

    Parameters
    ----------
    spec : SweepSpec
    store : ResultStore or path
    workers : int, optional
        Ray worker processes (default: the machine's cores); 0 runs the points in this process.
    address : str, optional
        A Ray cluster (``ray://HOST:PORT``) to join instead of starting a local one.
    progress : bool
        Show a tqdm bar (points done, failed, ETA) on stderr.
    """
    store = store if isinstance(store, ResultStore) else ResultStore(store)
    tasks = plan_tasks(spec, store.done)
    points = sum(len(t["points"]) for t in tasks)
    bar = _progress_bar(points, progress)
    failed = 0

    def finished(records):
        nonlocal failed
        store.add(records)
        failed += sum(not r.get("ok") for r in records)
        bar.update(len(records))
        bar.set_postfix(failed=failed)

    try:
        if workers == 0 or not tasks:
            for task in tasks:
                finished(run_task(task))
        else:
            _run_on_ray(tasks, workers, address, finished)
    finally:
        bar.close()
    return ordered_records(spec, store)


def _run_on_ray(tasks, workers, address, finished) -> None:
    try:
        import ray
    except ImportError:
        from ..models.trained import MissingExtraError

        raise MissingExtraError("lpx-tvm sweep runs on Ray: pip install \"lpx-tvm[sweep]\" (or --workers 0 to run the "
                                "points in this process)") from None
    started = not ray.is_initialized()
    if started:
        if address:
            ray.init(address=address, runtime_env={"env_vars": ONE_THREAD}, log_to_driver=False)
        else:
            # a Ray of our own on this machine: its start-up notes (its auth token among them) are not the
            # user's to act on; a cluster joined by --address keeps Ray's own logging
            ray.init(num_cpus=workers or os.cpu_count(), include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": ONE_THREAD}, logging_level=logging.ERROR)
    remote = ray.remote(num_cpus=1, max_retries=0)(run_task)
    limit = workers or int(ray.cluster_resources().get("CPU", 1))
    pending, queue = [], list(tasks)
    try:
        while queue or pending:
            while queue and len(pending) < limit:
                pending.append(remote.remote(queue.pop(0)))
            ready, pending = ray.wait(pending, num_returns=1)
            finished(ray.get(ready[0]))
    finally:
        for ref in pending:
            ray.cancel(ref, force=True)
        if started:
            ray.shutdown()


def _progress_bar(total: int, show: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="point", disable=not show, file=sys.stderr, dynamic_ncols=True)


def ordered_records(spec: SweepSpec, store: ResultStore) -> list:
    """The spec's points as stored, in spec order, with each (model, dtype)'s Pareto front marked."""
    version = project_version()
    records = []
    for config in spec.configs():
        for model in spec.models:
            for dtype in spec.dtypes:
                record = store.records.get(point_key(config, model, dtype, version))
                if record is not None:
                    records.append(dict(record))
    for model, dtype in itertools.product(spec.models, spec.dtypes):
        group = [r for r in records if r["model"] == model and r["dtype"] == dtype and r.get("ok")]
        front = set(pareto_front(group, "area_mm2", "latency_us"))
        for k, record in enumerate(group):
            record["pareto"] = k in front
    return records


# ---- output --------------------------------------------------------------------------------------------------
COLUMNS = [("variant", "chip"), ("model", "model"), ("dtype", "dtype"), ("ok", "ok"), ("cycles", "cycles"),
           ("latency_us", "latency µs"), ("mac_utilisation", "MAC util"), ("fits", "fits"),
           ("streamed_mb", "streamed MB"), ("chips", "chips"), ("tokens_per_s_per_user", "tokens/s per user"),
           ("area_mm2", "area mm² (proxy)"), ("pareto", "Pareto")]


def table(records: list, metrics=METRICS) -> Report:
    """The sweep's :class:`~lpx_tvm.app.output.Report`: a row a point (of the spec's metrics only), the failed
    points under it."""
    shown = [(k, h) for k, h in COLUMNS if k not in METRICS or k in metrics]
    rows = []
    for r in records:
        row = []
        for key, _ in shown:
            value = r.get(key)
            if key == "mac_utilisation" and value is not None:
                value = f"{100 * value:.1f}%"
            elif isinstance(value, float):
                value = f"{value:.4g}"
            row.append("" if value is None else value)
        rows.append(row)
    blocks = [Table([h for _, h in shown], rows, numparse=False)]
    failures = [f"{r['variant']} {r['model']} {r['dtype']}: {r['error']}" for r in records if not r.get("ok")]
    if failures:
        blocks.append("failed points:\n  " + "\n  ".join(failures))
    return Report("Design sweep", blocks, records)


def write_results(records: list, path) -> Path:
    """Write the records as CSV, or Parquet (needs pyarrow) by the file's extension."""
    path = Path(path)
    flat = [{k: (json.dumps(v, sort_keys=True) if isinstance(v, dict) else v) for k, v in r.items()}
            for r in records]
    keys = [k for k, _ in COLUMNS] + sorted({k for r in flat for k in r} - {k for k, _ in COLUMNS})
    if path.suffix == ".parquet":
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            from ..models.trained import MissingExtraError

            raise MissingExtraError("writing Parquet needs pyarrow (pip install pyarrow), or use a .csv path") from None
        pq.write_table(pa.table({k: [r.get(k) for r in flat] for k in keys}), str(path))
    elif path.suffix == ".csv":
        import csv

        with path.open("w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=keys)
            writer.writeheader()
            writer.writerows(flat)
    else:
        raise LpxUserError(f"{path}: results are written as .csv or .parquet")
    return path


def store_path(out) -> Path:
    """The JSON-lines store beside an output file (``results.csv`` ─► ``results.jsonl``)."""
    out = Path(out)
    return out if out.suffix == ".jsonl" else out.with_suffix(".jsonl")
