"""``generate --users N``: N sequences through a pipeline at once, each checked against ONNX Runtime.

Values: each user has a prompt of its own (seeded), a KV cache of its own and a reference of its own. The
chips hold one set of caches in the simulation; before a user's step its caches are put in place and after
it they are kept (on the machine each user's caches sit at addresses of their own: the plan counts them).

Time: a decode step is one static schedule of every chip, the chips aligned by the links' transfers. In a
pipeline each user's step is that schedule shifted in time, and the next user's may start as soon as no
chip would hold two steps at once: each chip's step, repeated ``period`` cycles later on the same addresses, must
keep every rule of the machine, checked by the simulator as for any program (its units, rates, links'
ports, and no SRAM hazard between one user's step and the next's: the compiled schedule reuses its
buffers). The steady state issues a step every ``period`` cycles; a user's own steps follow each other no
faster than one step's whole schedule, so ``N`` users issue ``min(N / step, 1 / period)`` tokens a cycle.
"""

from __future__ import annotations

import time
from math import ceil

import numpy as np

from . import generate as single
from ...runtime_sim.errors import LpxUserError
from ..output import Report


def repeated(program, period: int, copies: int):
    """``program`` issued ``copies`` times, each ``period`` cycles after the one before: one chip's steps of
    successive users, on the same addresses (the simulator's rules then say whether they may overlap so)."""
    from dataclasses import replace

    instructions = tuple(replace(ins, cycle=ins.cycle + k * period) for k in range(copies)
                         for ins in program.instructions)
    return replace(program, instructions=instructions,
                   predicted_cycles=program.predicted_cycles + (copies - 1) * period)


def conflict(program, chip, period: int):
    """The first rule a chip's step breaks when repeated every ``period`` cycles on the same addresses (its
    units, shared rates, weight buffers, links' ports, and no SRAM hazard between one user's step and the
    next's), as the simulator names it; None where it keeps them all."""
    from ...runtime_sim import ScheduleError, Simulator

    copies = -(-program.predicted_cycles // period) + 1  # every step that can be in flight beside the first
    try:
        Simulator(repeated(program, period, copies), chip, timing_only=True)
    except ScheduleError as err:
        return err
    return None


def unit_clashes(chip_sim, floor: int, limit: int) -> np.ndarray:
    """``clash[P]`` for P in 0..limit: whether some unit a chip holds alone (a matrix plane, a vector unit, a
    link port) would be held by two steps at once were the step repeated every P cycles (P ≥ ``floor``).

    Two holdings of one unit, ``[s_a, e_a)`` in one step and ``[s_b, e_b)`` in the step ``j`` later, overlap
    when ``s_a - e_b < j P < e_a - s_b``: each pair rules out an interval of distances, marked here for every
    pair and every ``j`` at which two steps can still meet. This is one of the simulator's rules, worked out
    for all distances at once: the simulator (:func:`conflict`) still has the last word on every distance
    this leaves (the SRAM hazards, the shared rates).
    """
    holdings = {}
    for ins, occ in zip(chip_sim.program.instructions, chip_sim.costs):
        if occ.busy > 0:
            for resource in occ.exclusive:
                holdings.setdefault(resource, []).append((ins.cycle, ins.cycle + occ.busy))
    marks = np.zeros(limit + 2, np.int64)
    steps_apart = chip_sim.program.predicted_cycles // max(floor, 1) + 1  # the most that can meet
    for held in holdings.values():
        start, end = np.array(held, np.int64).T
        for rows in range(0, len(start), 256):  # pairs a block of rows at a time: memory stays small
            low = (start[rows:rows + 256, None] - end[None, :]).ravel()  # s_a - e_b
            high = (end[rows:rows + 256, None] - start[None, :]).ravel()  # e_a - s_b
            keep = high > floor
            low, high = low[keep], high[keep]
            for j in range(1, steps_apart + 1):
                first = np.maximum(low // j + 1, floor)  # the smallest P ≥ floor with j P > s_a - e_b
                last = np.minimum(-(-high // j) - 1, limit)  # the largest P with j P < e_a - s_b
                ok = first <= last
                np.add.at(marks, first[ok], 1)
                np.add.at(marks, last[ok] + 1, -1)
    return np.cumsum(marks)[:limit + 1] > 0


def steady_period(compiled, kv_bytes: dict) -> int:
    """The fewest cycles between two users' steps that keep the rules on every chip at once.

    Distances are tried upward from a floor (no unit a chip holds alone can take the next step before it
    has done this one's work; nor its host link, its K/V write included). A distance at which two steps
    would hold a unit at once (:func:`unit_clashes`) is passed over; every other one is checked on every
    chip by the simulator (:func:`conflict`), and the first that keeps the rules on all of them is the
    period. The rules need not hold at every larger distance, so the distances are tried in order, none
    skipped unchecked. A step of several programs (host work between them) takes their sum.
    """
    config = single._chip_of(compiled)
    host = {chip: ceil(nbytes / config.host_bytes_per_cycle) for chip, nbytes in kv_bytes.items()}
    period = 0
    for sim in compiled.simulators.values():
        floor = 1
        for chip, chip_sim in sim.chips:
            held = {}
            for occ in chip_sim.costs:
                for resource in occ.exclusive:
                    held[resource] = held.get(resource, 0) + occ.busy
            floor = max(floor, max(held.values(), default=1),
                        chip_sim.stats.unit_busy.get("MEM", 0) + host.get(chip, 0))
        ceiling = max(chip_sim.program.predicted_cycles for _, chip_sim in sim.chips)
        clash = np.zeros(ceiling + 1, bool)
        for _, chip_sim in sim.chips:
            clash |= unit_clashes(chip_sim, floor, ceiling)
        chips = [chip_sim for _, chip_sim in sim.chips]
        candidate = ceiling  # a step after the last one has finished always keeps the rules
        for distance in np.flatnonzero(~clash[floor:ceiling]) + floor:
            broken = next((s for s in chips if conflict(s.program, s.config, int(distance))), None)
            if broken is None:
                candidate = int(distance)
                break
            chips.remove(broken)
            chips.insert(0, broken)  # the chip that broke a rule is asked first next time
        period += candidate
    return period


def generate_users(model="llama-tiny", users: int = 2, tokens: int = 16, system: str | None = None,
                   chips: int | None = None, dtype: str = "fp32", prompt_len: int = 8, seed: int = 0,
                   context: int | None = None, progress=None) -> dict:
    """Decode ``users`` sequences through a pipeline at once.

    Parameters
    ----------
    model, tokens, system, chips, dtype, prompt_len, seed, context
        As for :func:`.generate.generate` (a preset, a ``save_llama`` folder or a Hugging Face graph);
        user ``u``'s prompt (counting from 0) is seeded with ``seed + 1 + u``.
    users : int
        Sequences in flight.

    Returns
    -------
    dict
        Per user its ``tokens``, ORT's (``reference_tokens``) and ``agree_by_user``; ``agree`` for all; the
        step's cycles (``step_cycles``), the steady state's ``period_cycles`` (:func:`steady_period`),
        ``tokens_per_s`` (all users), ``tokens_per_s_per_user`` and ``tokens_per_s_per_chip``.
    """
    import lpx_tvm

    if isinstance(users, bool) or not isinstance(users, int) or users < 1:
        raise LpxUserError(f"users must be a positive integer, got {users!r}")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise LpxUserError(f"tokens must be a positive integer, got {tokens!r}")
    if system is None:
        raise LpxUserError("--users runs a pipeline: give --system (each user's token passes every stage)")
    say = progress or (lambda text: None)
    decoder = single._open_decoder(model, prompt_len, seed, context, dtype)
    prompt_len = decoder.prompt_len
    context = decoder.context_for(prompt_len + tokens, context)
    if prompt_len + tokens > context:
        raise LpxUserError(f"{prompt_len} prompt tokens and {tokens} more exceed the cache's context of {context}")
    names, new_names = decoder.cache_names, decoder.new_kv_names
    (prefill_graph, prefill_shapes), (decode_graph, decode_shapes) = decoder.graphs(prompt_len, context)
    options = dict(system=system, parallel="pipeline", chips=chips, dtype=dtype)
    say("compiling the prefill and decode graphs ...")
    prefill = lpx_tvm.compile(prefill_graph, input_shapes=prefill_shapes, weights=decoder.weights, **options)
    decode = lpx_tvm.compile(decode_graph, input_shapes=decode_shapes, state=names, weights=decoder.weights,
                             **options)
    blank = {n: np.zeros(decoder.cache_shape(context), decoder.kv_dtype) for n in names}
    caches, references, chosen, wanted, agree = [], [], [], [], []
    for user in range(users):  # each user's prompt prefilled, its caches kept
        say(f"prefilling user {user + 1}/{users}")
        prompt = np.random.default_rng(seed + 1 + user).integers(0, decoder.vocab_size, prompt_len).astype(np.int64)
        reference = decoder.reference()
        got = dict(zip(decoder.outputs, prefill(**decoder.prefill_feeds(prompt))))
        for name, new in zip(names, new_names):
            decode.write_state(name, got[new], (slice(None), slice(None), slice(0, prompt_len)))
        step = single._compare(got["logits"][0, -1], reference.prefill(prompt))
        references.append(reference)
        chosen.append([step["token"]])
        wanted.append([step["reference_token"]])
        agree.append(step["token"] == step["reference_token"])
        caches.append(_kept(decode, names))
    started = time.perf_counter()
    for step in range(tokens):
        for user in range(users):  # in the pipeline's order: user after user, step after step
            left = (f", about {(time.perf_counter() - started) / step * (tokens - step):.0f} s left" if step
                    else "")
            say(f"decode step {step + 1}/{tokens}, user {user + 1}/{users}{left}")
            _put_back(decode, caches[user])
            position, token = prompt_len + step, chosen[user][-1]
            got = dict(zip(decoder.outputs, decode(**decoder.decode_feeds(token, position, context), **blank)))
            slot = (slice(None), slice(None), slice(position, position + 1))
            nbytes = {name: decode.write_state(name, got[new], slot) for name, new in zip(names, new_names)}
            compared = single._compare(got["logits"][0, -1], references[user].step(token))
            chosen[user].append(compared["token"])
            wanted[user].append(compared["reference_token"])
            agree[user] = agree[user] and compared["token"] == compared["reference_token"]
            caches[user] = _kept(decode, names)
    kv_bytes = single.kv_bytes_per_chip(decode, names, nbytes)
    step_cycles = decode.stats.cycles + single._write_back_cycles(decode, names, nbytes)
    period = steady_period(decode, kv_bytes)
    chips = sum(len(sim.chips) for sim in decode.simulators.values())
    clock = single._chip_of(decode).clock_hz
    per_cycle = min(users / step_cycles, 1 / period)
    return {"model": str(model), "system": system, "users": users, "dtype": dtype, "context": context,
            "new_tokens": tokens, "tokens": chosen, "reference_tokens": wanted, "agree": all(agree),
            "agree_by_user": agree, "step_cycles": step_cycles, "period_cycles": period, "chips": chips,
            "tokens_per_s": clock * per_cycle, "tokens_per_s_per_user": clock * per_cycle / users,
            "tokens_per_s_per_chip": clock * per_cycle / chips}


def _kept(compiled, names) -> dict:
    return {name: [view.copy() for view in compiled.state_views(name)] for name in names}


def _put_back(compiled, kept: dict) -> None:
    for name, copies in kept.items():
        for view, copy in zip(compiled.state_views(name), copies):
            view[...] = copy


def table(report: dict) -> Report:
    """The run's :class:`~lpx_tvm.app.output.Report`: each user's agreement, then the steady state."""
    lines = [f"user {u + 1}: {len(t) - 1} token{'s' if len(t) != 2 else ''} after the prompt, "
             f"{'each equal to ONNX Runtime' if ok else 'NOT equal to ONNX Runtime'}'s"
             for u, (t, ok) in enumerate(zip(report["tokens"], report["agree_by_user"]))]
    lines.append(f"{report['users']} users in flight on {report['system']} ({report['chips']} chips, a pipeline): a "
                 f"step takes {report['step_cycles']:,} cycles, and the next user's may start "
                 f"{report['period_cycles']:,} cycles after one's (each chip's step repeated at that distance keeps "
                 f"the machine's rules): "
                 f"{report['tokens_per_s']:,.0f} tokens/s, {report['tokens_per_s_per_user']:,.0f} per user, "
                 f"{report['tokens_per_s_per_chip']:,.1f} per chip")
    return Report(f"{report['model']}: {report['users']} users on {report['system']}", ["\n".join(lines)], report)
