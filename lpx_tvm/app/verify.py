"""``plan --verify``: the chosen mapping's layers compiled and timed as its stages hold them.

A plan composes one block's cycles: two blocks compiled together, less one (:func:`.plan.block_cost`), times
the model's layers. The verification compiles every stage of the mapping whole, its layers as one program of
the codegen (the weights zero-strided, as the plan builds them), and times it with the timing-only
simulator. A stage program starts with its input crossing the host link and ends with its output crossing
back, where a pipeline's stage receives and sends over the chip links (which the plan counts beside): the
host link's cycles on the program's critical path are left out. The LM head is measured whole by the plan
already, and the links' all-reduces and hops are the plan's own formula in both.
"""

from __future__ import annotations

from ..runtime_sim import DType
from .plan import _as_built, _measure, block_cost, shard_shape
from .plan_graph import block_graph


def stage_cycles(chip, shape, dtype: str, layers: int) -> int | None:
    """Cycles of one stage shard holding ``layers`` blocks, its host transfers at the ends left out (None where
    it does not fit the chip)."""
    chip, dtype = _as_built(chip, dtype)
    cost = _measure(block_graph(shape, DType.from_name(dtype).np, layers), chip)
    if cost is None or cost.streamed:
        return None
    return cost.cycles - round(cost.breakdown.get("host link", 0))


def verify(spec, system, dtype: str, chosen, context: int, progress=None) -> dict:
    """The chosen mapping's per-token cycles with its blocks measured stage by stage, and the plan's error.

    Returns
    -------
    dict
        ``verified_cycles`` (a token's cycles with every stage compiled whole), ``verify_error`` (the plan's
        per-token cycles ÷ the verified ones − 1: positive where the plan is slower), and per distinct stage
        its blocks, its cycles and the plan's for them (``stages``).
    """
    shape, _, _ = shard_shape(spec, chosen.width, chosen.batch, context)
    # the layers as evenly as the stages take them: some stages hold one more than the rest
    fewer, more = divmod(spec.layers, chosen.stages)
    counts = [fewer + 1] * more + [fewer] * (chosen.stages - more)
    per_block = block_cost(system.chip, shape, dtype).cycles
    measured = {}
    for layers in sorted({n for n in counts if n > 0}):
        if progress is not None:
            progress(f"plan: verifying a stage of {layers} block{'s' if layers > 1 else ''}")
        measured[layers] = stage_cycles(system.chip, shape, dtype, layers)
        if measured[layers] is None:
            raise ValueError(f"a stage of {layers} blocks does not fit {system.chip.name} when compiled whole")
    blocks = sum(measured[n] for n in counts if n > 0)
    verified = chosen.per_token_cycles - spec.layers * per_block + blocks
    return {"verified_cycles": verified, "verify_error": chosen.per_token_cycles / verified - 1,
            "stages": [{"blocks": n, "stages": counts.count(n), "cycles": measured[n], "planned": n * per_block}
                       for n in sorted(measured)]}
