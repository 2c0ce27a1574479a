"""Attention–FFN disaggregation (AFD) between GPUs and LPX: the GPUs run attention over the KV cache, LPX runs
every layer's FFN (or experts), and each layer's activations cross the GPU–LPX link both ways for every token.

The LPX half is the compiler's: one shard of one layer's FFN (RMSNorm, the SwiGLU MLP or a mixture's router
and expert, the all-reduce the compiler emits for the shard's chips) built as :mod:`.plan_graph` builds a block
and timed as :mod:`.plan_model` times one (the real codegen and the timing-only simulator, two layers minus
one). The GPU half is AIConfigurator's (:mod:`.gpu`). What is worked out here is only how the two meet:

* **The exchange.** A token's hidden state goes to LPX in the plan's dtype and its FFN output comes back in
  bf16 (:func:`return_itemsize`; DeepEP's dispatch in FP8 and combine in BF16 is the public practice): ``hidden
  × bytes`` each way. A micro-batch of ``x`` tokens takes ``latency + x × hidden × bytes ÷ rate`` one way
  (:func:`exchange_us`).
* **Ping-pong micro-batches** (MegaScale-Infer, Step-3): the batch is split into ``m`` micro-batches, so the
  GPUs run one's attention while LPX runs another's FFN and a third crosses the link. A token's time is then
  bounded by the busiest resource over the L layers (GPU ``L·m·t_a``, an LPX stage ``(L/S)·m·t_f``, a link
  direction ``L·m·t_ser``, the busier one) and by one micro-batch's chain ``L·(t_a + t_f + t_rt)``, ``t_rt``
  both ways with their latencies; the exchange is hidden
  when a resource, not the chain, binds (:func:`pingpong`).
"""

from __future__ import annotations

from functools import lru_cache
from math import ceil

from ...runtime_sim import DType
from .graph import BlockShape, _Builder, collective_group, ffn_half, summer


def exchange_us(tokens: int, hidden: int, itemsize: int, rate_bytes_per_s: float, latency_us: float) -> float:
    """One direction of a micro-batch's exchange: its latency plus ``tokens × hidden × itemsize`` bytes at
    ``rate_bytes_per_s``, in microseconds."""
    return latency_us + 1e6 * tokens * hidden * itemsize / rate_bytes_per_s


def return_itemsize(itemsize: int) -> int:
    """Bytes an element of the FFN's output takes back to the GPUs: bf16's 2 (the residual stream the GPUs keep),
    or the plan's own where wider."""
    return max(itemsize, 2)


def pingpong(t_a: float, t_f, t_rt: float, t_ser: float, micro: int, layers: int, stages=1) -> dict:
    """A token's time under ``micro`` ping-pong micro-batches, and what binds it.

    Parameters
    ----------
    t_a : float
        One micro-batch's attention (GPU) time for one layer.
    t_f : float or sequence of float
        One micro-batch's FFN (LPX) time for one layer, or for each layer in order (a model whose first layers
        are dense and the rest experts).
    t_rt, t_ser : float
        One micro-batch's exchange: there and back in all (both latencies included), and the part that
        occupies the busier direction of the link.
    micro, layers : int
        Micro-batches, layers.
    stages : int or sequence of int
        LPX pipeline stages, each holding ``ceil(layers / stages)`` layers' FFN (the last fewer), or each stage's
        layer count in order.

    Returns
    -------
    dict
        ``token`` (the time a step of every micro-batch takes, in t_a's units), ``bounds`` (attention, FFN,
        link, chain), ``regime`` (attention, FFN or link) and ``hidden`` (whether the exchange is hidden).
    """
    per_layer = list(t_f) if hasattr(t_f, "__len__") else [t_f] * layers
    if isinstance(stages, int):
        each = ceil(layers / stages)
        stages = [min(each, layers - k * each) for k in range(stages)]
    starts = [sum(stages[:k]) for k in range(len(stages))]
    busiest = max(sum(per_layer[s:s + n]) for s, n in zip(starts, stages))
    bounds = {"attention": layers * micro * t_a, "FFN": micro * busiest,
              "link": layers * micro * t_ser, "chain": layers * (t_a + t_rt) + sum(per_layer)}
    token = max(bounds.values())
    binding = max(bounds, key=bounds.get)
    resources = max(bounds["attention"], bounds["FFN"], bounds["link"])
    # the chain binding means the micro-batches are too few to cover a round trip: the exchange shows
    regime = "link" if binding in ("link", "chain") else binding
    return {"token": token, "bounds": bounds, "regime": regime, "hidden": resources >= bounds["chain"]}


def ffn_stages(spec, resident: dict, room: int) -> list | None:
    """Each LPX stage's layer count, in order: the fewest stages whose consecutive layers' FFN weights
    (``resident``: bytes a layer of each kind, keyed by whether it is a mixture's) fit ``room`` bytes a chip,
    the layers spread as evenly as those stages hold them; None where one layer does not fit."""
    need = [resident[spec.is_moe(layer)] for layer in range(spec.layers)]
    if max(need) > room:
        return None
    greedy, used = [], room
    for n in need:
        if used + n > room:
            greedy.append(0)
            used = 0
        greedy[-1] += 1
        used += n
    stages = len(greedy)
    each = ceil(spec.layers / stages)
    even = [min(each, spec.layers - k * each) for k in range(stages)]
    starts = [k * each for k in range(stages)]
    fits = all(sum(need[s:s + n]) <= room for s, n in zip(starts, even)) and all(even)
    return even if fits else greedy


def ffn_graph(shape: BlockShape, dtype, layers: int = 1):
    """``layers`` consecutive FFN halves of a block shard, as :func:`.plan_graph.block_graph` builds them: the
    residual's RMSNorm, the router and the ``routed`` experts' SwiGLUs with the shared experts' (a mixture) or
    the SwiGLU shard, their all-reduce, a sandwich norm where the model has one; input the hidden state."""
    b = _Builder(dtype)
    g, s = b.g, shape
    summed = summer(b, s, collective_group(s))
    x = g.add_tensor((s.batch, s.tokens, s.hidden), b.dtype)
    g.inputs = [x]
    for _ in range(layers):
        x = ffn_half(b, s, x, summed)
    g.outputs = [x]
    return g


@lru_cache(maxsize=256)
def _ffn_program(chip, shape: BlockShape, dtype: str, layers: int):
    from .model import _measure

    return _measure(ffn_graph(shape, DType.from_name(dtype).np, layers), chip)


def ffn_cost(spec, system, dtype: str, width: int, rows: int, layer: int | None = None) -> dict | None:
    """One layer's FFN shard on ``width`` LPX chips for ``rows`` tokens, from the compiler: ``cycles`` mid-stage
    (two layers as one program less one layer), ``resident_bytes`` a layer's weights on a chip, ``activation_bytes``;
    None where it does not fit a chip or would stream its weights. ``layer`` (default the last) picks its kind:
    a dense MLP or experts."""
    from .model import _as_built, _group_system, shard_shape

    shape, experts_per_chip, placement = shard_shape(spec, width, rows, 0, 1, _group_system(system), layer=layer)
    chip, built = _as_built(system.chip, dtype)
    one = _ffn_program(chip, shape, built, 1)
    two = _ffn_program(chip, shape, built, 2)
    if one is None or two is None or one.streamed or two.streamed:
        return None
    # the other experts a chip holds add their weights, not their time (as the plan counts them)
    extra = (experts_per_chip - shape.routed) * 3 * spec.hidden * shape.ffn * DType.from_name(dtype).itemsize \
        if shape.experts else 0
    return {"cycles": two.cycles - one.cycles, "resident_bytes": two.resident_bytes - one.resident_bytes + extra,
            "activation_bytes": one.activation_bytes, "placement": placement}


def verify_ffn_stage(spec, system, dtype: str, width: int, layers: int, rows: int) -> dict:
    """``plan --gpu --verify`` for AFD's LPX half: a stage's ``layers`` FFN layers (of the last layer's kind) at
    ``rows`` tokens compiled as one program and timed, beside the plan's figure for them (that many times one
    layer's, two layers as one program less one). The host link at the program's ends is left out, as the stage
    receives from and sends to the GPUs over theirs.

    Returns
    -------
    dict
        ``layers``, ``rows``, ``planned_cycles``, ``verified_cycles`` and ``verify_error`` (planned ÷ verified
        − 1: positive where the plan is slower); ``error`` instead where the stage does not fit a chip whole.
    """
    from .model import _as_built, _group_system, shard_shape

    shape = shard_shape(spec, width, rows, 0, 1, _group_system(system))[0]
    chip, built = _as_built(system.chip, dtype)
    one, two, whole = (_ffn_program(chip, shape, built, n) for n in (1, 2, layers))
    if whole is None or whole.streamed:
        return {"layers": layers, "rows": rows, "error": f"a stage of {layers} FFN layers does not fit "
                f"{system.chip.name} compiled whole (the plan's two-layer measurement fitted: its activations do not)"}
    planned = layers * (two.cycles - one.cycles)
    verified = whole.cycles - round(whole.breakdown.get("host link", 0))
    return {"layers": layers, "rows": rows, "planned_cycles": planned, "verified_cycles": verified,
            "verify_error": planned / verified - 1}
