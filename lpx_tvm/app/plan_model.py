"""What a decode mapping costs: the model's shape, the compiler's numbers for one block shard, the network
between the chips, the floor the preset's figures set, and one mapping's figures (:func:`evaluate`).

The numbers come from the compiler, not a roofline. For each tensor-parallel width T one shard of one block
(:mod:`.plan_graph`: the graph lowering produces for the :mod:`.llama` decoder, its two all-reduces as the
compiler emits them for T chips of the system) runs through the real codegen on the chip model (tile, alloc,
list schedule, the timing-only simulator): two consecutive blocks minus one gives a block's cycles in the middle
of a stage, free of the program's host transfers; the LM head's shard likewise. A pipeline of S stages × T
chips then takes, per token:

    L blocks (each with its all-reduces) + (S − 1) stage-to-stage hand-offs + the LM head
      + writing the new K/V into the resident cache

The weights, the KV cache for the context, and the activations are placed by the real allocator: a mapping
whose shard streams weights from the host, or does not fit, is not a mapping. Nothing is materialised: the
weights are zero-strided arrays the codegen never reads.

A mixture of experts places its experts over the T chips of a stage (T/E chips an expert when T ≥ E, else
E/T experts a chip); a token's top-k experts run side by side, and the MLP's all-reduce combines them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import lru_cache
from math import ceil
from numbers import Integral
from pathlib import Path

from ..codegen.parallel.collectives import CollectiveError
from ..runtime_sim import ChipConfig, DType
from ..runtime_sim.errors import LpxUserError
from ..runtime_sim.system import SystemConfig, load_system
from .plan_graph import BlockShape, block_graph, head_graph


_HF_KEYS = {"hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
            "vocab_size", "rope_theta", "tie_word_embeddings", "num_local_experts", "num_experts_per_tok",
            "head_dim", "max_position_embeddings"}
# (a sliding window is read before these: set, it is refused as not modelled)
_HF_IGNORED = {"architectures", "model_type", "torch_dtype", "bos_token_id", "eos_token_id", "pad_token_id",
               "transformers_version", "hidden_act", "initializer_range", "rms_norm_eps", "rope_scaling",
               "use_cache", "attention_bias", "attention_dropout", "mlp_bias", "pretraining_tp", "sliding_window",
               "use_sliding_window", "max_window_layers",
               "output_router_logits", "router_aux_loss_coef", "router_jitter_noise", "_name_or_path",
               "name", "source"}

# published configs, one file each (``configs/NAME.json``, naming its Hugging Face repository)
_CONFIG_DIR = Path(__file__).with_name("configs")
PRESETS = {p.stem: {k: v for k, v in json.loads(p.read_text()).items() if k not in ("name", "source")}
           for p in sorted(_CONFIG_DIR.glob("*.json"))}


class PlanError(LpxUserError):
    """A model or system the planner cannot plan for, naming what was wrong."""


@dataclass(frozen=True)
class ModelSpec:
    """The architecture a plan needs, from a Hugging Face style config."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool = False
    experts: int = 0
    top_k: int = 0
    head_size: int = 0  # the config's head_dim, where it is not hidden ÷ heads

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    @property
    def experts_per_token(self) -> int:
        return self.top_k or 1

    def block_params(self) -> int:
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.ffn * max(self.experts, 1) + self.hidden * self.experts
        return attention + mlp + 2 * self.hidden

    def params(self) -> int:
        return self.layers * self.block_params() + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def chip_params(self) -> int:
        """The parameters the chips hold: all but an untied token-embedding table, whose lookup runs on the
        host (as the compiler places it; a tied table is the LM head on the chips)."""
        return self.params() - (0 if self.tied else self.vocab * self.hidden)

    def cache_bytes(self, context: int, batch: int, dtype: str) -> int:
        per_position = 2 * self.layers * self.kv_heads * self.head_dim * DType.from_name(dtype).itemsize
        return per_position * batch * context


def model_spec(model) -> ModelSpec:
    """A ModelSpec from a preset name, a config.json path, a dict, or a ``LlamaConfig``."""
    from . import llama

    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, llama.LlamaConfig):
        return ModelSpec("llama", model.hidden_size, model.num_layers, model.num_heads, model.num_kv_heads,
                         model.intermediate_size, model.vocab_size, model.tie_word_embeddings)
    name, data = str(model), model
    if isinstance(model, dict):
        name = model.get("name", "model")
    elif name in PRESETS:
        data = PRESETS[name]
    elif name in llama.PRESETS:
        return replace(model_spec(llama.PRESETS[name]), name=name)
    else:
        path = Path(name)
        if not path.is_file():
            raise PlanError(f"model {name!r} is neither a preset ({', '.join(list(PRESETS) + list(llama.PRESETS))}) "
                            "nor a config.json file")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise PlanError(f"{path}: not JSON ({err})") from None
        # Hugging Face's layout names the folder (llama-2-70b/config.json); any other file names itself
        name = (path.resolve().parent.name if path.name == "config.json" else path.stem) or path.stem
    unknown = sorted(set(data) - _HF_KEYS - _HF_IGNORED)
    window = data.get("sliding_window")
    if window is not None and data.get("use_sliding_window", True) is not False:
        # a window changes what each layer's attention reads and keeps: the plan prices every layer's whole
        # context, so it says so rather than plan a different model
        raise PlanError(f"model {name!r}: sliding_window {window} is not modelled by the plan (every layer is "
                        "planned attending to the whole context); remove it to plan full attention")
    if unknown:
        raise PlanError(f"model {name!r}: unknown config key {', '.join(unknown)} (a plan reads "
                        f"{', '.join(sorted(_HF_KEYS))})")
    try:
        spec = ModelSpec(name, int(data["hidden_size"]), int(data["num_hidden_layers"]),
                         int(data["num_attention_heads"]), int(data.get("num_key_value_heads",
                                                                        data["num_attention_heads"])),
                         int(data["intermediate_size"]), int(data["vocab_size"]),
                         bool(data.get("tie_word_embeddings", False)), int(data.get("num_local_experts", 0)),
                         int(data.get("num_experts_per_tok", 0)), int(data.get("head_dim") or 0))
    except KeyError as err:
        raise PlanError(f"model {name!r}: config has no {err.args[0]}") from None
    if (spec.hidden % spec.heads and not spec.head_size) or spec.heads % spec.kv_heads:
        raise PlanError(f"model {name!r}: hidden_size must divide by the heads, and the heads by the KV heads")
    return spec


# ---- the compiler's numbers ----------------------------------------------------------------------------
@dataclass(frozen=True)
class ShardCost:
    """What the codegen measured for one program shape: cycles, where they went, what it keeps resident."""

    cycles: int
    breakdown: dict  # cause ─► cycles of the block's critical path (matrix, vector, latency, ...: runtime_sim.critical)
    resident_bytes: int  # weights and cache of one block shard
    activation_bytes: int
    streamed: bool  # some weights would stream from the host: the shard does not fit


def _measure(graph, chip: ChipConfig) -> ShardCost | None:
    """A block shard through the codegen's own stages (tile to emit, as a pipeline stage holds its weights),
    timed by the timing-only simulator; None when it does not fit the chip."""
    from ..codegen import CapacityError, CodegenOptions, Compilation, run_stages
    from ..codegen.parallel.base import weight_budget
    from ..runtime_sim import Simulator

    budget = weight_budget(graph, chip)
    weights = sum(graph.tensors[k].nbytes for k in range(len(graph.tensors)) if graph.is_constant(k))
    if weights > budget:  # the tiler would stream some of them (or fail to place them): not a mapping either way
        return ShardCost(0, {}, weights, 0, True)
    c = Compilation("block", CodegenOptions(config=chip), graph=graph, resident_budget=budget)
    try:
        program = run_stages(c, "tile", "emit")
    except CapacityError:
        return None
    stats = Simulator(program, chip, timing_only=True).stats
    resident = sum(const.ref.nbytes for const in program.constants) + sum(r.nbytes for _, r in program.state)
    return ShardCost(stats.cycles, dict(stats.critical), resident, c.addr["high_water"] - resident, bool(program.streamed))


def _as_built(chip: ChipConfig, dtype: str) -> tuple:
    """The chip and storage type a block is built in. int8 is planned as one-byte storage at the int8 matrix
    rate: built in fp8 on a variant of the chip whose fp8 rate is its int8 rate (the QDQ flow's quantise and
    dequantise steps are not modelled)."""
    if dtype != "int8":
        return chip, dtype
    from ..runtime_sim import derive_config

    return derive_config(chip, {"mxm_passes": {"fp8": chip.mxm_passes["int8"]}}, f"{chip.name}+int8-as-fp8"), "fp8"


@lru_cache(maxsize=512)
def _blocks(chip: ChipConfig, shape: BlockShape, dtype: str, layers: int) -> ShardCost | None:
    """``layers`` block shards as one program, on the chip and in the storage type they are built in
    (:func:`_as_built`)."""
    return _measure(block_graph(shape, DType.from_name(dtype).np, layers), chip)


def block_cost(chip: ChipConfig, shape: BlockShape, dtype: str, alone: bool = False) -> ShardCost | None:
    """A block shard's cycles in the middle of a stage (two blocks minus one), or None when it cannot fit.

    With ``alone``, a block that fits only by itself is timed as a whole program (its host transfers and
    pipeline fill included, so an upper bound), as for a prompt's prefill where two blocks' activations
    and weights do not fit one chip."""
    chip, dtype = _as_built(chip, dtype)
    one = _blocks(chip, shape, dtype, 1)
    if one is None or one.streamed:  # a block that streams its weights is no mapping: two would too
        return one
    two = _blocks(chip, shape, dtype, 2)
    if alone and (two is None or two.streamed):  # fits only alone
        return one
    if two is None:
        return None
    per_block = two.cycles - one.cycles
    # a block's causes mid-stage, two blocks' less one's (the host transfers at the ends cancel), where that
    # is not negative (the two critical paths may take different routes), scaled to the block's cycles
    difference = {k: max(two.breakdown.get(k, 0) - one.breakdown.get(k, 0), 0) for k in two.breakdown}
    if not any(difference.values()):
        difference = one.breakdown
    scale = per_block / max(sum(difference.values()), 1)
    breakdown = {k: v * scale for k, v in difference.items() if v}
    return ShardCost(per_block, breakdown, two.resident_bytes - one.resident_bytes, one.activation_bytes,
                     one.streamed or two.streamed)


@lru_cache(maxsize=64)
def head_cost(chip: ChipConfig, hidden: int, vocab: int, tokens: int, dtype: str) -> ShardCost | None:
    """The final RMSNorm and ``vocab`` LM-head columns as a program of their own (its input from the host)."""
    chip, dtype = _as_built(chip, dtype)
    return _measure(head_graph(hidden, vocab, tokens, DType.from_name(dtype).np), chip)


@lru_cache(maxsize=64)
def head_step_cycles(chip: ChipConfig, hidden: int, vocab: int, tokens: int, dtype: str) -> int | None:
    """What the LM head adds to a pipeline's last stage, its input already on the chip: the residual add
    that ends a block with the head after it, less the add alone (the host transfer of their input cancels).
    None where the head does not fit."""
    chip, dtype = _as_built(chip, dtype)
    np_dtype = DType.from_name(dtype).np
    with_head = _measure(head_graph(hidden, vocab, tokens, np_dtype, after=True), chip)
    if with_head is None or with_head.streamed:
        return None
    alone = _measure(head_graph(hidden, vocab, tokens, np_dtype, after=True, head=False), chip)
    return with_head.cycles - alone.cycles


# ---- the network -----------------------------------------------------------------------------------------
def transfer_cycles(nbytes: int, hops: int, chip: ChipConfig, hop: int) -> int:
    return hops * hop + ceil(nbytes / chip.c2c_bytes_per_cycle)


def stage_hops(system: SystemConfig, stages: int, width: int) -> int:
    """Hops between two consecutive stages: one inside a node (or a fully connected system, or a grid of
    nodes, where each chip is linked to its counterpart in every other node), else the system's worst case
    between nodes."""
    node = system.figures.get("node_chips", system.chips if system.topology == "fully-connected" else 8)
    if stages * width <= node or system.topology in ("fully-connected", "node-grid"):
        return 1
    return int(system.figures.get("max_hops", 3))


def floor_cycles(spec: ModelSpec, system: SystemConfig, dtype: str, context: int, chips: int, batch: int = 1) -> dict:
    """The bound the preset's own figures set on a token's time, at the best tensor-parallel width T.

    Per layer, each chip of T: its share of the layer's weights through the fastest weight path (installing
    into the matrix planes: planes × install streams × a vector a cycle), its share of the K/V cache at the
    SRAM rate, and two all-reduces of the hidden state, each the hops across the diameter of the group the
    compiler's collectives use (one all linked, two across a grid of nodes, half a ring; a width no collective
    joins is not a mapping) and its bytes over the links a pair has.
    Then the LM head's share, and a hop between each two of the S stages the weights need (S × T ≤ chips; from
    rack to rack on a system of racks, its rack-to-rack latency).
    No unit latency, no dependence: nothing any schedule could remove is left out, nothing else is in.

    Returns
    -------
    dict
        ``cycles``, ``width``, ``stages`` and the per-token ``parts`` (weights, KV cache, collectives, head).
    """
    chip = system.chip
    item = DType.from_name(dtype).itemsize
    install = chip.mxm_planes * chip.mxm_install_streams * chip.lanes  # bytes a cycle into the planes
    sram = chip.sram_bytes_per_cycle
    active_ffn = spec.ffn * (spec.experts_per_token if spec.experts else 1)
    layer_weights = (spec.block_params() - 3 * spec.hidden * spec.ffn * max(spec.experts, 1)
                     + 3 * spec.hidden * active_ffn) * item  # the weights one token reads: its experts' only
    kv = 2 * batch * spec.kv_heads * context * spec.head_dim * item
    hidden = batch * spec.hidden * item
    total = spec.chip_params() * item + spec.cache_bytes(context, batch, dtype)
    from ..codegen.parallel.collectives import choose

    best = None
    for width in _widths(spec, chips, system):
        stages = max(1, ceil(total / (width * chip.sram_bytes)))
        if stages * width > chips or stages > spec.layers:
            continue
        try:  # the group the compiler would run the width's collectives on (as the plan's search does)
            group = choose(system if system.simulated else load_system(_group_system(system)), width)
        except CollectiveError:
            continue
        collective = 0 if width == 1 else group.diameter * system.hop_cycles + ceil(
            hidden / width / (group.links * chip.c2c_bytes_per_cycle))
        parts = {"weights": spec.layers * ceil(layer_weights / width / install),
                 "KV cache": spec.layers * ceil(kv / min(width, spec.kv_heads) / sram),
                 "collectives": spec.layers * 2 * collective,
                 "head": ceil(spec.hidden * spec.vocab * item / width / install),
                 "stages": (stages - 1) * system.hop_cycles + _rack_crossings(system, stages, width) * (
                     system.figures.get("rack_hop_cycles", 0) - system.hop_cycles)}
        cycles = sum(parts.values())
        if best is None or cycles < best["cycles"]:
            best = {"cycles": cycles, "width": width, "stages": stages, "parts": parts}
    return best


def _rack_crossings(system: SystemConfig, stages: int, width: int) -> int:
    """Stage boundaries that cross from one rack to the next on a system of racks (``rack_hop_cycles``: the
    hidden state's hand-off there takes that latency instead of a hop): a rack holds its chips ÷ width stages."""
    if "rack_hop_cycles" not in system.figures:
        return 0
    return (stages - 1) // max(system.figures["node_chips"] // width, 1)


# a cause on a block's critical path as the plan's split names it (the rest is latency: results in pipelines)
_SPLIT_OF_BOUND = {"matrix": "matrix", "weight install": "weight install", "vector": "vector", "switch": "vector",
                   "SRAM bandwidth": "SRAM", "host link": "host link", "link": "C2C links"}


# ---- mappings ----------------------------------------------------------------------------------------
@dataclass
class Mapping:
    """One way to lay the model out: S pipeline stages × T tensor-parallel chips, and what it achieves."""

    stages: int
    width: int
    batch: int
    chips: int
    per_token_cycles: int
    ttft_cycles: int
    split: dict
    memory_per_chip: int
    expert_placement: str = ""
    users: int = 1  # in flight: stages × batch when the pipeline is full, fewer when their caches do not fit
    period_cycles: int = 0  # the busiest stage's time a step: how often a step can start (0: no bound)

    def tokens_per_s(self, clock: int) -> float:
        """All users' tokens a second: each user's steps follow each other a step's time apart, and the
        steps of all of them at most one a period (a batch of ``batch`` sequences a step)."""
        steps = min(self.users / self.batch / self.per_token_cycles,
                    1 / self.period_cycles if self.period_cycles else float("inf"))
        return clock * steps * self.batch

    def tokens_per_s_per_user(self, clock: int) -> float:
        return self.tokens_per_s(clock) / self.users


def _group_system(system: SystemConfig) -> str:
    """The system whose links a tensor-parallel group's collectives are compiled over: the system itself
    where its links are listed, else its node's (a large TSP system is nodes of a ``tsp-node``)."""
    return system.name if system.simulated else system.figures.get("node_system", "")


def _widths(spec: ModelSpec, chips: int, system: SystemConfig | None = None) -> list:
    """Tensor-parallel widths that split the heads, K/V heads (or replicate them), MLP and hidden state evenly;
    on a system described by its figures, at most a node (its collectives are compiled on the node's links)."""
    if system is not None and not system.simulated:
        chips = min(chips, int(system.figures.get("node_chips", 1)) if system.figures.get("node_system") else 1)
    out = []
    width = 1
    while width <= min(chips, spec.heads):
        if spec.heads % width == 0 and (spec.kv_heads % width == 0 or width % spec.kv_heads == 0) \
                and spec.ffn % width == 0 and spec.hidden % width == 0:
            out.append(width)
        width *= 2
    return out


def shard_shape(spec: ModelSpec, width: int, batch: int, context: int, rows: int = 1, system: str = "") -> tuple:
    """``(BlockShape, experts a chip holds, the experts' placement in words)``: one chip's shard of a block,
    ``width`` chips wide (attention by heads, the MLP by its columns, a mixture's experts spread), its
    all-reduces over the chips of ``system`` the compiler would give them."""
    if spec.experts:
        expert_chips = max(width // spec.experts, 1)  # chips an expert is split over
        experts_per_chip = ceil(spec.experts / width)
        ffn_shard = spec.ffn // expert_chips
        placement = (f"{spec.experts} experts over {width} chips: "
                     + (f"each split over {expert_chips}" if width >= spec.experts else f"{experts_per_chip} a chip"))
    else:
        experts_per_chip, ffn_shard, placement = 1, spec.ffn // width, ""
    if spec.kv_heads < width:  # K/V heads replicated: each on the chips of the query heads that read it
        placement = "; ".join(filter(None, [placement, f"{spec.kv_heads} K/V heads replicated, each on "
                                            f"{width // spec.kv_heads} chips"]))
    shape = BlockShape(spec.hidden, spec.heads // width, max(spec.kv_heads // width, 1), spec.head_dim, ffn_shard,
                       rows, context, batch, spec.experts, system if width > 1 else "", width)
    return shape, experts_per_chip, placement


def evaluate(spec: ModelSpec, system: SystemConfig, dtype: str, stages: int, width: int, batch: int,
             context: int, prompt: int, ttft: bool = True, rows: int = 1) -> Mapping | None:
    """The figures of one mapping, or None when a shard does not fit its chip. A step decodes ``rows`` tokens a
    sequence (more than one: a speculative step verifying draft tokens)."""
    chip, hop = system.chip, system.hop_cycles
    item = DType.from_name(dtype).itemsize
    if stages > spec.layers:
        return None
    shape, experts_per_chip, placement = shard_shape(spec, width, batch, context, rows, _group_system(system))
    ffn_shard = shape.ffn
    try:
        if width > 1 and shape.system:
            from ..codegen.parallel.collectives import choose

            choose(load_system(shape.system), width)
    except CollectiveError:  # no group of ``width`` chips the compiler could run the collectives on
        return None
    block = block_cost(chip, shape, dtype)
    if block is None or block.streamed:
        return None
    if spec.experts:  # the other experts this chip holds add their weights, not their time (top-k run in parallel)
        extra = (experts_per_chip - 1) * 3 * spec.hidden * ffn_shard * item
    else:
        extra = 0
    per_stage = ceil(spec.layers / stages)
    head = head_cost(chip, spec.hidden, ceil(spec.vocab / width), batch * rows, dtype)
    if head is None or head.streamed:
        return None
    # every stage holds its layers' weights and caches; the last one the LM head as well, so it may take fewer.
    # The block is timed for the batch it works on; every user in flight keeps its cache on it. A full pipeline
    # has stages × batch users in flight; when their caches do not fit, fewer batches are in flight (the
    # pipeline idles part of the time), as many as fit
    room = chip.sram_bytes - max(block.activation_bytes, head.activation_bytes)
    for in_flight in range(stages, 0, -1):
        per_block = block.resident_bytes + extra \
            + (in_flight - 1) * batch * 2 * shape.kv_heads * context * spec.head_dim * item
        regular, last = room // per_block, (room - head.resident_bytes) // per_block
        if last >= 0 and (stages - 1) * regular + last >= spec.layers:
            break
    else:
        return None
    memory = min(per_stage, regular) * per_block + chip.sram_bytes - room
    memory = max(memory, min(last, spec.layers) * per_block + head.resident_bytes + chip.sram_bytes - room)
    hidden_bytes = batch * rows * spec.hidden * item
    hops = stage_hops(system, stages, width)
    blocks = spec.layers  # one token passes every layer once, stage after stage
    # a block's two all-reduces (a mixture of experts: the combine) are in its compiled cycles, as the
    # compiler emits them for the group (:mod:`~lpx_tvm.codegen.parallel.collectives`); between the stages
    # one hand-off of the hidden state (each chip of a stage to its counterpart in the next)
    handoff = ceil(hidden_bytes / chip.c2c_bytes_per_cycle)
    serial = (stages - 1) * handoff
    crossings = _rack_crossings(system, stages, width)
    hop_steps = (stages - 1 - crossings) * hops
    serial += crossings * system.figures.get("rack_hop_cycles", 0)
    network = hop_steps * hop + serial
    # users in flight: each stage takes the next user's step once it is done with one's (its buffers are
    # reused, step after step), so the busiest stage sets how often a step can start. The layers spread as
    # evenly as they go, the last stage (with the LM head) holding the fewer
    block_step = block.cycles
    fewer, more = divmod(spec.layers, stages)
    head_step = head_step_cycles(chip, spec.hidden, ceil(spec.vocab / width), batch * rows, dtype)
    period = max((fewer + (more > 0)) * block_step + (handoff if stages > 1 else 0),
                 fewer * block_step + (head.cycles if head_step is None else head_step))
    kv_bytes = per_stage * 2 * batch * rows * max(spec.kv_heads // width, 1) * spec.head_dim * 4  # fp32 from the host
    kv_write = ceil(kv_bytes / chip.host_bytes_per_cycle) + chip.latency_cycles["MEM"]
    compute = blocks * block.cycles + head.cycles
    per_token = compute + network + kv_write
    split = {"matrix": 0.0, "weight install": 0.0, "vector": 0.0, "SRAM": 0.0, "C2C links": 0.0, "latency": 0.0}
    for breakdown, times in ((block.breakdown, blocks), (head.breakdown, 1)):
        for bound, cycles in breakdown.items():
            key = _SPLIT_OF_BOUND.get(bound, "latency")
            split[key] = split.get(key, 0.0) + cycles * times
    scale = compute / max(sum(split.values()), 1)
    split = {k: v * scale for k, v in split.items()}
    split["C2C links"] += serial + hop_steps * hop  # (the stages' hand-offs)
    split["synchronisation"] = 0.0  # the static schedule aligns the chips: no barriers at run time
    split["KV write"] = kv_write
    prefill_shape = replace(shape, tokens=prompt, context=0, batch=1)
    prefill = block_cost(chip, prefill_shape, dtype, alone=True) if ttft else None
    ttft = None
    if prefill is not None and not prefill.streamed:
        pre_bytes = prompt * spec.hidden * item
        ttft = spec.layers * prefill.cycles + (stages - 1) * transfer_cycles(pre_bytes, hops, chip, hop) + head.cycles
    return Mapping(stages, width, batch, stages * width, per_token, ttft, split, memory, placement,
                   in_flight * batch, period)


def _check_sizes(**sizes) -> None:
    """Each of ``sizes`` a positive integer (``batches`` and ``mapping``: sequences of them; ``chips``,
    ``mapping``, ``users`` and ``prefill_chips`` may be None), else a :class:`PlanError` naming it."""
    for name, value in sizes.items():
        if value is None and name in ("chips", "mapping", "users", "prefill_chips"):
            continue
        wanted = {"batches": "positive integers", "mapping": "two positive integers"}.get(name, "a positive integer")
        try:
            many = tuple(value) if name in ("batches", "mapping") else (value,)
        except TypeError:  # not a sequence
            many = (None,)
        if any(isinstance(v, bool) or not isinstance(v, Integral) or v < 1 for v in many) \
                or (name == "mapping" and len(many) != 2):
            raise PlanError(f"{name} must be {wanted}, got {value!r}")
