"""LPX beside GPUs: ``lpx-tvm plan --gpu gb300[:N] --mode ...``, each side priced by the best model of it.

LPX is priced by the compiler (:func:`.plan.plan` and, for AFD, the FFN's compiled cost in :mod:`.afd`); the
GPUs by NVIDIA's AIConfigurator (:mod:`.gpu`). The modes are the three NVIDIA describes for an LPX rack beside
Vera Rubin NVL72 racks, and the two sides alone:

* ``gpu-only``: the GPUs alone, at AIConfigurator's figures for each tensor-parallel width and batch: the
  baseline.
* ``lpx-only``: today's plan.
* ``lpx-decode``: the GPUs prefill, the prompt's KV cache crosses the GPU–LPX link once a turn (timed), and
  LPX decodes at the plan's figures.
* ``afd``: the GPUs run attention over the KV cache, LPX every layer's FFN, the activations crossing each
  layer; ping-pong micro-batches hide the exchange when there are enough (:func:`.afd.pingpong`).
* ``lpx-draft``: a draft model on LPX (its own plan), the target verifying its tokens on the GPUs (an
  AIConfigurator prefill of ``k + 1`` tokens after the cached context); a round yields
  :func:`.speculative.expected_tokens`. The draft is the target's own in :data:`DRAFTS` (or ``--draft``, of the
  target's vocabulary); only the draft need fit the LPX system, so a model LPX cannot hold has this mode too.

Every mode's GPUs also prefill: a turn of ``prompt`` tokens in and ``context − prompt`` out, so a mode
serving T tokens/s keeps ``T ÷ (context − prompt)`` prefills a second going, each AIConfigurator's prefill
time on its GPUs (counted in the GPUs, racks and power; LPX-only prefills on its own chips, as its plan says).
Each mode gives its candidates; a mode's report is its fastest per user, or, with a target, the most tokens/s
per MW (per rack where power is unknown) that reaches it.
"""

from __future__ import annotations

import time
from math import ceil

from ...runtime_sim import DType
from ...runtime_sim.errors import LpxUserError
from . import gpu as gpus
from .afd import exchange_us, ffn_cost, ffn_stages, pingpong, return_itemsize, verify_ffn_stage

MODES = ("gpu-only", "lpx-only", "lpx-decode", "afd", "lpx-draft")
GPU_WIDTHS = (1, 2, 4, 8, 16, 32, 64)  # tensor-parallel widths within an NVL72's NVLink
GPU_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
VERIFIED = ("lpx-only", "lpx-decode", "afd")  # the modes whose LPX half --verify compiles whole
LPX_ROWS = (1, 4)  # rows an FFN program is compiled for; a larger micro-batch runs as passes of it
DRAFT_TOKENS = (1, 2, 3, 4, 6, 8)
# lpx-draft's draft for each target preset, every one a preset of lpx_tvm/app/plan/configs (its source there):
# a smaller model of the target's family and vocabulary, or the target's own multi-token-prediction module
DRAFTS = {"llama-3-8b": "llama-3.2-1b", "llama-3-70b": "llama-3.2-1b", "llama-3.1-405b": "llama-3.2-1b",
          "llama-3.3-70b": "llama-3.2-1b", "gpt-oss-120b": "gpt-oss-20b", "qwen3-235b-a22b": "qwen3-0.6b",
          "deepseek-v3": "deepseek-v3-nextn"}
# targets with no draft the plan can price, and why (said by lpx-draft without --draft)
# (Kimi K2 publishes no multi-token-prediction layer, num_nextn_predict_layers 0; its public EAGLE-3 draft is a
# Llama layer over three of the target's hidden states fused, whose config.json could not be read to price it)
NO_DRAFT = {"kimi-k2": "no MTP layer, and the plan does not model its EAGLE-3 draft (AQ-MedAI/Kimi-K2-Instruct-eagle3)"}
# a target of these drafts' vocabulary that is not in DRAFTS (a config file's, say) is drafted by them
VOCABULARY_DRAFTS = ("llama-3.2-1b", "qwen3-0.6b")


class HeteroError(LpxUserError):
    """A heterogeneous plan that cannot be made as asked, naming why."""


def kv_handoff_bytes(spec, positions: int, dtype: str) -> int:
    """The KV cache of ``positions`` tokens as the plan keeps it (:meth:`.plan_model.ModelSpec.cache_bytes`): for
    a Llama ``layers × 2 (K and V) × kv_heads × head_dim × positions × bytes``; MLA's latent, a sliding layer's
    window."""
    return spec.cache_bytes(positions, 1, dtype)


def hetero_plan(model, system="lpx-rack", gpu="gb300", dtype: str = "fp8", context: int = 4096, prompt: int = 512,
                mode: str = "auto", gpu_link: str | None = None, lpx_chip_watts: float | None = None,
                max_racks: int | None = None, target_tps_per_user: float | None = None, draft=None,
                accept_rate: float = 0.7, progress=None, gpu_quant: str | None = None, on_mode=None,
                verify: bool = False, target=None) -> dict:
    """Plan a model on LPX beside GPUs in one mode or all.

    Parameters
    ----------
    model, system, dtype, context, prompt
        As for :func:`.plan.plan` (``system`` is the LPX side).
    gpu : str
        ``NAME[:N]``: N GPUs of a kind :mod:`.gpu` knows (``gb300``, ``vr200``, ...; default one rack).
    target : lpx_tvm.codegen.Target, optional
        The LPX system, the dtype and the GPU pool (its ``gpu``, a :class:`.gpu.GpuSystem`) parsed already (a
        door's), instead of ``system``, ``dtype``, ``gpu`` and ``gpu_link``.
    mode : str
        One of :data:`MODES`, or ``auto`` for every one and the frontier.
    gpu_link : str, optional
        The GPU–LPX link, ``GBPS[,LATENCY_US]`` a GPU each way, instead of the assumed figure.
    lpx_chip_watts : float, optional
        An LP30's power (none is published); without it a mode that uses LPX has no tokens/s per MW.
    max_racks : int, optional
        A mode needing more racks (GPU and LPX together) says so and names what binds.
    target_tps_per_user : float, optional
        Each mode's report is then its most efficient candidate reaching this speed.
    draft : str, optional
        The draft model of ``lpx-draft`` (default: :func:`default_draft`); one of another vocabulary is refused.
    accept_rate : float
        The chance the target accepts a draft token.
    gpu_quant : str, optional
        ``--gpu-quant``: the GPU side's quantisation modes (:func:`.gpu.parse_gpu_quant`); by default ``dtype``'s
        where AIConfigurator's tables hold them, else as it deploys the published checkpoint
        (:func:`.gpu.resolve_quant`). The report names every mode that is not ``dtype``'s, and why.
    on_mode : callable, optional
        Called with ``(name, report, points)`` as each mode is planned (a table printed as it goes).
    verify : bool
        Compile and time the LPX half of the chosen lpx-only, lpx-decode and afd candidates whole (``--verify``):
        a mode's report gains ``verify`` (the plan's cycles and the compiled ones, and the plan's error).

    Returns
    -------
    dict
        ``modes`` (mode → its report: the figures of :func:`_point`, or ``error``), ``candidates`` (each
        mode's own frontier) and ``frontier`` (tokens/s per user against tokens/s per MW, or per rack), the GPU system and the link.
    """
    from .model import plan_target
    from .search import _chips_per_rack, model_spec

    start = time.perf_counter()
    if mode != "auto" and mode not in MODES:
        raise HeteroError(f"--mode {mode}: one of {', '.join(MODES)} or auto")
    if prompt >= context:
        raise HeteroError(f"a turn needs output tokens: --prompt {prompt} must be under --context {context}")
    if lpx_chip_watts is not None and not lpx_chip_watts > 0:
        raise HeteroError(f"--lpx-chip-watts must be a positive number of watts, got {lpx_chip_watts}")
    if max_racks is not None and max_racks < 1:
        raise HeteroError(f"--max-racks must be a positive integer, got {max_racks}")
    gpus.require_aiconfigurator()
    if target is not None and (system, gpu, dtype, gpu_link) != ("lpx-rack", "gb300", "fp8", None):
        raise HeteroError("target= says what to plan for; system=, gpu=, dtype= and gpu_link= would say it again")
    if target is not None and target.gpu is None:
        raise HeteroError("a plan beside GPUs needs a target with its GPU pool (Target.parse(..., gpu=...))")
    where = target or plan_target(lpx_system(system), dtype, gpu=gpus.gpu_system(gpu, gpu_link))
    g, lpx, dtype = where.gpu, lpx_system(where.system), where.dtype
    spec = model_spec(model)
    if spec.fusion:
        raise HeteroError(f"{spec.name} is a multi-token-prediction module, a draft (plan its target with "
                          "--mode lpx-draft), not a model to serve")
    if gpu_quant is not None:
        gpus.parse_gpu_quant(gpu_quant)  # a malformed --gpu-quant fails once, before any mode
    ctx = _Context(spec, model, where, _chips_per_rack(lpx), context, prompt, lpx_chip_watts, progress, gpu_quant)
    wanted = MODES if mode == "auto" else (mode,)
    builders = {"gpu-only": _gpu_only, "lpx-only": _lpx_only, "lpx-decode": _lpx_decode, "afd": _afd,
                "lpx-draft": lambda c: _lpx_draft(c, draft, accept_rate)}
    modes, candidates = {}, []
    for name in wanted:
        ctx.say(f"hetero: {name}")
        try:
            points = builders[name](ctx)
        except LpxUserError as err:
            modes[name] = {"mode": name, "error": str(err).splitlines()[0]}
            points = []
        except gpus.missing_data() as err:
            modes[name] = {"mode": name, "error": f"AIConfigurator's {g.aic_system} tables cannot price it "
                           f"({ctx.quant_text()}): {str(err).splitlines()[0].split(' at /')[0]}"}
            points = []
        else:
            modes[name] = _choose(name, points, max_racks, target_tps_per_user, g.gpus)
            if verify and name in VERIFIED and "error" not in modes[name]:
                ctx.say(f"hetero: verifying {name}'s LPX half")
                modes[name]["verify"] = _verify(ctx, modes[name])
        if on_mode is not None:
            on_mode(name, modes[name], points)
        if not points:
            continue
        # a mode's own frontier: the candidates it beats on both axes would only fill the JSON
        candidates += frontier([p for p in points if p["fits"] and (max_racks is None or p["racks"] <= max_racks)])
    base = modes.get("gpu-only", {})
    for report in modes.values():
        if "error" not in report and base.get("tokens_per_s_per_mw") and report.get("tokens_per_s_per_mw"):
            report["vs_gpu_only"] = report["tokens_per_s_per_mw"] / base["tokens_per_s_per_mw"]
    return {"model": spec.name, "system": lpx.name, "dtype": dtype, "context": context, "prompt": prompt,
            "gpu": {"name": g.name, "gpus": g.gpus, "racks": g.racks, "label": g.label, "watts": g.watts,
                    "aiconfigurator_system": g.aic_system, "mode": g.mode, "quant": ctx.quant_report()},
            "link": {"GBps_per_gpu": g.link.GBps_per_gpu, "latency_us": g.link.latency_us,
                     "GBps_per_lpx_rack": g.link.GBps_per_lpx_rack, "assumed": g.link.assumed, "why": g.link.why},
            "lpx_chip_watts": lpx_chip_watts, "max_racks": max_racks, "target_tps_per_user": target_tps_per_user,
            "modes": modes, "candidates": candidates, "frontier": frontier(candidates),
            "plan_s": time.perf_counter() - start}


class _Context:
    """What every mode reads: the model on both sides, the systems, the turn, and the shared measurements."""

    def __init__(self, spec, model, target, lpx_per_rack, context, prompt, watts, progress, gpu_quant=None):
        self.spec, self.model, self.lpx_per_rack = spec, model, lpx_per_rack
        self.gpu, self.lpx, self.dtype = target.gpu, target.system, target.dtype
        self.context, self.prompt, self.watts, self.progress = context, prompt, watts, progress
        self.target = target  # what the LPX side's plans are for too (a plan reads its system and dtype)
        self.path = gpus.model_dir(model)
        self.moe = bool(spec.experts)
        self.output = context - prompt  # tokens a turn generates
        self.gpu_quant = gpu_quant
        self._quant = None
        self._plan = None
        self._prefill = None

    @property
    def quant(self) -> "gpus.GpuQuant":
        """The GPU side's quantisation modes (:func:`.gpu.resolve_quant`), resolved once; a
        :class:`.gpu.GpuError` where AIConfigurator's tables hold none for the model (the modes using GPUs say
        so, lpx-only goes on)."""
        if self._quant is None:
            self._quant = gpus.resolve_quant(self.path, self.gpu, self.dtype, self.gpu_quant)
        return self._quant

    def quant_report(self) -> dict:
        """The GPU modes for the report: each family's mode and why it is not ``dtype``'s, or the error."""
        try:
            q = self.quant
        except LpxUserError as err:
            return {"error": str(err).splitlines()[0]}
        return {"modes": {f: getattr(q, f) for f in gpus.FAMILIES}, "why": dict(q.why), "text": q.describe()}

    def quant_text(self) -> str:
        report = self.quant_report()
        return report.get("text") or report["error"]

    def widths(self) -> list:
        """The GPU tensor-parallel widths that split the heads (AIConfigurator asks that) within the GPUs, and,
        for a mixture, whose expert split AIConfigurator's MoE table holds (:meth:`.gpu.GpuQuant.split`)."""
        return [w for w in GPU_WIDTHS if w <= self.gpu.gpus and self.spec.heads % w == 0
                and (not self.moe or gpus.width_ok(self.quant, w))]

    def say(self, line):
        if self.progress is not None:
            self.progress(line)

    def plan(self) -> dict:
        """The LPX plan of the whole decode (the compiler's), measured once for lpx-only and lpx-decode. Where the
        system cannot hold the weights and one sequence's cache (the plan's own check, and its refusal), the LPX
        racks they need at least and what they are, in one short line (a table's note)."""
        if self._plan is None:
            from .search import plan

            weights = self.spec.chip_params() * DType.from_name(self.dtype).itemsize
            cache = self.spec.cache_bytes(self.context, 1, self.dtype)
            if weights + cache > self.lpx.chips * self.lpx.chip.sram_bytes:
                raise HeteroError(f"needs {self.racks_for(weights + cache)} LPX racks: {weights / 1e9:.1f} GB of "
                                  f"{self.dtype} weights and {cache / 1e9:.1f} GB of KV cache; {self.holds()}")
            self._plan = plan(self.model, target=self.target, context=self.context,
                              prompt=self.prompt, batches=(1, 4), progress=self.progress)
        return self._plan

    def racks_for(self, nbytes: int) -> int:
        """The LPX racks whose chips' SRAM holds ``nbytes`` at least."""
        return ceil(nbytes / (self.lpx_per_rack * self.lpx.chip.sram_bytes))

    def holds(self) -> str:
        """``lpx-rack holds 128.0 GB``: the LPX system's SRAM."""
        return f"{self.lpx.name} holds {self.lpx.chips * self.lpx.chip.sram_bytes / 1e9:.1f} GB"

    def prefill(self) -> dict:
        """The GPUs' prefill of one prompt: the width spending the fewest GPU-seconds a prompt (a prefill pool
        sized for throughput, as disaggregated serving sizes one; the soonest first token at 64 GPUs cost
        gpt-oss-120b 27 times the GPU-seconds of one GPU), AIConfigurator's time at it, and its GPU-seconds."""
        if self._prefill is None:
            best = None
            for tp in self.widths():
                if not gpus.fits(self.path, self.gpu, tp, self.quant, 1, self.prompt, self.moe):
                    continue
                ms = gpus.prefill_ms(self.path, self.gpu, tp, self.quant, self.prompt, self.moe)
                if best is None or (tp * ms, ms) < (best["gpu_s"] * 1e3, best["ms"]):
                    best = {"tp": tp, "ms": ms, "gpu_s": tp * ms / 1e3}
            if best is None:
                raise HeteroError(f"{self.spec.name} does not fit {max(GPU_WIDTHS)} {self.gpu.name} GPUs for a "
                                  "prefill (AIConfigurator's memory model)")
            self._prefill = best
        return self._prefill

    def prefill_gpus(self, tokens_per_s: float) -> float:
        """GPUs kept busy prefilling the turns of ``tokens_per_s`` output tokens a second."""
        return tokens_per_s / self.output * self.prefill()["gpu_s"]


def _whole_gpus(gpus: float) -> int:
    """Whole GPUs for a fractional need (a hair of float error is not a GPU more)."""
    return ceil(gpus - 1e-9)


def _most_groups(ctx, tp: int, rate_of) -> int:
    """The most ``tp``-wide GPU groups (0: none) that leave room beside them for the GPUs prefilling the prompts
    their tokens/s ``rate_of(groups)`` brings."""
    groups = ctx.gpu.gpus // tp
    while groups >= 1 and groups * tp + _whole_gpus(ctx.prefill_gpus(rate_of(groups))) > ctx.gpu.gpus:
        groups -= 1
    return groups


def _point(ctx, mode: str, tokens_per_s: float, per_user: float, gpus_decode: int, lpus: int, ttft_ms, bound: str,
           config: dict, prefill: bool = True) -> dict:
    """One candidate's figures: speed, resources (prefill GPUs counted), racks, power and tokens/s per MW."""
    g = ctx.gpu
    pre = ctx.prefill_gpus(tokens_per_s) if prefill else 0.0
    used = gpus_decode + _whole_gpus(pre)
    gpu_racks = ceil(used / g.per_rack) if used else 0
    lpx_racks = ceil(lpus / ctx.lpx_per_rack) if lpus else 0
    watts = (gpus_decode + pre) * g.watts
    power = None if lpus and ctx.watts is None else watts + lpus * (ctx.watts or 0)
    racks = gpu_racks + lpx_racks
    return {"mode": mode, "tokens_per_s_per_user": per_user, "tpot_ms": 1e3 / per_user, "ttft_ms": ttft_ms,
            "tokens_per_s": tokens_per_s, "users": tokens_per_s / per_user, "gpus": used, "gpus_decode": gpus_decode,
            "prefill_gpus": pre, "lpus": lpus,
            "tokens_per_s_per_gpu": tokens_per_s / used if used else None,
            "tokens_per_s_per_lpu": tokens_per_s / lpus if lpus else None,
            "gpu_racks": gpu_racks, "lpx_racks": lpx_racks, "racks": racks, "tokens_per_s_per_rack": tokens_per_s / racks,
            "power_kw": None if power is None else power / 1e3,
            "tokens_per_s_per_mw": None if power is None else tokens_per_s / (power / 1e6),
            "bound": bound, "config": config, "fits": used <= g.gpus}


def _efficiency(p):
    return p["tokens_per_s_per_mw"] if p["tokens_per_s_per_mw"] is not None else p["tokens_per_s_per_rack"]


def _choose(mode: str, points: list, max_racks, target, gpu_count: int) -> dict:
    """A mode's report: its fastest candidate per user, or the most efficient reaching ``target``; an error
    naming the racks and what binds where none fits the GPUs given or ``max_racks``."""
    feasible = [p for p in points if p["fits"]]
    if not feasible:
        least = min(points, key=lambda p: p["gpus"], default=None)
        return {"mode": mode, "error": "no candidate" if least is None else
                f"needs {least['gpus']} GPUs (decode and prefill), more than the {gpu_count} given"}
    within = [p for p in feasible if max_racks is None or p["racks"] <= max_racks]
    if not within:
        least = min(feasible, key=lambda p: p["racks"])
        return {"mode": mode, "error": f"needs {least['racks']} racks ({least['gpu_racks']} GPU, {least['lpx_racks']} "
                f"LPX), more than --max-racks {max_racks}: bound by {_binding(least)}"}
    if target:
        fast = [p for p in within if p["tokens_per_s_per_user"] >= target]
        if not fast:
            best = max(within, key=lambda p: p["tokens_per_s_per_user"])
            return {"mode": mode, "error": f"no candidate reaches {target:g} tokens/s per user; the fastest gives "
                    f"{best['tokens_per_s_per_user']:.0f}"}
        return dict(max(fast, key=_efficiency))
    return dict(max(within, key=lambda p: (p["tokens_per_s_per_user"], _efficiency(p))))


def _binding(p) -> str:
    """The figure that sets a candidate's racks: the LPX chips its weights need, or the GPUs."""
    if p["lpx_racks"] >= p["gpu_racks"]:
        return f"the LPX SRAM its weights and caches need ({p['lpus']} LP30s)"
    return f"the GPUs it decodes and prefills on ({p['gpus']})"


def frontier(points: list) -> list:
    """The candidates no other beats on both tokens/s per user and tokens/s per MW (per rack where unknown)."""
    from .cost import pareto_front

    rows = [{"u": -p["tokens_per_s_per_user"], "e": -_efficiency(p)} for p in points]
    return [points[k] for k in pareto_front(rows, "e", "u")] if points else []


# ---- the modes ------------------------------------------------------------------------------------------
def _gpu_only(ctx) -> list:
    """Each width and batch AIConfigurator's memory model fits: its decode step, on as many replicas as the
    GPUs left by the prefills hold."""
    g, points = ctx.gpu, []
    pre = ctx.prefill()
    for tp in ctx.widths():
        for batch in GPU_BATCHES:
            if not gpus.fits(ctx.path, g, tp, ctx.quant, batch, ctx.context, ctx.moe):
                break
            tpot = gpus.decode_step(ctx.path, g, tp, ctx.quant, batch, ctx.context, ctx.moe)["tpot_ms"]
            # the prefills' GPUs come out of the decode replicas: the most replicas that leave room for theirs
            replicas = _most_groups(ctx, tp, lambda n: n * batch * 1e3 / tpot)
            rate = replicas * batch * 1e3 / tpot
            if replicas < 1:
                continue
            points.append(_point(ctx, "gpu-only", rate, 1e3 / tpot, replicas * tp, 0, pre["ms"], "GPU decode",
                                 {"tp": tp, "batch": batch, "replicas": replicas, "prefill_tp": pre["tp"],
                                  **_moe_split(ctx, tp)}))
    if not points:
        raise HeteroError(f"{ctx.spec.name} fits no {'/'.join(map(str, GPU_WIDTHS))}-wide group of {g.name} GPUs")
    return points


def _moe_split(ctx, tp: int) -> dict:
    """A mixture's expert split on ``tp`` GPUs (AIConfigurator's ``moe_tp_size`` and ``moe_ep_size``)."""
    if not ctx.moe:
        return {}
    moe_tp, moe_ep = ctx.quant.split(tp)
    return {"moe_tp": moe_tp, "moe_ep": moe_ep}


def _lpx_only(ctx) -> list:
    report = ctx.plan()
    points = []
    for row in report["frontier"]:
        chosen = (row["chips"], row["stages"], row["width"], row["batch"]) == (
            report["chips"], report["mapping"]["pipeline_stages"], report["mapping"]["tensor_parallel"], report["batch"])
        points.append(_point(ctx, "lpx-only", row["tokens_per_s"], row["tokens_per_s_per_user"], 0, row["chips"],
                             report["ttft_ms"] if chosen else row["ttft_ms"], report["bottleneck"] if chosen else "LPX",
                             {"stages": row["stages"], "tp": row["width"], "batch": row["batch"]}, prefill=False))
    return points


def kv_handoff_ms(ctx, tp: int) -> tuple:
    """``(bytes, ms)``: the prompt's KV cache from the ``tp`` prefill GPUs to LPX over the link, once a turn."""
    nbytes = kv_handoff_bytes(ctx.spec, ctx.prompt, ctx.dtype)
    rate = ctx.gpu.link.rate(tp, 1)
    return nbytes, ctx.gpu.link.latency_us / 1e3 + 1e3 * nbytes / rate


def _lpx_decode(ctx) -> list:
    report, pre = ctx.plan(), ctx.prefill()
    nbytes, handoff = kv_handoff_ms(ctx, pre["tp"])
    points = []
    for row in report["frontier"]:
        rate, bound = row["tokens_per_s"], "LPX decode"
        gpu_cap = ctx.gpu.gpus * ctx.output / pre["gpu_s"]  # output tokens/s the GPUs' prefills can feed
        link_cap = ctx.gpu.link.rate(ctx.gpu.gpus, ceil(row["chips"] / ctx.lpx_per_rack)) * ctx.output / nbytes
        if gpu_cap < rate or link_cap < rate:
            rate, bound = min(gpu_cap, link_cap), "GPU prefill" if gpu_cap <= link_cap else "link (KV handoff)"
        per_user = row["tokens_per_s_per_user"]
        p = _point(ctx, "lpx-decode", rate, per_user, 0, row["chips"], pre["ms"] + handoff, bound,
                   {"stages": row["stages"], "tp": row["width"], "batch": row["batch"], "prefill_tp": pre["tp"],
                    "kv_bytes": nbytes, "handoff_ms": handoff})
        points.append(p)
    return points


def _afd(ctx) -> list:
    """Attention on the GPUs (each width, batch and micro-batch count), every layer's FFN on LPX (each width the
    compiler can time), the exchange over the link."""
    from .model import _widths

    spec, g, lpx = ctx.spec, ctx.gpu, ctx.lpx
    clock, item = lpx.chip.clock_hz, DType.from_name(ctx.dtype).itemsize
    from aiconfigurator_core.sdk.backends.factory import get_backend

    ffn_bytes = sum(spec.mlp_params(i) for i in range(spec.layers)) * item
    if ffn_bytes > lpx.chips * lpx.chip.sram_bytes:  # (before any FFN is compiled)
        raise HeteroError(f"needs {ctx.racks_for(ffn_bytes)} LPX racks: the FFN's {ffn_bytes / 1e9:.1f} GB of "
                          f"{ctx.dtype} weights; {ctx.holds()}")
    pre = ctx.prefill()
    # the GPUs hold attention's weights and the caches: AIConfigurator's memory less the FFN's share of weights
    ffn_share = sum(spec.mlp_params(i) for i in range(spec.layers)) / spec.params()
    widths = [w for w in _widths(spec, lpx.chips, lpx) if w >= 8][-2:] or _widths(spec, lpx.chips, lpx)[-1:]
    # each kind of layer's FFN timed on its own: a model's dense first layers and its experts
    kinds = {spec.is_moe(layer): layer for layer in range(spec.layers)}
    lpx_side = []
    for width in widths:
        costs = {}
        for kind, layer in kinds.items():
            timed = {r: ffn_cost(spec, lpx, ctx.dtype, width, r, layer) for r in LPX_ROWS}
            costs[kind] = {r: c for r, c in timed.items() if c is not None}
        common = set.intersection(*(set(c) for c in costs.values()))  # rows every kind's program was timed at
        if not common:
            continue
        room = lpx.chip.sram_bytes - max(x["activation_bytes"] for c in costs.values() for x in c.values())
        stages = ffn_stages(spec, {kind: c[min(common)]["resident_bytes"] for kind, c in costs.items()}, room)
        if stages is None:
            continue
        replicas = lpx.chips // (len(stages) * width)
        if replicas >= 1:
            lpx_side.append((width, stages, replicas, costs))
    if not lpx_side:
        raise HeteroError(f"the FFN of {spec.name} does not fit {lpx.chips} LP30s of {lpx.name} at any width")
    points = []
    for tp in ctx.widths():
        for batch in GPU_BATCHES:
            used = gpus.engine(ctx.path, g, tp, ctx.quant, ctx.moe)
            mem = get_backend(gpus.BACKEND)._get_memory_usage(used[1], used[2], batch, 1, ctx.context, 2,
                                                              num_tokens=batch)
            if (mem["total"] - ffn_share * mem["weights"]) * 2**30 > g.memory_bytes:
                break
            for micro in (1, 2, 3, 4):
                if batch % micro:
                    continue
                step = gpus.decode_step(ctx.path, g, tp, ctx.quant, batch // micro, ctx.context, ctx.moe)
                t_a = step["attention_ms"] * 1e3 / spec.layers  # µs a layer a micro-batch
                for width, stages, replicas, costs in lpx_side:
                    # the prefills' GPUs come out of the attention groups: the most groups that leave room
                    for groups in range(g.gpus // tp, 0, -1):
                        point = _afd_point(ctx, tp, batch, micro, t_a, width, stages, replicas, costs, clock, item,
                                           groups, pre)
                        if point is None or groups * tp + _whole_gpus(point["prefill_gpus"]) <= g.gpus:
                            break
                    if point is not None:
                        points.append(point)
    return points


def _afd_point(ctx, tp, batch, micro, t_a, width, stages, replicas, costs, clock, item, instances, pre):
    """One AFD candidate: ``instances`` attention groups of ``tp`` GPUs at ``batch`` users each in ``micro``
    micro-batches, every layer's FFN on ``replicas`` copies of ``stages`` × ``width`` LP30s."""
    spec, g = ctx.spec, ctx.gpu
    if instances < 1:
        return None
    tokens = instances * batch // micro  # a micro-batch's tokens over every attention instance
    rows = ceil(tokens / replicas)  # at one FFN replica
    # a micro-batch above the compiled rows runs as passes of the r-row program (an upper bound); one program
    # rows for every layer, the fewest microseconds over the model's layers
    def layer_us(r):
        return [ceil(rows / r) * costs[spec.is_moe(layer)][r]["cycles"] * 1e6 / clock for layer in range(spec.layers)]

    program_rows = min(set.intersection(*(set(c) for c in costs.values())), key=lambda r: sum(layer_us(r)))
    t_f = layer_us(program_rows)
    chips = replicas * len(stages) * width
    lpx_racks = ceil(chips / ctx.lpx_per_rack)
    rate = g.link.rate(instances * tp, lpx_racks)
    t_out = exchange_us(tokens, spec.hidden, item, rate, g.link.latency_us)
    t_back = exchange_us(tokens, spec.hidden, return_itemsize(item), rate, g.link.latency_us)
    timing = pingpong(t_a, t_f, t_out + t_back, t_back - g.link.latency_us, micro, spec.layers, stages)
    tpot_ms = timing["token"] / 1e3
    rate_tokens = instances * batch * 1e3 / tpot_ms
    bound = timing["regime"] + ("" if timing["hidden"] else " (exchange not hidden)")
    config = {"tp": tp, **_moe_split(ctx, tp), "batch": batch, "micro_batches": micro,
              "attention_instances": instances,
              "ffn_width": width, "ffn_stages": len(stages), "ffn_stage_layers": stages, "ffn_replicas": replicas,
              "ffn_program_rows": program_rows,
              "ratio": f"{instances * tp} GPUs : {chips} LP30s "
                       f"({instances / replicas:g} attention groups of {tp} a FFN replica)",
              "t_attention_us": t_a, "t_ffn_us": {("experts" if moe else "dense"): t_f[layer]
                                                   for moe, layer in {spec.is_moe(i): i for i in range(spec.layers)}.items()},
              "t_exchange_us": {"out": t_out, "back": t_back}, "bounds_ms":
              {k: v / 1e3 for k, v in timing["bounds"].items()}}
    return _point(ctx, "afd", rate_tokens, 1e3 / tpot_ms, instances * tp, chips, pre["ms"],
                  bound, config)


def _verify(ctx, chosen: dict) -> dict:
    """A mode's LPX half compiled whole: the decode's stages (``plan --verify`` at the chosen mapping), or AFD's
    FFN stage (:func:`.afd.verify_ffn_stage`); ``error`` where it cannot be."""
    from .search import plan

    c = chosen["config"]
    if chosen["mode"] == "afd":
        return verify_ffn_stage(ctx.spec, ctx.lpx, ctx.dtype, c["ffn_width"], max(c["ffn_stage_layers"]),
                                c["ffn_program_rows"])
    try:
        report = plan(ctx.model, target=ctx.target, context=ctx.context, prompt=ctx.prompt,
                      batch=c["batch"], mapping=(c["stages"], c["tp"]), verify=True, progress=ctx.progress)
    except LpxUserError as err:
        return {"error": str(err).splitlines()[0]}
    planned = report["verified_cycles"] * (1 + report["verify_error"])
    return {"planned_cycles": round(planned), "verified_cycles": report["verified_cycles"],
            "verify_error": report["verify_error"], "stages": report["verify_stages"]}


def lpx_system(system):
    """The LPX side of a plan beside GPUs (a name or a system), refused where it is not made of LP30s: the modes
    are NVIDIA's LPX deployments."""
    from ...codegen.target import system_of

    lpx = system_of(system)
    if lpx.chip.name != "lp30":
        raise HeteroError(f"plan --gpu plans LPX (LP30 chips) beside GPUs; {lpx.name} is made of {lpx.chip.name} "
                          "chips (lpx-node, lpx-rack or lpx-system-N)")
    return lpx


def default_draft(spec) -> str:
    """lpx-draft's draft for a target: its own in :data:`DRAFTS`, else a draft of :data:`VOCABULARY_DRAFTS` of
    its vocabulary; a :class:`HeteroError` naming why where there is none."""
    from .model import model_spec

    if spec.name in DRAFTS:
        return DRAFTS[spec.name]
    if spec.name in NO_DRAFT:
        raise HeteroError(f"no draft for {spec.name}: {NO_DRAFT[spec.name]}")
    for name in VOCABULARY_DRAFTS:
        if model_spec(name).vocab == spec.vocab:
            return name
    raise HeteroError(f"lpx-draft needs --draft MODEL (a draft of the target's vocabulary, {spec.vocab:,} tokens; "
                      f"the presets draft {', '.join(sorted(DRAFTS))})")


def _lpx_draft(ctx, draft, accept_rate: float) -> list:
    """The draft on LPX at its own plan's figures, the verify step on the GPUs, each (width, batch, k). A draft
    that reads the target's hidden state (a multi-token-prediction module) takes the verified positions' states
    over the link each round (in bf16, as the FFN's output returns in AFD)."""
    from .search import plan, model_spec
    from .speculative import check_draft, expected_tokens

    draft = default_draft(ctx.spec) if draft is None else draft
    draft_spec = model_spec(draft)
    check_draft(ctx.spec, draft_spec)
    if not 0 <= accept_rate <= 1:
        raise HeteroError(f"the acceptance rate must be in [0, 1], got {accept_rate}")
    drafted = plan(draft, target=ctx.target, context=ctx.context, prompt=ctx.prompt, batches=(1, 4),
                   progress=ctx.progress)
    g, pre, points = ctx.gpu, ctx.prefill(), []
    state_bytes = ctx.spec.hidden * return_itemsize(DType.from_name(ctx.dtype).itemsize) if draft_spec.fusion else 0
    for row in drafted["frontier"]:
        draft_us = 1e6 / row["tokens_per_s_per_user"]  # a draft step, each user's
        for tp in ctx.widths():
            for batch in GPU_BATCHES:
                if not gpus.fits(ctx.path, g, tp, ctx.quant, batch, ctx.context, ctx.moe):
                    break
                for k in DRAFT_TOKENS:
                    verify = gpus.verify_ms(ctx.path, g, tp, ctx.quant, batch, k + 1, ctx.context, ctx.moe)
                    # k draft steps on LPX, the draft tokens to the GPUs and the verdict back (ids: latency), with
                    # the k + 1 verified positions' hidden states where the draft reads them (the group's share of
                    # the link, to the racks the draft's copy is on)
                    states = exchange_us(batch * (k + 1), 1, state_bytes, g.link.rate(tp, ceil(
                        row["chips"] / ctx.lpx_per_rack)), 0.0) / 1e3 if state_bytes else 0.0
                    round_ms = k * draft_us / 1e3 + verify + 2 * g.link.latency_us / 1e3 + states
                    per_user = 1e3 * expected_tokens(k, accept_rate) / round_ms
                    # the prefills' GPUs come out of the verify groups
                    instances = _most_groups(ctx, tp, lambda n: per_user * n * batch)
                    users = instances * batch
                    copies = ceil(users / row["users"])  # draft replicas to serve them
                    if instances < 1 or copies * row["chips"] > ctx.lpx.chips:
                        continue
                    points.append(_point(ctx, "lpx-draft", per_user * users, per_user, instances * tp,
                                         copies * row["chips"], pre["ms"],
                                         "GPU verify" if verify > k * draft_us / 1e3 else "LPX draft",
                                         {"tp": tp, "batch": batch, "draft": drafted["model"], "draft_tokens": k,
                                          "accept_rate": accept_rate, "draft_chips": copies * row["chips"],
                                          "draft_copy_chips": row["chips"], "verify_ms": verify,
                                          "draft_step_us": draft_us, "hidden_states_ms": states}))
    if not points:
        raise HeteroError(f"no verify width and batch fits the {g.gpus} {g.name} GPUs with the draft on "
                          f"{ctx.lpx.chips} LP30s")
    return points


# ---- the report ---------------------------------------------------------------------------------------
def _fmt(value, spec=".0f", none="-"):
    return none if value is None else format(value, spec)


def table(report: dict):
    """The heterogeneous plan's :class:`~lpx_tvm.app.output.Report`: the pair, the link, then a row a mode and
    what binds it."""
    from ..output import Report, Table

    g, link = report["gpu"], report["link"]
    watts = report["lpx_chip_watts"]
    head = (f"{report['model']} ({report['dtype']}) on {report['system']} beside {g['gpus']} {g['name']} GPUs "
            f"({g['racks']} rack(s); {g['label']}; {g['watts']:.0f} W a GPU from its system file); "
            f"{report['context']}-position context, {report['prompt']}-token prompt a turn\n"
            f"  GPU–LPX link: {link['GBps_per_gpu']:g} GB/s a GPU each way (at most {link['GBps_per_lpx_rack']:g} a "
            f"LPX rack), {link['latency_us']:g} µs"
            + (" — ASSUMED (Spectrum-X Ethernet, no official figure; --gpu-link to change): " + link["why"]
               if link["assumed"] else " (--gpu-link)") + "\n"
            + _quant_line(report)
            + ("  SOL: AIConfigurator's speed of light prices no collective between GPUs (it has no communication "
               "tables for this system): the GPU figures are a bound no rack reaches, not comparable with measured "
               "ones\n" if g.get("mode") == "SOL" else "")
            + ("  tokens/s per MW: unknown for modes using LPX (LP30 has no public power figure; give "
               "--lpx-chip-watts)\n" if watts is None else f"  LP30 power: {watts:g} W a chip (--lpx-chip-watts)\n"))
    rows, notes = [], []
    for name, r in report["modes"].items():
        if "error" in r:
            notes.append(f"  {name}: {r['error']}")
            continue
        rows.append([name, _config(r), _fmt(r["tokens_per_s_per_user"]), _fmt(r["tpot_ms"], ".2f"),
                     _fmt(r["ttft_ms"], ".1f"), _fmt(r["tokens_per_s"]), _fmt(r["tokens_per_s_per_gpu"], ".1f"),
                     _fmt(r["tokens_per_s_per_lpu"], ".1f"), f"{r['gpu_racks']}+{r['lpx_racks']}",
                     _fmt(r["tokens_per_s_per_rack"]), _fmt(r["tokens_per_s_per_mw"], ",.0f", "unknown"),
                     _fmt(r.get("vs_gpu_only"), ".2f"), r["bound"]])
    headers = ["mode", "configuration", "tok/s/user", "TPOT ms", "TTFT ms", "tok/s", "per GPU", "per LPU",
               "racks GPU+LPX", "per rack", "tok/s per MW", "× gpu-only", "bound"]
    for name, r in report["modes"].items():
        v = r.get("verify")
        if v is None:
            continue
        what = (f"a stage's {v['layers']} FFN layers at {v['rows']} row{'s' if v['rows'] > 1 else ''}"
                if name == "afd"
                else "every stage of the decode")
        notes.append(f"  verify {name}: {what} compiled whole: " + (v["error"] if "error" in v else
                     f"{v['verified_cycles']:,} cycles against the plan's {v['planned_cycles']:,} "
                     f"(the plan's error {100 * v['verify_error']:+.1f}%)"))
    notes.append(f"  {len(report['frontier'])} candidates on the frontier of {len(report['candidates'])}; "
                 f"planned in {report['plan_s']:.1f} s")
    return Report(f"{report['model']} beside {g['gpus']} {g['name']} GPUs: every mode",
                  [Table(headers, rows, name="modes", above=head.rstrip("\n"), below="\n".join(notes))], report)


def _quant_line(report: dict) -> str:
    """The GPU side's quantisation, every mode that is not ``--dtype``'s named with why."""
    q = report["gpu"].get("quant")
    if not q:
        return ""
    if "error" in q:
        return f"  GPU quantisation: {q['error']}\n"
    return f"  GPU side in AIConfigurator's modes: {q['text']}\n"


def _ep(c: dict) -> str:
    """`` EP8`` (or `` EP4·TP2``): a mixture's experts on the GPUs."""
    if "moe_ep" not in c or c["moe_ep"] * c["moe_tp"] == 1:
        return ""
    return f" EP{c['moe_ep']}" + (f"·TP{c['moe_tp']}" if c["moe_tp"] > 1 else "")


def _config(r: dict) -> str:
    c = r["config"]
    if r["mode"] == "gpu-only":
        return f"TP{c['tp']}{_ep(c)} × {c['replicas']}, batch {c['batch']}"
    if r["mode"] in ("lpx-only", "lpx-decode"):
        return f"{c['stages']}×{c['tp']} LP30s, batch {c['batch']}" + (
            f"; KV {c['kv_bytes'] / 1e6:.0f} MB in {c['handoff_ms']:.2f} ms" if "kv_bytes" in c else "")
    if r["mode"] == "afd":
        return (f"attn TP{c['tp']}{_ep(c)} × {c['attention_instances']}, batch {c['batch']} in {c['micro_batches']}; "
                f"FFN {c['ffn_stages']}×{c['ffn_width']} × {c['ffn_replicas']}")
    return f"verify TP{c['tp']}, batch {c['batch']}; {c['draft']} k={c['draft_tokens']} on {c['draft_chips']} LP30s"


def plot(report: dict, path) -> str:
    """Tokens/s per MW (per rack where power is unknown) against tokens/s per user, every mode's candidates and
    the frontier: the shape of NVIDIA's LPX Pareto chart. Needs matplotlib (``lpx-tvm[plot]``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise HeteroError("--plot needs matplotlib: pip install 'lpx-tvm[plot]'") from None
    per_mw = all(p["tokens_per_s_per_mw"] is not None for p in report["candidates"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode in MODES:
        pts = [p for p in report["candidates"] if p["mode"] == mode]
        if pts:
            ax.scatter([p["tokens_per_s_per_user"] for p in pts], [_efficiency(p) for p in pts], s=10, label=mode)
    front = sorted(report["frontier"], key=lambda p: p["tokens_per_s_per_user"])
    ax.plot([p["tokens_per_s_per_user"] for p in front], [_efficiency(p) for p in front], "k-", lw=1, label="frontier")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tokens/s per user")
    ax.set_ylabel("tokens/s per MW" if per_mw else "tokens/s per rack (power unknown)")
    ax.set_title(f"{report['model']}: {report['system']} beside {report['gpu']['gpus']} {report['gpu']['name']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)
