"""The GPU half of a heterogeneous plan, priced by NVIDIA's AIConfigurator (``aiconfigurator-core``).

lpx-tvm has no GPU model of its own: every GPU figure here (a decode step's time, its attention and FFN
operations, a prefill, the memory a configuration needs) is what ``aiconfigurator_core`` returns for the model,
GPU system, batch and parallelism. GB300, GB200, B200, H200 and H100 use its measured kernel tables; Vera
Rubin (``vr200``) has none, so it is a system file of NVIDIA's preliminary figures (``gpu_systems/vr200.yaml``)
queried in AIConfigurator's speed-of-light mode and labelled "derived from published figures".

The model is handed to AIConfigurator as a Hugging Face ``config.json`` of the same shapes the LPX plan uses
(a preset of ``configs/`` or the user's file; an ``architectures`` entry is added where a preset has none), in
a folder of its own, so nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

from ..runtime_sim.errors import LpxUserError

_HERE = Path(__file__).with_name("gpu_systems")
GPUS = {k: v for k, v in json.loads((_HERE / "gpus.json").read_text()).items() if not k.startswith("_")}
LPX_SIDE = json.loads((_HERE / "gpus.json").read_text())["_lpx_side"]
BACKEND, BACKEND_VERSION = "trtllm", "1.3.0rc20"  # the framework whose tables are used (AIConfigurator's current)
# AIConfigurator's quantisation modes for lpx-tvm's storage types (weights, KV cache, attention, experts)
_QUANT = {"fp8": ("fp8", "fp8", "fp8", "fp8"), "fp16": ("bfloat16", "bfloat16", "float16", "bfloat16"),
          "bf16": ("bfloat16", "bfloat16", "bfloat16", "bfloat16")}


class GpuError(LpxUserError):
    """A GPU system, link figure or model the GPU side cannot price, naming what was wrong."""


@dataclass(frozen=True)
class Link:
    """The GPU–LPX path: bytes a second a GPU (one direction), its latency, an LPX rack's own cap; assumed."""

    GBps_per_gpu: float
    latency_us: float
    GBps_per_lpx_rack: float
    assumed: bool = True
    why: str = ""

    def rate(self, gpus: int, lpx_racks: int) -> float:
        """Bytes a second across the path for ``gpus`` GPUs talking to ``lpx_racks`` racks at once."""
        return 1e9 * min(gpus * self.GBps_per_gpu, max(lpx_racks, 1) * self.GBps_per_lpx_rack)


@dataclass(frozen=True)
class GpuSystem:
    """``--gpu NAME[:N]``: N GPUs of one kind, AIConfigurator's system file for them, and the link to LPX."""

    name: str
    gpus: int
    aic_system: str
    systems_path: str | None
    mode: str  # AIConfigurator's database mode: SILICON (measured) or SOL (speed of light)
    label: str
    watts: float  # a GPU's power, from the system file
    per_rack: int
    memory_bytes: float
    link: Link

    @property
    def racks(self) -> int:
        return -(-self.gpus // self.per_rack)


def gpu_system(spec: str, link: str | None = None) -> GpuSystem:
    """Parse ``--gpu NAME[:N]`` (N GPUs, default one rack) and ``--gpu-link GBPS[,LATENCY_US]``.

    Parameters
    ----------
    spec : str
        ``gb300``, ``gb300:72``, ``vr200:144``, ... (:data:`GPUS`).
    link : str, optional
        The GPU–LPX link, overriding the assumed figure: gigabytes a second a GPU each way, and optionally the
        latency in microseconds (``100`` or ``100,5``).

    Returns
    -------
    GpuSystem
    """
    import yaml

    name, _, count = str(spec).partition(":")
    if name not in GPUS:
        raise GpuError(f"--gpu {spec}: unknown GPU {name!r} (one of {', '.join(GPUS)}, optionally :N GPUs)")
    entry = GPUS[name]
    path = str(_HERE) if entry["systems_path"] == "here" else None
    figures = yaml.safe_load(Path(path or _aic_systems()).joinpath(f"{entry['aic_system']}.yaml").read_text())
    per_rack = int(figures["node"].get("num_gpus_per_rack", figures["node"]["num_gpus_per_node"]))
    try:
        gpus = int(count) if count else per_rack
    except ValueError:
        gpus = 0
    if gpus < 1:
        raise GpuError(f"--gpu {spec}: the GPU count after ':' must be a positive integer")
    base = entry["link"]
    bw, latency = base["GBps_per_gpu"], base["latency_us"]
    if link is not None:
        try:
            parts = [float(p) for p in str(link).split(",")]
            if not 1 <= len(parts) <= 2 or parts[0] <= 0 or (len(parts) == 2 and parts[1] < 0):
                raise ValueError
        except ValueError:
            raise GpuError(f"--gpu-link {link}: give GB/s a GPU each way and optionally the latency in µs, "
                           "e.g. 100 or 100,5") from None
        bw, latency = parts[0], parts[1] if len(parts) == 2 else latency
    why = base["why"] if link is None else "--gpu-link"
    return GpuSystem(name, gpus, entry["aic_system"], path, entry["mode"], entry["label"],
                     float(figures["gpu"]["power"]), per_rack, float(figures["gpu"]["mem_capacity"]),
                     Link(bw, latency, LPX_SIDE["GBps_per_rack"], link is None, why))


def _aic_systems() -> Path:
    import aiconfigurator_core

    return Path(aiconfigurator_core.__file__).with_name("systems")


def require_aiconfigurator() -> None:
    """Raise a one-line :class:`GpuError` when the ``gpu`` extra is not installed."""
    try:
        import aiconfigurator_core  # noqa: F401
    except ImportError:
        raise GpuError("--gpu needs NVIDIA's aiconfigurator-core: pip install 'lpx-tvm[gpu]'") from None
    # its loggers narrate every table it loads; a plan prints only its own lines
    logging.getLogger("aiconfigurator_core").setLevel(logging.ERROR)


def missing_data() -> tuple:
    """The exception AIConfigurator raises where its tables hold no measurement for an operation (a MoE shape in
    fp8 on GB300, say): a mode that needs one cannot be priced on that GPU, and says so."""
    try:
        from aiconfigurator_core.sdk.errors import PerfDataNotAvailableError
    except ImportError:
        return ()
    return (PerfDataNotAvailableError,)


def model_dir(model) -> str:
    """A folder holding the model's ``config.json`` for AIConfigurator: the preset's or the user's file, with an
    ``architectures`` entry (Llama, or Mixtral where it has experts) where it has none."""
    from .plan_model import PRESETS

    name = str(model)
    if name in PRESETS:
        data = dict(PRESETS[name])
    elif Path(name).is_file():
        data = json.loads(Path(name).read_text())
    else:
        raise GpuError(f"model {name!r}: the GPU side needs a preset of lpx_tvm/app/configs or a config.json file")
    if "architectures" not in data:
        moe = bool(data.get("num_local_experts"))
        data.update(architectures=["MixtralForCausalLM" if moe else "LlamaForCausalLM"],
                    model_type="mixtral" if moe else "llama")
    data.setdefault("max_position_embeddings", 131072)
    data.setdefault("rms_norm_eps", 1e-5)
    text = json.dumps(data, sort_keys=True)
    folder = Path(tempfile.gettempdir()) / "lpx-tvm-aic" / hashlib.sha256(text.encode()).hexdigest()[:16]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(text)
    return str(folder)


def quant_modes(dtype: str) -> dict:
    """AIConfigurator's quantisation keywords for a storage type."""
    if dtype not in _QUANT:
        raise GpuError(f"the GPU side prices {', '.join(_QUANT)}, not {dtype}")
    gemm, kv, fmha, moe = _QUANT[dtype]
    return {"gemm_quant_mode": gemm, "kvcache_quant_mode": kv, "fmha_quant_mode": fmha, "moe_quant_mode": moe}


@lru_cache(maxsize=64)
def engine(model_path: str, gpu: GpuSystem, tp: int, dtype: str, moe: bool = False):
    """``(EngineHandle, model, database)``: the model compiled by AIConfigurator for ``tp`` GPUs (a mixture's
    experts spread over them: expert parallel ``tp``), as its own ``compile_engine`` does, against the system's
    database in its mode (measured tables, or SOL for a system without them)."""
    import aiconfigurator_core
    from aiconfigurator_core.sdk import perf_database
    from aiconfigurator_core.sdk.config_builders import build_model_config
    from aiconfigurator_core.sdk.engine import EngineHandle, build_engine_spec_json
    from aiconfigurator_core.sdk.models import get_model

    quant = quant_modes(dtype)
    config = build_model_config(tp_size=tp, pp_size=1, attention_dp_size=1, moe_tp_size=1 if moe else tp,
                                moe_ep_size=tp if moe else 1, **quant)
    model = get_model(model_path, config, BACKEND)
    paths = [gpu.systems_path] if gpu.systems_path else None
    database = perf_database.get_database_view(gpu.aic_system, BACKEND, BACKEND_VERSION, systems_paths=paths,
                                               allow_missing_data=gpu.mode != "SILICON", database_mode=gpu.mode,
                                               allow_unlisted_version=gpu.systems_path is not None)
    if database is None:
        raise GpuError(f"aiconfigurator-core has no {BACKEND} {BACKEND_VERSION} database for {gpu.aic_system}")
    spec = build_engine_spec_json(model, model_path=model_path, system=gpu.aic_system, backend=BACKEND,
                                  backend_version=BACKEND_VERSION, kv_block_size=None,
                                  systems_path=gpu.systems_path, nextn=0, database=database)
    handle = EngineHandle(bytes(aiconfigurator_core.engine_spec_bincode_from_json(spec)),
                          systems_path=gpu.systems_path)
    return handle, model, database


@lru_cache(maxsize=4096)
def fits(model_path: str, gpu: GpuSystem, tp: int, dtype: str, batch: int, context: int, moe: bool) -> bool:
    """Whether AIConfigurator's memory model (weights, KV cache, activations, NCCL, its margin) fits a GPU."""
    from aiconfigurator_core.sdk.backends.factory import get_backend

    _, model, database = engine(model_path, gpu, tp, dtype, moe)
    used = get_backend(BACKEND)._get_memory_usage(model, database, batch, 1, context, 2, num_tokens=batch)
    return used["total"] * 2**30 <= gpu.memory_bytes


@lru_cache(maxsize=4096)
def decode_step(model_path: str, gpu: GpuSystem, tp: int, dtype: str, batch: int, context: int,
                moe: bool = False) -> dict:
    """One decode step of ``batch`` sequences against ``context`` cached positions on ``tp`` GPUs.

    Returns
    -------
    dict
        ``tpot_ms`` (AIConfigurator's ``decode_step_latency``), ``attention_ms`` (its attention-side operations,
        as its own AFD partitioner ``build_afd_ops_partition`` assigns them, with the attention's all-reduce),
        ``ffn_ms`` (the rest), and ``ops`` (name → ms).
    """
    handle, model, _ = engine(model_path, gpu, tp, dtype, moe)
    ops = handle.decode_step_per_op(batch, context, 2)
    tpot = handle.decode_step_latency(batch, context, 2)
    attention = _attention_ops(model_path, gpu, tp, dtype, moe)
    attn = sum(ms for name, ms, *_ in ops if name in attention)
    return {"tpot_ms": tpot, "attention_ms": attn, "ffn_ms": tpot - attn, "ops": {n: ms for n, ms, *_ in ops}}


@lru_cache(maxsize=64)
def _attention_ops(model_path: str, gpu: GpuSystem, tp: int, dtype: str, moe: bool) -> frozenset:
    """The names of the decode step's attention-side operations, as AIConfigurator's AFD partitioner assigns
    them, with the attention output's all-reduce (a TP attention group needs it; the FFN's collectives go with
    the FFN, to LPX in AFD)."""
    from aiconfigurator_core.sdk.afd_partition import build_afd_ops_partition

    split = build_afd_ops_partition(engine(model_path, gpu, tp, dtype, moe)[1], "generation")
    return frozenset({op._name for op in split.attn_ops}
                     | {op._name for op in split.skipped_ops if op._name.endswith(("_ar_1", "embedding_ar"))})


@lru_cache(maxsize=4096)
def prefill_ms(model_path: str, gpu: GpuSystem, tp: int, dtype: str, prompt: int, moe: bool = False) -> float:
    """AIConfigurator's time to prefill one ``prompt``-token request on ``tp`` GPUs (``predict_prefill_latency``)."""
    handle, _, _ = engine(model_path, gpu, tp, dtype, moe)
    return handle.predict_prefill_latency(1, prompt)


@lru_cache(maxsize=4096)
def verify_ms(model_path: str, gpu: GpuSystem, tp: int, dtype: str, batch: int, rows: int, context: int,
              moe: bool = False) -> float:
    """A speculative verify step: ``rows`` new tokens of each of ``batch`` sequences against ``context`` cached
    positions, as AIConfigurator prices a prefill of ``rows`` tokens after a cached prefix (its ``isl`` counts
    the prefix)."""
    handle, _, _ = engine(model_path, gpu, tp, dtype, moe)
    return handle.predict_prefill_latency(batch, context + rows, context)


def with_link(gpu: GpuSystem, **changes) -> GpuSystem:
    """``gpu`` with its link's figures changed (tests, sweeps)."""
    return replace(gpu, link=replace(gpu.link, **changes))
