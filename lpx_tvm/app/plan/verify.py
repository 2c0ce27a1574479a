"""``plan --verify``: the chosen mapping's layers compiled and timed as its stages hold them.

A plan composes one block's cycles: two blocks compiled together, less one (:func:`.plan_model.block_cost`), times
the model's layers. The verification compiles every stage of the mapping whole, its layers as one program of
the codegen (the weights zero-strided, as the plan builds them), and times it with the timing-only
simulator. A stage program starts with its input crossing the host link and ends with its output crossing
back, where a pipeline's stage receives and sends over the chip links (which the plan counts beside): the
host link's cycles on the program's critical path are left out. The LM head is measured whole by the plan
already, and the links' all-reduces and hops are the plan's own formula in both.

int8 is planned as one-byte storage at the int8 matrix rate, without the QDQ flow's quantise and dequantise
steps. The verification measures what that leaves out: one block of the chosen shard, built as the project's
decoder with seeded random weights, quantised by ONNX Runtime's static quantiser and compiled as int8 kernels
(two blocks less one), beside the planned block.
"""

from __future__ import annotations

import numpy as np

from ...runtime_sim import DType
from .model import PlanError, _as_built, _measure, block_cost, shard_shape
from .graph import block_graph


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
    shape, _, _ = shard_shape(spec, chosen.width, chosen.batch, context, system=system.name)
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
            raise PlanError(f"--verify: a stage of {layers} blocks does not fit {system.chip.name} when compiled whole "
                            "(the plan's two-block measurement fitted: the stage's activations do not)")
    blocks = sum(measured[n] for n in counts if n > 0)
    verified = chosen.per_token_cycles - spec.layers * per_block + blocks
    return {"verified_cycles": verified, "verify_error": chosen.per_token_cycles / verified - 1,
            "stages": [{"blocks": n, "stages": counts.count(n), "cycles": measured[n], "planned": n * per_block}
                       for n in sorted(measured)]}


def qdq_block_cycles(spec, shape, chip: str, context: int, seed: int = 0) -> int:
    """One block of ``shape`` through the int8 QDQ flow: two blocks' decode step less one's, each a decoder of
    the shard's sizes (its heads, K/V heads and MLP columns; the whole hidden size) quantised by ONNX
    Runtime's static quantiser on a seeded step and compiled for ``chip`` as int8 kernels."""
    import lpx_tvm

    from ..models import llama

    cycles = []
    for layers in (1, 2):
        config = llama.LlamaConfig(hidden_size=spec.hidden, num_layers=layers, num_heads=shape.heads,
                                   num_kv_heads=shape.kv_heads, intermediate_size=shape.ffn, vocab_size=64,
                                   max_context=context, head_size=spec.head_dim)
        rng = np.random.default_rng(seed)
        cache = {name: rng.standard_normal((1, shape.kv_heads, context, spec.head_dim)).astype(np.float32)
                 for name in llama.cache_names(config)}
        qdq = lpx_tvm.quantize(llama.build_decode(config, seed),
                               [llama.decode_feeds(config, 3, context // 2, cache)])
        compiled = lpx_tvm.compile(qdq, config=chip, dtype="int8", state=llama.cache_names(config))
        cycles.append(compiled.stats.cycles)
    return cycles[1] - cycles[0]


def int8_as_compiled(spec, system, chosen, context: int, progress=None) -> dict | None:
    """The int8 plan's blocks as the QDQ flow compiles them: ``block_cycles`` (:func:`qdq_block_cycles`),
    ``planned_block_cycles``, and ``per_token_cycles`` with every block at the measured cycles; None for a
    mixture of experts (the project's decoder has no experts)."""
    if spec.experts:
        return None
    if progress is not None:
        progress("plan: a block through the int8 QDQ flow (quantised by ONNX Runtime, compiled as int8 kernels)")
    # both blocks without their all-reduces: the difference is the QDQ flow's steps
    shape, _, _ = shard_shape(spec, chosen.width, chosen.batch, context)
    planned = block_cost(system.chip, shape, "int8").cycles
    measured = qdq_block_cycles(spec, shape, system.chip.name, context)
    return {"block_cycles": measured, "planned_block_cycles": planned,
            "per_token_cycles": chosen.per_token_cycles + spec.layers * (measured - planned)}
