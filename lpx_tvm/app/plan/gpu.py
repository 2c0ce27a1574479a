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

from ...runtime_sim.errors import LpxUserError

_HERE = Path(__file__).with_name("gpu_systems")
_FILE = json.loads((_HERE / "gpus.json").read_text())
GPUS = {k: v for k, v in _FILE.items() if not k.startswith("_")}
LPX_SIDE = _FILE["_lpx_side"]
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
    from .model import PRESETS

    name = str(model)
    if name in PRESETS:
        data = dict(PRESETS[name])
    elif Path(name).is_file():
        data = json.loads(Path(name).read_text())
    else:
        raise GpuError(f"model {name!r}: the GPU side needs a preset of lpx_tvm/app/plan/configs or a config.json file")
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


# ---- the GPU side's quantisation: --dtype where AIConfigurator's tables hold it, else as it deploys the model --
FAMILIES = {"gemm": "gemm_quant_mode", "moe": "moe_quant_mode", "fmha": "fmha_quant_mode", "kv": "kvcache_quant_mode"}
_NAMES = {"gemm": "GEMM", "moe": "MoE", "fmha": "attention (FMHA)", "kv": "KV cache"}
# where neither --dtype's mode nor the checkpoint's is in the tables: the nearest they hold, in this order
_ORDER = {"fp8": ("fp8", "fp8_block", "w4a8_mxfp4_mxfp8", "nvfp4", "w4a16_mxfp4", "bfloat16"),
          "bf16": ("bfloat16", "fp8_block", "fp8", "w4a16_mxfp4", "w4a8_mxfp4_mxfp8", "nvfp4")}
_ORDER["fp16"] = ("float16",) + _ORDER["bf16"]
# the checkpoint's expert weights with --dtype's activations, where AIConfigurator has such a lane (an MXFP4
# checkpoint at fp8: MXFP4 weights, MXFP8 activations, as TensorRT-LLM runs gpt-oss's experts on Blackwell)
_ACTIVATION_LANE = {("w4a16_mxfp4", "fp8"): "w4a8_mxfp4_mxfp8"}


@dataclass(frozen=True)
class GpuQuant:
    """The quantisation modes AIConfigurator prices the model's GPU side in, and why each differs from ``--dtype``.

    ``why`` holds ``(family, reason)`` for every mode that is not ``--dtype``'s own; ``moe_splits`` the
    ``(moe_tp, moe_ep)`` pairs AIConfigurator's MoE table holds for the model's expert shape in ``moe`` (None
    where nothing was probed: a dense model, or a system priced at the speed of light)."""

    gemm: str
    moe: str
    fmha: str
    kv: str
    dtype: str
    why: tuple = ()
    moe_splits: tuple | None = None

    def kwargs(self) -> dict:
        return {key: getattr(self, family) for family, key in FAMILIES.items()}

    def split(self, tp: int) -> tuple | None:
        """``(moe_tp, moe_ep)`` for ``tp`` GPUs: expert parallel across them all where the MoE table holds it,
        else the widest expert parallel it holds with tensor parallel making up the rest; None where it holds
        no split of ``tp``."""
        if self.moe_splits is None:
            return (1, tp)
        pairs = [(t, e) for t, e in self.moe_splits if t * e == tp]
        return max(pairs, key=lambda p: p[1]) if pairs else None

    def describe(self) -> str:
        """``gemm fp8_block (why), moe w4a8_mxfp4_mxfp8 (why), fmha fp8, kv fp8``."""
        why = dict(self.why)
        return ", ".join(f"{family} {getattr(self, family)}" + (f" ({why[family]})" if family in why else "")
                         for family in FAMILIES)


def parse_gpu_quant(text: str | None) -> dict | str | None:
    """``--gpu-quant``: None or ``auto`` (--dtype where the tables hold it), ``checkpoint`` (AIConfigurator's own
    reading of the model's ``quantization_config``, as its CLI prices the published checkpoint), or
    ``FAMILY=MODE[,FAMILY=MODE]`` with FAMILY one of gemm, moe, fmha, kv and MODE AIConfigurator's name."""
    if text is None or text == "auto":
        return None
    if text == "checkpoint":
        return text
    from aiconfigurator_core.sdk import common

    enums = {"gemm": common.GEMMQuantMode, "moe": common.MoEQuantMode, "fmha": common.FMHAQuantMode,
             "kv": common.KVCacheQuantMode}
    chosen = {}
    for part in str(text).split(","):
        family, _, mode = part.strip().partition("=")
        if family not in enums or not mode:
            raise GpuError(f"--gpu-quant {text}: give auto, checkpoint, or FAMILY=MODE[,...] with FAMILY one of "
                           f"{', '.join(enums)} (e.g. moe=w4a8_mxfp4_mxfp8,fmha=bfloat16)")
        if mode not in enums[family].__members__:
            raise GpuError(f"--gpu-quant {family}={mode}: AIConfigurator has no {family} mode {mode!r} (one of "
                           f"{', '.join(enums[family].__members__)})")
        chosen[family] = mode
    return chosen


@lru_cache(maxsize=16)
def database(gpu: GpuSystem):
    """AIConfigurator's performance database for the system in its mode (measured tables, or SOL)."""
    from aiconfigurator_core.sdk import perf_database

    paths = [gpu.systems_path] if gpu.systems_path else None
    db = perf_database.get_database_view(gpu.aic_system, BACKEND, BACKEND_VERSION, systems_paths=paths,
                                         allow_missing_data=gpu.mode != "SILICON", database_mode=gpu.mode,
                                         allow_unlisted_version=gpu.systems_path is not None)
    if db is None:
        raise GpuError(f"aiconfigurator-core has no {BACKEND} {BACKEND_VERSION} database for {gpu.aic_system}")
    return db


def _moe_table(db, info: dict) -> dict:
    """MoE mode → the ``(moe_tp, moe_ep)`` pairs AIConfigurator's MoE table holds for the model's expert shape
    (any workload distribution), the way its own coverage probes walk the table."""
    from aiconfigurator_core.sdk.operations.moe import MoE

    MoE.load_data(db)
    table = db._moe_data or {}
    held = {}
    for mode, by_dist in table.items():
        pairs = set()
        for by_topk in by_dist.values():
            by_inter = ((((by_topk.get(info["topk"]) or {}).get(info["num_experts"]) or {})
                         .get(info["hidden_size"])) or {}).get(info["moe_inter_size"]) or {}
            for moe_tp, by_ep in by_inter.items():
                pairs.update((moe_tp, ep) for ep, tokens in by_ep.items() if tokens)
        if pairs:
            held[getattr(mode, "name", str(mode))] = tuple(sorted(pairs))
    return held


@lru_cache(maxsize=64)
def resolve_quant(model_path: str, gpu: GpuSystem, dtype: str, choice=None) -> GpuQuant:
    """The modes the GPU side is priced in, for each operation family (GEMMs, experts, attention, KV cache).

    Each is ``--dtype``'s mode where AIConfigurator's tables for the system hold it for the model; where the
    model's checkpoint declares a variant of the same precision (DeepSeek-V3's block-scaled fp8), that variant,
    as AIConfigurator reads the checkpoint. Where the tables hold no such data (gpt-oss-120b's experts in fp8,
    DeepSeek's context MLA in fp8 on GB300), the family is priced as AIConfigurator deploys the published
    checkpoint: its own reading of the ``quantization_config`` (with ``--dtype``'s activations where it has
    such a lane), else the nearest mode the tables hold; and :attr:`GpuQuant.why` says so, never silently.
    ``choice`` (:func:`parse_gpu_quant`) overrides: ``checkpoint`` for AIConfigurator's reading throughout, or
    modes by family. A speed-of-light system has no tables: its modes are ``--dtype``'s (or the choice).
    """
    from aiconfigurator_core.sdk import common
    from aiconfigurator_core.sdk.models.helpers import (
        _architecture_to_model_family, _get_model_info, _infer_quant_modes_from_raw_config, attention_op_keys)
    from aiconfigurator_core.sdk.perf_database import context_fmha_supported_modes

    if isinstance(choice, str) and choice != "checkpoint":
        choice = parse_gpu_quant(choice)
    if isinstance(choice, tuple):
        choice = dict(choice)
    requested = {family: quant_modes(dtype)[key] for family, key in FAMILIES.items()}
    try:
        info = _get_model_info(model_path)
    except ValueError as err:  # an architecture it has no model of (Gemma 3's, say): the GPU side cannot price it
        raise GpuError(f"AIConfigurator cannot model it: {str(err).split('. ')[0]}") from None
    family_of = {key: family for family, key in FAMILIES.items()}
    inferred = {family_of[key]: mode.name for key, mode in
                _infer_quant_modes_from_raw_config(info.get("raw_config", {}), info["architecture"]).items()
                if key in family_of}
    moe = bool(info.get("num_experts"))
    explicit = dict(choice) if isinstance(choice, dict) else {}
    if choice == "checkpoint":  # AIConfigurator's own defaults: the checkpoint's reading, else bfloat16
        explicit = {family: inferred.get(family, "bfloat16") for family in FAMILIES}
    if gpu.mode != "SILICON":
        modes = {**requested, **explicit}
        why = tuple((f, "--gpu-quant") for f in FAMILIES if f in explicit and explicit[f] != requested[f])
        return GpuQuant(**modes, dtype=dtype, why=why)

    db = database(gpu)
    family_name = _architecture_to_model_family(info["architecture"])
    ctx_op, gen_op = attention_op_keys(family_name, BACKEND)
    supported = db.supported_quant_mode
    mla = ctx_op == "context_mla"
    moe_held = _moe_table(db, info) if moe else {}
    shape = (f"{info['num_experts']} experts of {info['hidden_size']}×{info['moe_inter_size']}, top-{info['topk']}"
             if moe else "")
    where = f"AIConfigurator's {gpu.aic_system} {BACKEND} tables"
    modes, why = {}, []
    for family in ("gemm", "kv", "moe", "fmha"):  # fmha's tables are keyed by the KV cache's mode
        if family == "gemm":
            held, what = set(supported.get("gemm", [])), "GEMM"
        elif family == "kv":
            held, what = set(supported.get(gen_op, [])), f"decode {'MLA' if mla else 'attention'} KV cache"
        elif family == "moe":
            if not moe:
                modes[family] = requested[family]
                continue
            held, what = set(moe_held), f"MoE for {shape}"
        else:
            held = set(context_fmha_supported_modes(db, ctx_op, common.KVCacheQuantMode[modes["kv"]]))
            what = f"context {'MLA' if mla else 'attention'} with a {modes['kv']} KV cache"
        want, mine = requested[family], inferred.get(family)
        if family in explicit:
            mode = explicit[family]
            if held and mode not in held:
                raise GpuError(f"--gpu-quant {family}={mode}: {where} hold no {mode} {what} (they hold "
                               f"{', '.join(sorted(held))})")
            modes[family] = mode
            if mode != want:
                why.append((family, "--gpu-quant" if choice != "checkpoint" else "the checkpoint's, --gpu-quant "
                                                                                  "checkpoint"))
            continue
        same = mine is not None and mine != want and _same_precision(family, mine, want)
        order = ([mine] if same else []) + [want] + ([_ACTIVATION_LANE[(mine, dtype)]]
                                                      if (mine, dtype) in _ACTIVATION_LANE else []) \
            + ([mine] if mine else []) + list(_ORDER.get(dtype, _ORDER["bf16"]))
        mode = next((m for m in order if m in held), None)
        if mode is None:
            raise GpuError(f"{where} hold no {what} in any mode lpx-tvm can choose"
                           + (f" (they hold {', '.join(sorted(held))}; --gpu-quant {family}=MODE)" if held else ""))
        modes[family] = mode
        if mode == want:
            continue
        if same and mode == mine:
            why.append((family, f"the checkpoint's {dtype} is {mode}, as AIConfigurator reads its "
                                "quantization_config"))
            continue
        missing = f"{where} have no {want} {what}"
        if mode == mine:
            why.append((family, f"{missing}: the checkpoint's {mode}, as AIConfigurator deploys it"))
        elif (mine, dtype) in _ACTIVATION_LANE and mode == _ACTIVATION_LANE[(mine, dtype)]:
            why.append((family, f"{missing}: the checkpoint's {mine} weights with {dtype} activations"))
        elif family == "fmha" and mode == "bfloat16":
            why.append((family, f"{missing}: bfloat16, AIConfigurator's own fallback for it"))
        else:
            why.append((family, f"{missing}: the nearest they hold"))
    return GpuQuant(**{f: modes[f] for f in FAMILIES}, dtype=dtype, why=tuple(why),
                    moe_splits=moe_held.get(modes["moe"]) if moe else None)


def _same_precision(family: str, a: str, b: str) -> bool:
    """Whether two of AIConfigurator's modes store and compute alike (fp8_block and fp8: one byte, fp8 maths)."""
    from aiconfigurator_core.sdk import common

    enum = {"gemm": common.GEMMQuantMode, "moe": common.MoEQuantMode, "fmha": common.FMHAQuantMode,
            "kv": common.KVCacheQuantMode}[family]
    if a not in enum.__members__ or b not in enum.__members__:
        return False
    x, y = enum[a].value, enum[b].value
    return (x.memory, x.compute_dtype) == (y.memory, y.compute_dtype)


def _quant(model_path: str, gpu: GpuSystem, quant) -> GpuQuant:
    """``quant`` as a :class:`GpuQuant`: a storage type's name is resolved (:func:`resolve_quant`)."""
    return quant if isinstance(quant, GpuQuant) else resolve_quant(model_path, gpu, quant)


def width_ok(quant: GpuQuant, tp: int) -> bool:
    """Whether AIConfigurator's MoE table holds a split of ``tp`` GPUs for the model's experts."""
    return quant.split(tp) is not None


@lru_cache(maxsize=64)
def engine(model_path: str, gpu: GpuSystem, tp: int, quant, moe: bool = False):
    """``(EngineHandle, model, database)``: the model compiled by AIConfigurator for ``tp`` GPUs (a mixture's
    experts spread over them: expert parallel ``tp`` where its MoE table holds that, :meth:`GpuQuant.split`),
    as its own ``compile_engine`` does, in the modes of ``quant`` (a :class:`GpuQuant`, or a storage type's
    name, resolved), against the system's database in its mode (measured tables, or SOL for a system without
    them)."""
    import aiconfigurator_core
    from aiconfigurator_core.sdk.config_builders import build_model_config
    from aiconfigurator_core.sdk.engine import EngineHandle, build_engine_spec_json
    from aiconfigurator_core.sdk.models import get_model

    quant = _quant(model_path, gpu, quant)
    moe_tp, moe_ep = (quant.split(tp) or (1, tp)) if moe else (tp, 1)
    config = build_model_config(tp_size=tp, pp_size=1, attention_dp_size=1, moe_tp_size=moe_tp,
                                moe_ep_size=moe_ep, **quant.kwargs())
    model = get_model(model_path, config, BACKEND)  # (an architecture it has no model of failed in resolve_quant)
    db = database(gpu)
    spec = build_engine_spec_json(model, model_path=model_path, system=gpu.aic_system, backend=BACKEND,
                                  backend_version=BACKEND_VERSION, kv_block_size=None,
                                  systems_path=gpu.systems_path, nextn=0, database=db)
    handle = EngineHandle(bytes(aiconfigurator_core.engine_spec_bincode_from_json(spec)),
                          systems_path=gpu.systems_path)
    return handle, model, db


@lru_cache(maxsize=4096)
def fits(model_path: str, gpu: GpuSystem, tp: int, quant, batch: int, context: int, moe: bool) -> bool:
    """Whether AIConfigurator's memory model (weights, KV cache, activations, NCCL, its margin) fits a GPU."""
    from aiconfigurator_core.sdk.backends.factory import get_backend

    _, model, database = engine(model_path, gpu, tp, quant, moe)
    used = get_backend(BACKEND)._get_memory_usage(model, database, batch, 1, context, 2, num_tokens=batch)
    return used["total"] * 2**30 <= gpu.memory_bytes


@lru_cache(maxsize=4096)
def decode_step(model_path: str, gpu: GpuSystem, tp: int, quant, batch: int, context: int,
                moe: bool = False) -> dict:
    """One decode step of ``batch`` sequences against ``context`` cached positions on ``tp`` GPUs.

    Returns
    -------
    dict
        ``tpot_ms`` (AIConfigurator's ``decode_step_latency``), ``attention_ms`` (its attention-side operations,
        as its own AFD partitioner ``build_afd_ops_partition`` assigns them, with the attention's all-reduce),
        ``ffn_ms`` (the rest), and ``ops`` (name → ms).
    """
    handle, model, _ = engine(model_path, gpu, tp, quant, moe)
    ops = handle.decode_step_per_op(batch, context, 2)
    tpot = handle.decode_step_latency(batch, context, 2)
    attention = _attention_ops(model_path, gpu, tp, quant, moe)
    attn = sum(ms for name, ms, *_ in ops if name in attention)
    return {"tpot_ms": tpot, "attention_ms": attn, "ffn_ms": tpot - attn, "ops": {n: ms for n, ms, *_ in ops}}


@lru_cache(maxsize=64)
def _attention_ops(model_path: str, gpu: GpuSystem, tp: int, quant, moe: bool) -> frozenset:
    """The names of the decode step's attention-side operations, as AIConfigurator's AFD partitioner assigns
    them, with the attention output's all-reduce (a TP attention group needs it; the FFN's collectives go with
    the FFN, to LPX in AFD)."""
    from aiconfigurator_core.sdk.afd_partition import build_afd_ops_partition

    split = build_afd_ops_partition(engine(model_path, gpu, tp, quant, moe)[1], "generation")
    return frozenset({op._name for op in split.attn_ops}
                     | {op._name for op in split.skipped_ops if op._name.endswith(("_ar_1", "embedding_ar"))})


@lru_cache(maxsize=4096)
def prefill_ms(model_path: str, gpu: GpuSystem, tp: int, quant, prompt: int, moe: bool = False) -> float:
    """AIConfigurator's time to prefill one ``prompt``-token request on ``tp`` GPUs (``predict_prefill_latency``)."""
    handle, _, _ = engine(model_path, gpu, tp, quant, moe)
    return handle.predict_prefill_latency(1, prompt)


@lru_cache(maxsize=4096)
def verify_ms(model_path: str, gpu: GpuSystem, tp: int, quant, batch: int, rows: int, context: int,
              moe: bool = False) -> float:
    """A speculative verify step: ``rows`` new tokens of each of ``batch`` sequences against ``context`` cached
    positions, as AIConfigurator prices a prefill of ``rows`` tokens after a cached prefix (its ``isl`` counts
    the prefix)."""
    handle, _, _ = engine(model_path, gpu, tp, quant, moe)
    return handle.predict_prefill_latency(batch, context + rows, context)


def with_link(gpu: GpuSystem, **changes) -> GpuSystem:
    """``gpu`` with its link's figures changed (tests, sweeps)."""
    return replace(gpu, link=replace(gpu.link, **changes))
