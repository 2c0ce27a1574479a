"""Speculative decoding in ``lpx-tvm plan``: a draft model proposes ``k`` tokens one decode step at a time on
its own chips, and the target verifies them all in one step of ``k + 1`` rows (Leviathan et al., 2023).

With each draft token accepted with probability ``a`` independently, a round yields
``(1 - a^(k+1)) / (1 - a)`` tokens on average (the accepted prefix plus the target's own next token), and
takes ``k`` draft steps and one verify step. The verify step's cycles are the compiler's: the target's block
compiled for ``k + 1`` rows against the cache. On a latency-bound SRAM machine a few more rows cost little,
which is where speculation pays.
"""

from __future__ import annotations

from math import inf

from .model import Mapping, PlanError, evaluate

MAX_DRAFT_TOKENS = 8


def expected_tokens(k: int, accept_rate: float) -> float:
    """Tokens a round yields on average: ``1 + a + a² + … + a^k``."""
    return float(k + 1) if accept_rate == 1 else (1 - accept_rate ** (k + 1)) / (1 - accept_rate)


def speculate(spec, system, dtype: str, target: Mapping, draft: dict, accept_rate: float, context: int,
              prompt: int, draft_tokens: int | None = None) -> dict:
    """The figures of speculative decoding on the target's mapping with a planned draft.

    Parameters
    ----------
    spec, system, dtype, context, prompt
        As for the target's plan.
    target : Mapping
        The target's chosen mapping (its one-row step is ``target.per_token_cycles``).
    draft : dict
        The draft's own plan (``lpx_tvm.app.plan.search.plan``): its chips and its ``per_token_us``.
    accept_rate : float
        The probability that the target accepts a draft token, in [0, 1].
    draft_tokens : int, optional
        ``k``; by default the best of 1 .. :data:`MAX_DRAFT_TOKENS`.

    Returns
    -------
    dict
        ``draft_tokens``, ``accept_rate``, ``expected_tokens`` a round, ``verify_cycles`` (the ``k + 1``-row
        step), ``one_row_cycles``, ``verify_over_one_row``, ``draft_cycles`` a draft step, ``round_cycles``,
        ``tokens_per_s_per_user``, ``speedup`` over plain decoding, ``chips`` (target and draft).
    """
    if not (isinstance(accept_rate, (int, float)) and 0 <= accept_rate <= 1):
        raise PlanError(f"the acceptance rate must be a probability in [0, 1], got {accept_rate!r}")
    if draft_tokens is not None and (isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int)
                                     or not 1 <= draft_tokens <= 64):
        raise PlanError(f"draft tokens must be an integer from 1 to 64, got {draft_tokens!r}")
    clock = system.chip.clock_hz
    draft_cycles = round(draft["per_token_us"] * clock / 1e6)
    best, best_rate = None, -inf
    for k in [draft_tokens] if draft_tokens else range(1, MAX_DRAFT_TOKENS + 1):
        verify = evaluate(spec, system, dtype, target.stages, target.width, target.batch, context, prompt,
                          ttft=False, rows=k + 1)
        if verify is None:
            if draft_tokens:
                raise PlanError(f"the target's {k + 1}-row verify step does not fit its mapping's chips")
            break
        tokens = expected_tokens(k, accept_rate)
        round_cycles = k * draft_cycles + verify.per_token_cycles
        rate = clock * tokens / round_cycles
        if rate > best_rate:
            best_rate = rate
            best = {"draft_tokens": k, "accept_rate": accept_rate, "expected_tokens": tokens,
                    "verify_cycles": verify.per_token_cycles, "one_row_cycles": target.per_token_cycles,
                    "verify_over_one_row": verify.per_token_cycles / target.per_token_cycles,
                    "draft_cycles": draft_cycles, "round_cycles": round_cycles, "tokens_per_s_per_user": rate,
                    "speedup": rate * target.per_token_cycles / clock, "draft_model": draft["model"],
                    "draft_chips": draft["chips"], "chips": target.chips + draft["chips"]}
    if best is None:
        raise PlanError("no verify step of 2 rows or more fits the target's mapping")
    return best


def describe(figures: dict) -> str:
    """One line for the plan's table."""
    f = figures
    return (f"  speculative: {f['draft_model']} on {f['draft_chips']} more chip(s) drafts {f['draft_tokens']} "
            f"token(s) at {f['draft_cycles']} cycles each; the {f['draft_tokens'] + 1}-row verify step takes "
            f"{f['verify_cycles']} cycles, {f['verify_over_one_row']:.2f}× a one-row step; at acceptance "
            f"{f['accept_rate']:g}, {f['expected_tokens']:.2f} tokens a round = {f['tokens_per_s_per_user']:.0f} "
            f"tokens/s per user ({f['speedup']:.2f}× plain decoding) on {f['chips']} chips")


def check_draft(target, draft) -> None:
    """A draft proposes the target's tokens: a draft (a :class:`.model.ModelSpec`) of another vocabulary than the
    target's is refused, naming both."""
    if draft.vocab != target.vocab:
        raise PlanError(f"the draft {draft.name} has a vocabulary of {draft.vocab:,} tokens, the target "
                        f"{target.name} {target.vocab:,}: a draft must propose the target's tokens")
