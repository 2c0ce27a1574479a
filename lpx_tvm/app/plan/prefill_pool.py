"""A separate prefill pool in ``lpx-tvm plan``: the prompt is prefilled on chips of its own, and its KV cache
is handed to the decode chips over the network.

The pool's mapping is the one of its chips that prefills the prompt soonest (the compiler's prefill block at
each tensor-parallel width, as for the time to first token of a decode mapping). The handoff moves the prompt's
cache as the decode chips hold it (:meth:`.plan_model.ModelSpec.cache_bytes`: each layer's positions, a sliding
layer's window at most; K/V heads replicated where fewer than the chips; multi-head latent attention's latent whole
on every chip) from the pool to the decode chips: the links between the two work side by side, as many as the
smaller side has chips, each carrying its share at the chip-to-chip rate after the hops between the pools. The time
to first token is the prefill and the handoff; the decode rate is the decode mapping's, on the chips the pool
leaves.
"""

from __future__ import annotations

from math import ceil

from .model import PlanError, _widths, evaluate, stage_hops


def handoff_cycles(cache_bytes: int, pool_chips: int, decode_chips: int, hops: int, system) -> int:
    """Cycles to move a prompt's KV cache from the pool to the decode chips: ``min(pool, decode)`` links side
    by side, each with its share of the bytes, after ``hops`` hops."""
    links = max(min(pool_chips, decode_chips), 1)
    return hops * system.hop_cycles + ceil(ceil(cache_bytes / links) / system.chip.c2c_bytes_per_cycle)


def prefill_pool(spec, system, dtype: str, pool_chips: int, decode, context: int, prompt: int) -> dict:
    """The pool's mapping, its prefill, the handoff and the time to first token.

    Parameters
    ----------
    spec, system, dtype, context, prompt
        As for the plan.
    pool_chips : int
        Chips of the prefill pool.
    decode : Mapping
        The decode mapping, on the other chips.
    """
    clock = system.chip.clock_hz
    best = None
    for width in _widths(spec, pool_chips, system):
        for stages in sorted({1, 2, 4, 8, 16, 32, 64, pool_chips // width} & set(range(1, pool_chips // width + 1))):
            if stages > spec.layers:
                continue
            mapping = evaluate(spec, system, dtype, stages, width, 1, context, prompt)
            if mapping is not None and mapping.ttft_cycles is not None and (
                    best is None or mapping.ttft_cycles < best.ttft_cycles):
                best = mapping
    if best is None:
        raise PlanError(f"no mapping of {pool_chips} prefill chips prefills a {prompt}-token prompt: every shard "
                        "of its prefill block streams weights or overflows SRAM")
    cache_bytes = spec.cache_bytes(prompt, 1, dtype, decode.width)  # as the decode chips hold it
    hops = stage_hops(system, 2, max(best.chips, decode.chips))  # from one pool to the other
    handoff = handoff_cycles(cache_bytes, best.chips, decode.chips, hops, system)
    ttft = best.ttft_cycles + handoff
    return {"chips": best.chips, "stages": best.stages, "width": best.width, "prefill_cycles": best.ttft_cycles,
            "handoff_bytes": cache_bytes, "handoff_cycles": handoff, "handoff_hops": hops, "ttft_cycles": ttft,
            "ttft_ms": 1e3 * ttft / clock, "prefill_ms": 1e3 * best.ttft_cycles / clock,
            "handoff_ms": 1e3 * handoff / clock}


def describe(pool: dict) -> str:
    """One line for the plan's table."""
    return (f"  prefill pool: {pool['chips']} chips ({pool['stages']} stages × {pool['width']}-way) prefill in "
            f"{pool['prefill_ms']:.2f} ms, then hand {pool['handoff_bytes'] / 1e6:.1f} MB of KV cache to the "
            f"decode chips in {pool['handoff_ms']:.3f} ms: first token in {pool['ttft_ms']:.2f} ms")
