"""``lpx-tvm plan``: how many chips and racks an LLM needs for a decode speed, and what bounds it.

:mod:`.plan_model` prices one mapping (S pipeline stages × T tensor-parallel chips) from the compiler's own
numbers; this module searches the mappings a system allows for the one asked for (the lowest latency, or the
fewest chips reaching a target), measures its first token, and reports it beside the floor the preset's
figures set (:func:`~.plan_model.floor_cycles`) and the frontier. ``--verify`` (:mod:`.verify`), speculative
decoding (:mod:`.speculative`) and a prefill pool (:mod:`.prefill_pool`) build on the same model.
"""

from __future__ import annotations

import time
from math import ceil, inf
from numbers import Real

from ...runtime_sim import DType
from ...codegen.target import Target, system_of
from ...codegen.parallel.collectives import CollectiveError
from ..output import Report, Table
from .model import Mapping, _check_sizes, _group_system, _widths, evaluate, floor_cycles, plan_target
# the plan command's own vocabulary, for its callers (the CLI's preset list, the sweep's model check)
from .model import PRESETS, PlanError, model_spec  # noqa: F401


def plan(model, system="tsp-rack", dtype: str = "fp16", context: int = 4096, prompt: int = 512, batch: int = 1,
         chips: int | None = None, target_tps_per_user: float | None = None, batches=(1,),
         mapping: tuple | None = None, progress=None, users: int | None = None,
         target_ttft_ms: float | None = None, draft=None, draft_tokens: int | None = None,
         accept_rate: float | None = None, prefill_chips: int | None = None, verify: bool = False,
         target: Target | None = None) -> dict:
    """Plan an LLM's decode on a system: the mapping, its speed, its chips and racks, and what bounds it.

    Parameters
    ----------
    model : str, Path, dict or ModelSpec
        A preset (``llama-2-70b``, ``llama-3-8b``, ``mixtral-8x7b``, ... or a :mod:`.llama` decoder) or a
        Hugging Face ``config.json``.
    system : str
        ``tsp-node``, ``tsp-rack``, ``tsp-system-N``, ``lpx-rack`` or a system file: its chip and size.
    dtype : str
        Storage type of weights, cache and activations on the chips (the chip must run it).
    context, prompt, batch : int
        KV-cache positions per sequence, prompt tokens (time to first token), sequences decoded together.
    chips : int, optional
        Use at most this many chips (default: the system's).
    target_tps_per_user : float, optional
        Find the fewest chips whose best mapping reaches this many tokens/s per user.
    progress : callable, optional
        Called with a line of text as each tensor-parallel width is measured (the command prints them:
        a plan takes a minute or more).
    batches : sequence of int
        Batch sizes to put on the frontier (besides ``batch``).
    mapping : (int, int), optional
        Evaluate only this (pipeline stages, tensor-parallel width).
    users : int, optional
        Serve this many users at once: the fewest chips whose mapping holds that many in flight (stages ×
        batch, every one's KV cache on the chips), at any batch on the frontier, and at ``target_tps_per_user``
        where that is given too.
    target_ttft_ms : float, optional
        The time to first token (the prompt's prefill through every stage) must be at most this: of the
        mappings the other targets leave, the cheapest that meets it.
    draft, draft_tokens, accept_rate : optional
        Speculative decoding (:mod:`.speculative`): a draft model (as ``model``) planned on the chips the
        target leaves, proposing ``draft_tokens`` (default: the best k) that the target accepts each with
        probability ``accept_rate`` (default 0.7), verified in one step of k + 1 rows.
    prefill_chips : int, optional
        A separate prefill pool of this many chips (:mod:`.prefill_pool`): the decode mapping takes the
        others, and the time to first token is the pool's prefill and the KV cache's handoff.
    verify : bool
        Compile and time every stage of the chosen mapping whole (:mod:`.verify`): the report gains
        ``verified_cycles``, ``verify_error`` (a fraction: the plan's cycles ÷ the verified − 1) and
        ``verify_stages``.
    target : Target, optional
        The system and dtype parsed already (a door's :class:`~lpx_tvm.codegen.Target`), instead of ``system``
        and ``dtype``.
    """
    start = time.perf_counter()
    _check_sizes(context=context, prompt=prompt, batch=batch, chips=chips, batches=batches, mapping=mapping,
                 users=users, prefill_chips=prefill_chips)
    if target_tps_per_user is not None and not (isinstance(target_tps_per_user, Real)
                                                and 0 < target_tps_per_user < inf):
        raise PlanError(f"the target tokens/s per user must be a positive number, got {target_tps_per_user!r}")
    if target_ttft_ms is not None and not (isinstance(target_ttft_ms, Real) and 0 < target_ttft_ms < inf):
        raise PlanError(f"the target time to first token must be a positive number of ms, got {target_ttft_ms!r}")
    if accept_rate is not None and not (isinstance(accept_rate, Real) and 0 <= accept_rate <= 1):
        raise PlanError(f"the acceptance rate must be a probability in [0, 1], got {accept_rate!r}")
    if prompt > context:
        raise PlanError(f"a prompt of {prompt} tokens does not fit a cache of {context} positions")
    if target is not None and (system, dtype) != ("tsp-rack", "fp16"):
        raise PlanError("target= says what to plan for; system= and dtype= would say it again")
    where = plan_target(system, dtype, target)
    system, dtype = where.system, where.dtype
    spec = model_spec(model)
    if draft is not None:  # (refused before the target's search, which takes a while)
        from .speculative import check_draft

        check_draft(spec, model_spec(draft))
    # --verify compiles a stage as one kind of block repeated (no MTP module's fusion before it), and its int8
    # check builds the project's decoder
    if verify and (len(set(spec.kinds())) > 1 or spec.fusion or (dtype == "int8" and (
            spec.mla or spec.sliding or spec.qk_norm or spec.sandwich))):
        raise PlanError(f"--verify compiles a stage as one kind of Llama-style block repeated: {spec.name}'s layers "
                        "differ (dense and expert MLPs, or sliding and full attention), come after a "
                        "multi-token-prediction module's fusion, or are not the project's decoder's; its plan prices "
                        "each kind's block compiled on its own")
    chip = system.chip
    limit = min(chips or system.chips, system.chips)
    if prefill_chips is not None:
        if prefill_chips >= limit:
            raise PlanError(f"a prefill pool of {prefill_chips} chips leaves none of the {limit} for decoding")
        limit -= prefill_chips
    weights = spec.chip_params() * DType.from_name(dtype).itemsize
    cache = spec.cache_bytes(context, batch, dtype)
    capacity = system.chips * chip.sram_bytes
    if weights + cache > capacity:
        raise PlanError(f"{spec.name} needs {weights + cache:,} bytes ({weights:,} of {dtype} weights, {cache:,} of "
                        f"KV cache for {context} positions × {batch}) but {system.name} holds {capacity:,} "
                        f"({system.chips} chips × {chip.sram_bytes:,})")
    candidates = []
    if mapping is not None:
        if mapping[1] > 1 and _group_system(system):
            from ...codegen.parallel.collectives import choose

            try:
                choose(system_of(_group_system(system)), mapping[1])
            except CollectiveError as err:
                raise PlanError(f"{mapping[1]}-way tensor parallel: {err}") from None
        found = evaluate(spec, system, dtype, mapping[0], mapping[1], batch, context, prompt)
        if found is None:
            raise PlanError(f"{spec.name}: {mapping[0]} stages × {mapping[1]} chips does not fit {system.chip.name}")
        report = _report(spec, system, dtype, context, prompt, found, [found], "the mapping asked for", weights,
                         time.perf_counter() - start)
        return _verified(report, spec, system, dtype, found, context, progress, start) if verify else report
    searched = [(b, width) for b in sorted({batch, *batches}) for width in _widths(spec, limit, system)]
    for done, (b, width) in enumerate(searched):
        if progress is not None:
            elapsed = time.perf_counter() - start
            # (a rough guide: at the pace so far; wider shards compile smaller blocks, and blocks are cached)
            left = f", about {elapsed / done * (len(searched) - done):.0f} s left" if done else ""
            progress(f"plan: {spec.name} at batch {b}, {width}-way tensor parallel ({done + 1} of {len(searched)}; "
                     f"{len(candidates)} mappings so far, {elapsed:.0f} s{left})")
        least = max(1, ceil((weights + spec.cache_bytes(context, b, dtype)) / (chip.sram_bytes * width)))
        for stages in sorted({s for s in range(least, min(spec.layers, limit // width) + 1)
                              if s in (least, least + 1) or s & (s - 1) == 0 or spec.layers % s == 0}):
            mapping = evaluate(spec, system, dtype, stages, width, b, context, prompt, ttft=False)
            if mapping is not None:
                candidates.append(mapping)
    at_batch = [m for m in candidates if m.batch == batch]
    if users is not None:
        at_batch = [m for m in candidates if m.users >= users]
        if not at_batch:
            most = max(candidates, key=lambda m: m.users, default=None)
            raise PlanError(f"no mapping on {limit} chips holds {users} users in flight with a {context}-position "
                            "cache" + (f"; the most is {most.users} ({most.stages} stages × batch {most.batch} on "
                                       f"{most.chips} chips)" if most else ""))
    if not at_batch:
        raise PlanError(f"{spec.name} in {dtype} with a {context}-position cache does not fit {limit} chips of "
                        f"{system.name}: every shard streams weights or overflows SRAM")
    pool, why = at_batch, f"the lowest per-token latency on at most {limit} chips"
    if target_tps_per_user:
        pool = [m for m in at_batch if m.tokens_per_s_per_user(chip.clock_hz) >= target_tps_per_user]
        if not pool:
            best = max(at_batch, key=lambda m: m.tokens_per_s_per_user(chip.clock_hz))
            raise PlanError(f"no mapping on {limit} chips reaches {target_tps_per_user} tokens/s per user; the "
                            f"fastest gives {best.tokens_per_s_per_user(chip.clock_hz):.0f} on {best.chips} chips")
        why = f"the fewest chips reaching {target_tps_per_user} tokens/s per user" + (
            f" with {users} users in flight" if users else "")
    elif users is not None:
        why = f"the fewest chips holding {users} users in flight"
    elif target_ttft_ms:
        why = "the fewest chips"
    if target_tps_per_user or users is not None or target_ttft_ms:  # a target: the cheapest that meets it
        key = lambda m: (m.chips, m.per_token_cycles)  # noqa: E731
    else:
        key = lambda m: (m.per_token_cycles, m.chips)  # noqa: E731
    pooled = None
    if prefill_chips:  # the first token is the pool's
        from .prefill_pool import prefill_pool

        chosen = min(pool, key=key)
        if progress is not None:
            progress(f"plan: the prefill pool of {prefill_chips} chips")
        pooled = prefill_pool(spec, system, dtype, prefill_chips, chosen, context, prompt)
        if target_ttft_ms and pooled["ttft_ms"] > target_ttft_ms:
            raise PlanError(f"a prefill pool of {prefill_chips} chips gives the first token in {pooled['ttft_ms']:.3g} "
                            f"ms, not within {target_ttft_ms} ms")
    else:
        chosen = _with_first_token(spec, system, dtype, context, prompt, sorted(pool, key=key), candidates,
                                   target_ttft_ms, limit, progress, start)
    if target_ttft_ms:
        why += f", with a first token within {target_ttft_ms} ms"
    report = _report(spec, system, dtype, context, prompt, chosen, candidates, why, weights,
                     time.perf_counter() - start, pooled)
    if verify:
        report = _verified(report, spec, system, dtype, chosen, context, progress, start)
    if draft is not None:
        from .speculative import speculate

        left = limit - chosen.chips
        if left < 1:
            raise PlanError(f"the target takes all {limit} chips: none is left for the draft model (give --chips "
                            "for the target, or a larger system)")
        if progress is not None:
            progress(f"plan: the draft model on the {left} chips left")
        drafted = plan(draft, system, dtype, context=context, prompt=prompt, chips=left, batches=(1,))
        report["speculative"] = speculate(spec, system, dtype, chosen, drafted,
                                          0.7 if accept_rate is None else accept_rate, context, prompt, draft_tokens)
        report["plan_s"] = time.perf_counter() - start
    return report


def _verified(report, spec, system, dtype, chosen, context, progress, start) -> dict:
    """``report`` with the chosen mapping's stages compiled and timed whole (:func:`.verify.verify`)."""
    from .verify import int8_as_compiled, verify

    checked = verify(spec, system, dtype, chosen, context, progress)
    report.update(verified_cycles=checked["verified_cycles"], verify_error=checked["verify_error"],
                  verify_stages=checked["stages"])
    if dtype == "int8" and chosen.batch == 1:
        measured = int8_as_compiled(spec, system, chosen, context, progress)
        if measured:
            measured["per_token_us"] = 1e6 * measured["per_token_cycles"] / system.chip.clock_hz
        report["int8_as_compiled"] = measured
    report["plan_s"] = time.perf_counter() - start
    return report


def _with_first_token(spec, system, dtype, context, prompt, ordered: list, candidates: list, target_ttft_ms,
                      limit: int, progress, start: float) -> Mapping:
    """The first of ``ordered`` with its time to first token measured (a prefill block is the largest to
    compile, so only the mapping chosen is); under a target, each in turn until one meets it, else an error
    naming the quickest. ``candidates`` takes the measured mappings in place of the unmeasured."""
    clock = system.chip.clock_hz
    for mapping in ordered if target_ttft_ms else ordered[:1]:
        if progress is not None and target_ttft_ms:
            progress(f"plan: the time to first token of {mapping.stages} stages × {mapping.width} chips "
                     f"({time.perf_counter() - start:.0f} s)")
        with_ttft = evaluate(spec, system, dtype, mapping.stages, mapping.width, mapping.batch, context, prompt)
        candidates[candidates.index(mapping)] = with_ttft
        if not target_ttft_ms or (with_ttft.ttft_cycles is not None
                                  and 1e3 * with_ttft.ttft_cycles / clock <= target_ttft_ms):
            return with_ttft
    timed = [m for m in candidates if m.ttft_cycles is not None]
    best = min(timed, key=lambda m: m.ttft_cycles, default=None)
    raise PlanError(f"no mapping on {limit} chips gives a first token within {target_ttft_ms} ms for a "
                    f"{prompt}-token prompt" + (f"; the quickest is {1e3 * best.ttft_cycles / clock:.3g} ms, on "
                                               f"{best.chips} chip{'s' if best.chips > 1 else ''}" if best else ""))


def _report(spec, system, dtype, context, prompt, chosen, candidates, why, weights, seconds,
            pooled: dict | None = None) -> dict:
    clock = system.chip.clock_hz
    per_rack = _chips_per_rack(system)
    split = {k: round(v) for k, v in chosen.split.items()}
    bottleneck = max(split, key=split.get)

    def row(m):
        tps = m.tokens_per_s_per_user(clock)
        return {"stages": m.stages, "width": m.width, "chips": m.chips, "batch": m.batch, "users": m.users,
                "per_token_us": 1e6 * m.per_token_cycles / clock, "period_us": 1e6 * m.period_cycles / clock,
                "tokens_per_s_per_user": tps,
                "tokens_per_s": tps * m.users, "tokens_per_s_per_chip": tps * m.users / m.chips,
                "period_cycles": m.period_cycles,
                "ttft_ms": None if m.ttft_cycles is None else 1e3 * m.ttft_cycles / clock,
                "memory_per_chip": m.memory_per_chip}
    frontier = sorted((row(m) for m in candidates), key=lambda r: (r["chips"], r["batch"]))
    best = row(chosen)
    floor = floor_cycles(spec, system, dtype, context, system.chips, chosen.batch)
    floors = {} if floor is None else {
        "floor_us": 1e6 * floor["cycles"] / clock, "floor_ratio": chosen.per_token_cycles / floor["cycles"],
        "floor": {"width": floor["width"], "stages": floor["stages"],
                  "parts_us": {k: 1e6 * v / clock for k, v in floor["parts"].items()}}}
    chips = chosen.chips
    if pooled is not None:  # a prefill pool: its chips count, and the first token is its
        chips += pooled["chips"]
        best.update(chips=chips, ttft_ms=pooled["ttft_ms"], tokens_per_s_per_chip=best["tokens_per_s"] / chips)
    return {"model": spec.name, "system": system.name, "chip": system.chip.name, "dtype": dtype, "context": context,
            "prompt": prompt, "params": spec.params(), "weight_bytes": weights,
            "cache_bytes": spec.cache_bytes(context, chosen.users, dtype, chosen.width),
            "chips": chips, "racks": ceil(chips / per_rack),
            "mapping": {"pipeline_stages": chosen.stages, "tensor_parallel": chosen.width,
                        "layers_per_stage": ceil(spec.layers / chosen.stages), "experts": chosen.expert_placement,
                        "why": why},
            **best, "tokens_per_s_per_rack": best["tokens_per_s"] / max(ceil(chips / per_rack), 1),
            **_power(system.chip, chips, best["tokens_per_s"]),
            "split_cycles": split, "bottleneck": bottleneck, **floors, "frontier": frontier, "plan_s": seconds,
            "not_static": NOT_STATIC, "notes": _notes(spec),
            **({"prefill_pool": pooled, "decode_chips": chosen.chips} if pooled is not None else {})}


def _notes(spec) -> list:
    """What the model's config says that the plan reads and does not price, and what it assumes of routing."""
    routing = ([f"a token's {spec.experts_per_token} experts are taken to fall on different chips (balanced "
                "routing); a token whose experts share a chip runs them one after another, which the static "
                "schedule would have to allow for"] if spec.experts else [])
    return list(spec.notes) + routing


# the schedule on the chips is static, so a token's time is the same every time (p50 = p99); these are not
NOT_STATIC = ["host-side sampling of each token", "the host link's transfers outside the chips' schedule"]


def _chips_per_rack(system) -> int:
    return {"tsp-rack": 72, "lpx-rack": 256}.get(system.name, 72 if system.chip.name == "tsp" else 256)


def _power(chip, chips: int, tokens_per_s: float) -> dict:
    """The chips' power at load (the preset's TDP; no host, network or cooling) and tokens/s per kW: None
    where the preset gives no power."""
    if chip.power_watts is None:
        return {"power_kw": None, "tokens_per_s_per_kw": None}
    kw = chips * chip.power_watts / 1000
    return {"power_kw": kw, "tokens_per_s_per_kw": tokens_per_s / kw}


def table(report: dict) -> Report:
    """The plan's :class:`~lpx_tvm.app.output.Report`: the chosen mapping and its split, then the frontier."""
    m = report["mapping"]
    total = sum(report["split_cycles"].values())
    split = ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in report["split_cycles"].items() if v)
    head = (f"{report['model']} ({report['params'] / 1e9:.1f} B parameters, {report['dtype']}) on {report['system']}"
            f" ({report['chip']} chips), {report['context']}-position cache, batch {report['batch']} a stage, "
            f"{report['users']} user{'s' if report['users'] != 1 else ''} in flight:\n"
            f"  {report['chips']} chips ({report['racks']} rack(s)): {m['pipeline_stages']} pipeline stages × "
            f"{m['tensor_parallel']}-way tensor parallel, {m['layers_per_stage']} layers a stage"
            + (f"; {m['experts']}" if m["experts"] else "") + f" ({m['why']})\n"
            f"  {report['per_token_us']:.1f} µs a token"
            + (f" = {report['tokens_per_s_per_user']:.0f} tokens/s per user; "
               if report["tokens_per_s_per_user"] * report["per_token_us"] > 1e6 * (1 - 1e-9) else
               f"; the {report['users']} users' steps at the busiest stage's pace, one every "
               f"{report['period_us']:.1f} µs: {report['tokens_per_s_per_user']:.0f} tokens/s per user; ")
            + f"{report['tokens_per_s_per_chip']:.1f} tokens/s per chip, {report['tokens_per_s_per_rack']:.0f} per rack"
            + (f"; time to first token ({report['prompt']} prompt tokens) {report['ttft_ms']:.2f} ms"
               if report["ttft_ms"] is not None else
               f"; no time to first token: a block's {report['prompt']}-token prefill does not fit a chip") + "\n"
            f"  per token: {split}; bound by {report['bottleneck']}\n"
            + (f"  floor: {report['floor_us']:.1f} µs a token from the preset's figures alone (weights through the "
               f"planes, KV at the SRAM rate, collectives' hops and bytes; {report['floor']['stages']} stages × "
               f"{report['floor']['width']} wide); the plan is {report['floor_ratio']:.2f}× it\n"
               if report.get("floor_us") else "")
            + (f"  power: {report['power_kw']:.1f} kW for the chips at their TDP (no host, network or cooling), "
               f"{report['tokens_per_s_per_kw']:.1f} tokens/s per kW\n" if report.get("power_kw") is not None else
               f"  power: the {report['chip']} preset gives no chip power\n") +
            f"  latency: the chips' schedule is static (p50 = p99); not in it: {'; '.join(report['not_static'])}\n"
            + "".join(f"  not priced: {note}\n" for note in report.get("notes", [])) +
            f"  memory a chip: {report['memory_per_chip'] / 2**20:.0f} MiB (weights {report['weight_bytes'] / 1e9:.1f} GB"
            f" and KV cache {report['cache_bytes'] / 1e9:.2f} GB on the chips in all; the token embedding is looked "
            f"up on the host); planned in {report['plan_s']:.1f} s")
    if "verify_error" in report:
        stages = ", ".join(f"{v['stages']} of {v['blocks']} block{'s' if v['blocks'] > 1 else ''}: {v['cycles']:,} "
                           f"cycles (planned {v['planned']:,})" for v in report["verify_stages"])
        head += (f"\n  verified: every stage compiled and timed whole ({stages}): {report['verified_cycles']:,} "
                 f"cycles a token; the plan's error {100 * report['verify_error']:+.1f}%")
    measured = report.get("int8_as_compiled")
    if measured:
        us = measured["per_token_us"]
        head += (f"\n  int8 as compiled: a block of this shard through the QDQ flow (quantised by ONNX Runtime, "
                 f"compiled as int8 kernels) takes {measured['block_cycles']:,} cycles against the "
                 f"{measured['planned_block_cycles']:,} planned ({measured['block_cycles'] / measured['planned_block_cycles']:.2f}×): "
                 f"{us:.1f} µs a token, {1e6 / us:.0f} tokens/s per user")
    if "prefill_pool" in report:
        from .prefill_pool import describe as describe_pool

        head += "\n" + describe_pool(report["prefill_pool"])
    if "speculative" in report:
        from .speculative import describe

        head += "\n" + describe(report["speculative"])
    rows = [[r["chips"], f"{r['stages']}×{r['width']}", r["batch"], r["users"], f"{r['per_token_us']:.1f}",
             f"{r['tokens_per_s_per_user']:.0f}", f"{r['tokens_per_s_per_chip']:.2f}"] for r in report["frontier"]]
    headers = ["chips", "stages×TP", "batch", "users", "µs a token", "tokens/s per user", "tokens/s per chip"]
    return Report(f"{report['model']} on {report['system']}: the plan", [head, Table(headers, rows, name="frontier")],
                  report)


def frontier(rows: list) -> list:
    """The rows no other beats on both tokens/s per user and tokens/s per chip."""
    from .cost import pareto_front

    negated = [{"u": -r["tokens_per_s_per_user"], "c": -r["tokens_per_s_per_chip"]} for r in rows]
    return [rows[k] for k in pareto_front(negated, "c", "u")]
