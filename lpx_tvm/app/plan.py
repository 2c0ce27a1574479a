"""``lpx-tvm plan``: how many chips and racks an LLM needs for a decode speed, and what bounds it.

The numbers come from the compiler, not a roofline. For each tensor-parallel width T the planner builds
one shard of one block (:mod:`.plan_graph`: the graph lowering produces for the :mod:`.llama` decoder)
and runs the real codegen on the chip model (tile, alloc, list schedule, the timing-only simulator):
two consecutive blocks minus one gives a block's cycles in the middle of a stage, free of the program's
host transfers; the LM head's shard likewise. A pipeline of S stages × T chips then takes, per token:

    S × (L/S blocks + 2 all-reduces of the hidden state per block over the T chips)
      + (S − 1) stage-to-stage transfers + the LM head + writing the new K/V into the resident cache

where an all-reduce is a ring reduce-scatter and all-gather: 2(T − 1) steps, each a hop latency and
(bytes / T) at the link rate, as the system simulator times them (the hand-worked all-reduce test). The
weights, the KV cache for the context, and the activations are placed by the real allocator: a mapping
whose shard streams weights from the host, or does not fit, is not a mapping. Nothing is materialised:
the weights are zero-strided arrays the codegen never reads.

A mixture of experts places its experts over the T chips of a stage (T/E chips an expert when T ≥ E,
else E/T experts a chip); a token's top-k experts run side by side, and the MLP's all-reduce becomes a
dispatch and a combine of the hidden state.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from functools import lru_cache
from math import ceil, inf
from numbers import Integral, Real
from pathlib import Path

from ..runtime_sim import ChipConfig, DType
from ..runtime_sim.system import SystemConfig, load_system
from ..codegen.parallel.collectives import CollectiveError
from .plan_graph import BlockShape, block_graph, head_graph


# Hugging Face config.json keys the plan reads, and keys it knows and does not need
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


class PlanError(ValueError):
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
    SRAM rate, and two all-reduces of the hidden state, each the hops across the group's diameter (one within a
    node or a fully connected system, two across a grid of nodes) and its bytes over the links a pair has.
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
    node = _node_chips(system)
    best = None
    for width in _widths(spec, chips, system):
        stages = max(1, ceil(total / (width * chip.sram_bytes)))
        if stages * width > chips or stages > spec.layers:
            continue
        hops = 1 if width <= node else 2
        links = _links_a_pair(system, width)
        parts = {"weights": spec.layers * ceil(layer_weights / width / install),
                 "KV cache": spec.layers * ceil(kv / min(width, spec.kv_heads) / sram),
                 "collectives": spec.layers * 2 * (hops * system.hop_cycles
                                                   + ceil(hidden / width / (links * chip.c2c_bytes_per_cycle))),
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


def _node_chips(system: SystemConfig) -> int:
    """Chips joined all to all: the whole system where it is fully connected, else a node."""
    if system.topology == "fully-connected":
        return system.chips
    return int(system.figures.get("node_chips") or (system.chips if not system.links else
                                                    max(len(system.neighbours(0)), 1)))


def _links_a_pair(system: SystemConfig, width: int) -> int:
    """Links between two chips of a group of ``width`` (the first chips of the system or of its node)."""
    if system.links and width > 1:
        return max(len(system.links_between(0, 1)), 1)
    return 1


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


def plan(model, system="tsp-rack", dtype: str = "fp16", context: int = 4096, prompt: int = 512, batch: int = 1,
         chips: int | None = None, target_tps_per_user: float | None = None, batches=(1,),
         mapping: tuple | None = None, progress=None, users: int | None = None,
         target_ttft_ms: float | None = None, draft=None, draft_tokens: int | None = None,
         accept_rate: float | None = None, prefill_chips: int | None = None, verify: bool = False) -> dict:
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
    spec = model_spec(model)
    system = load_system(system)
    chip = system.chip
    chip.check_dtype(dtype)
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
            from ..codegen.parallel.collectives import choose

            try:
                choose(load_system(_group_system(system)), mapping[1])
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
            "cache_bytes": spec.cache_bytes(context, chosen.users, dtype),
            "chips": chips, "racks": ceil(chips / per_rack),
            "mapping": {"pipeline_stages": chosen.stages, "tensor_parallel": chosen.width,
                        "layers_per_stage": ceil(spec.layers / chosen.stages), "experts": chosen.expert_placement,
                        "why": why},
            **best, "tokens_per_s_per_rack": best["tokens_per_s"] / max(ceil(chips / per_rack), 1),
            **_power(system.chip, chips, best["tokens_per_s"]),
            "split_cycles": split, "bottleneck": bottleneck, **floors, "frontier": frontier, "plan_s": seconds,
            "not_static": NOT_STATIC,
            **({"prefill_pool": pooled, "decode_chips": chosen.chips} if pooled is not None else {})}


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


def table(report: dict) -> str:
    """The plan as text: the chosen mapping and its split, then the frontier."""
    from tabulate import tabulate

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
    return head + "\n\n" + tabulate(rows, headers=["chips", "stages×TP", "batch", "users", "µs a token", "tokens/s per user",
                                                   "tokens/s per chip"], tablefmt="github")


def frontier(rows: list) -> list:
    """The rows no other beats on both tokens/s per user and tokens/s per chip."""
    from .cost import pareto_front

    negated = [{"u": -r["tokens_per_s_per_user"], "c": -r["tokens_per_s_per_chip"]} for r in rows]
    return [rows[k] for k in pareto_front(negated, "c", "u")]


def write_json(report: dict, path) -> None:
    Path(path).write_text(json.dumps(report, indent=1, default=float))

