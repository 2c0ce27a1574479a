"""Llama-style decoders built offline with onnx.helper and seeded weights: a prefill and a decode graph.

The graphs follow the Hugging Face ONNX export naming (``input_ids``, ``attention_mask``,
``past_key_values.{i}.key`` / ``.value`` in, ``logits`` and ``present.{i}.key`` / ``.value`` out) but
with a **static cache**:

- ``build_prefill(config, prompt_len)`` runs a whole prompt (positions ``0 .. prompt_len-1``) and returns
  its logits and every layer's K/V for those positions (``present.*``, ``[1, kv_heads, prompt_len,
  head_dim]``).
- ``build_decode(config)`` runs one token against the whole fixed-capacity cache
  (``past_key_values.*``, ``[1, kv_heads, max_context, head_dim]``). It concatenates the cache with the
  new token's own K/V along the sequence axis (``max_context + 1`` slots); ``attention_mask``
  (``[1, 1, 1, max_context]``, additive: 0 for a valid slot, ``MASK_VALUE`` = -1e4 for an empty one,
  fp16-safe) covers the cache slots, and the new slot is always valid. ``present.*`` holds ONLY the new
  token's K/V (``[1, kv_heads, 1, head_dim]``); the caller writes it into the cache at the token's
  position (:func:`write_cache`).

Why static: LPX is a statically scheduled chip, so every tensor has one shape for the life of a
compiled program; a cache that grows by one slot per step would need a new program per step. Here the
cache has its final size from the first step, stays resident, and a step writes only the new token's
K/V, which is also all a step has to send back. Positions enter as data only: the rotary tables
(``rope_cos``, ``rope_sin``, ``[seq, head_dim]``) are graph inputs the host computes with
:func:`rope_tables`, and the valid cache slots are the mask (:func:`decode_mask`), so one decode
graph serves every position.

The architecture is Llama's: pre-RMSNorm blocks, written out as ``x * 1/sqrt(mean(x*x) + eps) * w``
(ONNX's RMSNormalization is too new for TVM's importer); rotary embeddings in the rotate-half
convention (HF Llama), where ``rotate_half(x)`` is ``x @ R`` with a constant signed permutation ``R``
(a MatMul rather than Slice/Neg/Concat, so it runs on the matrix unit); grouped-query attention
without repeating K/V: the ``num_heads / num_kv_heads`` query heads that share a K/V head are stacked
along the sequence axis (``[1, kv_heads, n_rep * seq, head_dim]``), one MatMul per K/V head computes
all their scores, and the result is reshaped back (the same arithmetic as HF's ``repeat_kv``);
a SwiGLU MLP ``down(silu(gate(x)) * up(x))`` with ``silu(x) = x * Sigmoid(x)``; no biases; an LM head
that is either its own matrix or the transposed embedding table (``tie_word_embeddings``).

Ops used: Gather (embedding, on the host), MatMul, Add, Mul, ReduceMean, Sqrt, Reciprocal, Sigmoid,
Softmax, Reshape (constant shapes), Transpose, Concat (decode only), Cast (fp16 only), Identity (to name
the outputs); opset 17, every tensor static. In fp16 graphs the RMSNorm statistics and the softmax run
in fp32 (Cast around them), as HF Llama does; the weights, matmuls and cache are fp16.

On lpx: ``lpx_tvm.compile(build_decode(config), config="tsp")`` offloads everything but the embedding
Gather. TVM's importer renames inputs (``past_key_values.0.key`` becomes ``past_key_values_0_key``), so
call a compiled graph with its inputs by position, in the ONNX graph's input order. lpx runs fp32 Relax
tensors only: for fp16 on the chip compile the fp32 graph with ``dtype="fp16"`` (an fp16 graph compiles
but stays on the host).

Weights are seeded (``numpy.random.default_rng(seed)``) and drawn in a fixed order in fp32, then cast,
so the same seed gives the same weights to the prefill and decode graphs and to the fp32 and fp16
graphs. Scales keep activations O(1) through many layers: q/k/v/gate/up ``N(0, 1/d_in)``, o/down
``N(0, 1/(d_in * 2 * num_layers))`` (2 * num_layers residual increments sum to O(1)), embedding
``N(0, 1/hidden)`` (rows of norm ~1; tied, the logits stay O(1)), RMSNorm weights ``1 + N(0, 0.05²)``,
untied LM head ``N(0, 1/hidden)``. Initializers carry the HF parameter names
(``model.layers.{i}.self_attn.q_proj.weight``, ...); linear weights are stored ``[in, out]`` (the
transpose of PyTorch's layout) so that ``y = x @ W``.

Weights may be narrower than the graph: drawn in fp16 for an fp32 graph, each is widened by a Cast where it is
read (lpx keeps the fp16 bytes on fp16 chips; ONNX Runtime widens them at run time), so the graph's weights
are exactly the chips'. And they may be held apart from the graphs (``external=True``): each initializer is
ONNX external data (:data:`WEIGHTS_FILE`, an offset and a length) with no bytes in the graph, and the caller
passes the arrays to :func:`ort_sessions` and ``lpx_tvm.compile(..., weights=)``, which read them in place.
One draw then serves both graphs, ONNX Runtime and TVM, with no copy and no 2 GB protobuf limit.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import uses_external_data

from ...runtime_sim.program import aligned_copy
from ...runtime_sim.errors import LpxUserError

OPSET = 17
IR_VERSION = 8
MASK_VALUE = -1e4  # additive mask for an empty slot: exp() underflows to 0, and fp16 can hold it
_DTYPES = {"fp32": (np.float32, TensorProto.FLOAT), "fp16": (np.float16, TensorProto.FLOAT16)}


# ---------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class LlamaConfig:
    """A Llama-style decoder's dimensions.

    Parameters
    ----------
    hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, vocab_size : int
        ``num_heads`` must be a multiple of ``num_kv_heads`` (grouped-query attention) and
        ``hidden_size`` of ``num_heads``, with an even head dimension (rotary pairs).
    rope_theta : float
        Rotary base.
    rms_norm_eps : float
    tie_word_embeddings : bool
        LM head = transposed embedding table.
    max_context : int
        Static KV-cache capacity (positions ``0 .. max_context-1``).
    dtype : str
        ``"fp32"`` or ``"fp16"``: weights and activations of the ONNX graphs.
    head_size : int
        Each head's width, where it is not ``hidden_size / num_heads`` (0: it is): as Hugging Face's
        ``head_dim``, and as one chip's shard of a tensor-parallel block has it (fewer heads, the whole hidden).
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_context: int = 64
    dtype: str = "fp32"
    head_size: int = 0

    def __post_init__(self):
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                     "vocab_size", "max_context"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
                raise LpxUserError(f"LlamaConfig.{name} must be a positive integer, got {value!r}")
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)) or not value > 0:
                raise LpxUserError(f"LlamaConfig.{name} must be a positive number, got {value!r}")
        if not isinstance(self.tie_word_embeddings, (bool, np.bool_)):
            raise LpxUserError(f"LlamaConfig.tie_word_embeddings must be a bool, got {self.tie_word_embeddings!r}")
        if self.dtype not in _DTYPES:
            raise LpxUserError(f"LlamaConfig.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if isinstance(self.head_size, bool) or not isinstance(self.head_size, (int, np.integer)) or self.head_size < 0:
            raise LpxUserError(f"LlamaConfig.head_size must be a non-negative integer, got {self.head_size!r}")
        if not self.head_size and self.hidden_size % self.num_heads:
            raise LpxUserError(f"LlamaConfig.num_heads ({self.num_heads}) must divide hidden_size "
                               f"({self.hidden_size})")
        if self.num_heads % self.num_kv_heads:
            raise LpxUserError(f"LlamaConfig.num_kv_heads ({self.num_kv_heads}) must divide num_heads "
                               f"({self.num_heads}) for grouped-query attention")
        if self.head_dim % 2:
            raise LpxUserError(f"LlamaConfig.num_heads: head_dim = {self.head_dim} (hidden_size / num_heads, or "
                               "head_size) must be even (rotary embeddings rotate pairs)")

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden_size // self.num_heads

    @property
    def num_rep(self) -> int:
        """Query heads per K/V head."""
        return self.num_heads // self.num_kv_heads

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(_DTYPES[self.dtype][0])

    def replace(self, **changes) -> "LlamaConfig":
        """A copy with some fields changed (validated again)."""
        return LlamaConfig(**{**asdict(self), **changes})

    def layer_parameter_count(self) -> int:
        h, d, i = self.hidden_size, self.head_dim, self.intermediate_size
        attention = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2  # q, o; k, v
        return attention + 3 * h * i + 2 * h  # gate, up, down; two RMSNorm weights

    def parameter_count(self) -> int:
        """Parameters (embedding, layers, final norm, untied LM head); no biases, as in Llama."""
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return embed + self.num_layers * self.layer_parameter_count() + self.hidden_size + head

    def weight_bytes(self) -> int:
        """Bytes of the parameters in ``dtype`` (the graphs' constants besides them are a head_dim² rotary
        matrix and, in prefill, the causal mask)."""
        return self.parameter_count() * self.np_dtype.itemsize

    def cache_bytes(self) -> int:
        """Bytes of the whole static K/V cache."""
        return 2 * self.num_layers * self.num_kv_heads * self.max_context * self.head_dim * self.np_dtype.itemsize


PRESETS = {
    "llama-tiny": LlamaConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                              vocab_size=256, max_context=64),
    "llama-small": LlamaConfig(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=512,
                               vocab_size=1024, max_context=128),
    # GPT-2 small's dimensions. SwiGLU has three matrices, so ffn 2048 gives the same MLP parameters as GPT-2's
    # two 768x3072 matrices (3 * 768 * 2048 = 2 * 768 * 3072); 162.1 M parameters untied, 324.3 MB in fp16.
    "llama-gpt2s": LlamaConfig(hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=12,
                               intermediate_size=2048, vocab_size=50257, max_context=1024,
                               tie_word_embeddings=False, dtype="fp16"),
    # Llama 3.2 1B's blocks (hidden 2048, 16 layers, 32 heads, 8 K/V heads, FFN 8192, tied head) with Llama 2's
    # 32,000-token vocabulary: 1.04 B parameters, 2.08 GB in fp16
    "llama-1b": LlamaConfig(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, intermediate_size=8192,
                            vocab_size=32000, rope_theta=500000.0, max_context=2048, tie_word_embeddings=True,
                            dtype="fp16"),
}


def get_config(config_or_name) -> LlamaConfig:
    """A :class:`LlamaConfig` from itself or a preset name."""
    if isinstance(config_or_name, LlamaConfig):
        return config_or_name
    if isinstance(config_or_name, str) and config_or_name in PRESETS:
        return PRESETS[config_or_name]
    raise LpxUserError(f"unknown llama config {config_or_name!r}; presets: {', '.join(PRESETS)}")


# ---------------------------------------------------------------------------
# host-side helpers: rotary tables, the static cache, the mask, feeds
# ---------------------------------------------------------------------------
def rope_tables(config, positions) -> tuple[np.ndarray, np.ndarray]:
    """``(cos, sin)``, each ``[len(positions), head_dim]`` in the config's dtype (rotate-half layout: the
    frequencies repeated twice, as HF Llama)."""
    config = get_config(config)
    pos = np.asarray(positions, dtype=np.float64).reshape(-1)
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    angles = np.outer(pos, inv_freq)
    angles = np.concatenate([angles, angles], axis=-1)
    return np.cos(angles).astype(config.np_dtype), np.sin(angles).astype(config.np_dtype)


def cache_names(config) -> list[str]:
    """The decode graph's cache inputs in order: ``past_key_values.{i}.key``, ``past_key_values.{i}.value``."""
    config = get_config(config)
    return [f"past_key_values.{i}.{kind}" for i in range(config.num_layers) for kind in ("key", "value")]


def present_names(config) -> list[str]:
    """``present.{i}.key``, ``present.{i}.value`` in output order (after ``logits``)."""
    config = get_config(config)
    return [f"present.{i}.{kind}" for i in range(config.num_layers) for kind in ("key", "value")]


def output_names(config) -> list[str]:
    """Both graphs' outputs in order."""
    return ["logits"] + present_names(config)


def initial_cache(config) -> dict[str, np.ndarray]:
    """An empty static cache: ``{past_key_values.{i}.key|value: zeros [1, kv_heads, max_context, head_dim]}``."""
    config = get_config(config)
    shape = (1, config.num_kv_heads, config.max_context, config.head_dim)
    return {name: np.zeros(shape, config.np_dtype) for name in cache_names(config)}


def write_cache(cache: dict, presents, position: int) -> dict:
    """Write ``presents`` (``{present.{i}.key|value: [1, kv, n, head_dim]}``, or a list in
    :func:`present_names` order) into ``cache`` slots ``position .. position+n-1``, in place; returns it."""
    if not isinstance(presents, dict):
        names = [n.replace("past_key_values.", "present.", 1) for n in cache]
        presents = dict(zip(names, presents, strict=True))
    for name, array in cache.items():
        new = presents[name.replace("past_key_values.", "present.", 1)]
        n = new.shape[2]
        if position < 0 or position + n > array.shape[2]:
            raise LpxUserError(f"cache positions {position}..{position + n - 1} are outside its capacity "
                               f"{array.shape[2]}")
        array[:, :, position:position + n, :] = new
    return cache


def decode_mask(config, position: int) -> np.ndarray:
    """The decode graph's ``attention_mask`` for a token at ``position``: cache slots ``0 .. position-1``
    valid (0), the rest ``MASK_VALUE``; ``[1, 1, 1, max_context]`` in the config's dtype."""
    config = get_config(config)
    if not 0 <= position < config.max_context:
        raise LpxUserError(f"position {position} is outside the cache (max_context {config.max_context})")
    mask = np.full((1, 1, 1, config.max_context), MASK_VALUE, config.np_dtype)
    mask[..., :position] = 0
    return mask


def prefill_feeds(config, prompt_ids) -> dict[str, np.ndarray]:
    """Inputs of the prefill graph for a prompt (positions ``0 .. len-1``)."""
    config = get_config(config)
    ids = np.asarray(prompt_ids, dtype=np.int64).reshape(1, -1)
    cos, sin = rope_tables(config, np.arange(ids.shape[1]))
    return {"input_ids": ids, "rope_cos": cos, "rope_sin": sin}


def decode_feeds(config, token: int, position: int, cache: dict) -> dict[str, np.ndarray]:
    """Inputs of the decode graph for ``token`` at ``position`` with the current cache."""
    config = get_config(config)
    cos, sin = rope_tables(config, [position])
    feeds = {"input_ids": np.array([[token]], np.int64), "rope_cos": cos, "rope_sin": sin,
             "attention_mask": decode_mask(config, position)}
    feeds.update(cache)
    return feeds


# ---------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------
def llama_weights(config, seed: int = 0) -> dict[str, np.ndarray]:
    """The seeded parameters by HF name (linear weights ``[in, out]``), in the config's dtype.

    Drawn in fp32 in a fixed order, so a seed gives the same values whatever the graph or dtype; each
    array 64-byte aligned.
    """
    config = get_config(config)
    rng = np.random.default_rng(seed)
    h, d, i, n_layers = config.hidden_size, config.head_dim, config.intermediate_size, config.num_layers
    out = {}

    def draw(name, shape, std, mean=0.0):
        value = rng.standard_normal(shape, dtype=np.float32)
        value *= np.float32(std)
        value += np.float32(mean)
        out[name] = aligned_copy(value, config.np_dtype)  # (aligned: TVM binds it in place)

    draw("model.embed_tokens.weight", (config.vocab_size, h), h ** -0.5)
    residual = 1.0 / np.sqrt(2.0 * n_layers)
    for layer in range(n_layers):
        p = f"model.layers.{layer}."
        draw(p + "input_layernorm.weight", (h,), 0.05, 1.0)
        draw(p + "self_attn.q_proj.weight", (h, config.num_heads * d), h ** -0.5)
        draw(p + "self_attn.k_proj.weight", (h, config.num_kv_heads * d), h ** -0.5)
        draw(p + "self_attn.v_proj.weight", (h, config.num_kv_heads * d), h ** -0.5)
        draw(p + "self_attn.o_proj.weight", (config.num_heads * d, h), (config.num_heads * d) ** -0.5 * residual)
        draw(p + "post_attention_layernorm.weight", (h,), 0.05, 1.0)
        draw(p + "mlp.gate_proj.weight", (h, i), h ** -0.5)
        draw(p + "mlp.up_proj.weight", (h, i), h ** -0.5)
        draw(p + "mlp.down_proj.weight", (i, h), i ** -0.5 * residual)
    draw("model.norm.weight", (h,), 0.05, 1.0)
    if not config.tie_word_embeddings:
        draw("lm_head.weight", (h, config.vocab_size), h ** -0.5)
    return out


def rotate_half_matrix(head_dim: int, dtype=np.float32) -> np.ndarray:
    """``R`` with ``x @ R == concat(-x[..., d/2:], x[..., :d/2])`` (HF's ``rotate_half``)."""
    half = head_dim // 2
    r = np.zeros((head_dim, head_dim), dtype)
    r[np.arange(half) + half, np.arange(half)] = -1
    r[np.arange(half), np.arange(half) + half] = 1
    return r


# ---------------------------------------------------------------------------
# graph construction
# ---------------------------------------------------------------------------
WEIGHTS_FILE = "weights.bin"  # where the external-data initializers of a decoder's graphs say their bytes are


def external_initializer(name: str, array: np.ndarray, offset: int) -> TensorProto:
    """An initializer whose bytes are held apart: ``array``'s dtype and shape, at ``offset`` in
    :data:`WEIGHTS_FILE` (ONNX's external data), no data in the graph."""
    tensor = TensorProto(name=name, dims=array.shape, data_type=helper.np_dtype_to_tensor_dtype(array.dtype),
                         data_location=TensorProto.EXTERNAL)
    for key, value in (("location", WEIGHTS_FILE), ("offset", str(offset)), ("length", str(array.nbytes))):
        tensor.external_data.add(key=key, value=value)
    return tensor


def weight_offsets(weights: dict) -> dict:
    """Name ─► byte offset of each weight in :data:`WEIGHTS_FILE`: in order, each on a 4 KiB boundary (so
    that a memory map of the file gives aligned arrays)."""
    offsets, at = {}, 0
    for name, value in weights.items():
        offsets[name] = at
        at += -(-value.nbytes // 4096) * 4096
    return offsets


class _Graph:
    """Nodes and initializers of one graph; ``op`` returns its output's name.

    A weight narrower than the graph's dtype (fp16 in an fp32 graph: what the chips store) is widened by a
    Cast where it is read. ``external``: the weights are external-data initializers (the caller holds the
    arrays: the graph takes no copy of them).
    """

    def __init__(self, config: LlamaConfig, weights: dict, external: bool = False):
        self.config = config
        self.dtype = config.np_dtype
        self.elem = _DTYPES[config.dtype][1]
        self.nodes, self.inits, self.count, self.widened = [], [], 0, {}
        self.narrow = {name for name, value in weights.items() if value.dtype.itemsize < self.dtype.itemsize}
        offsets = weight_offsets(weights) if external else {}
        for name, value in weights.items():
            self.inits.append(external_initializer(name, value, offsets[name]) if external
                              else numpy_helper.from_array(value, name))

    def weight(self, name: str) -> str:
        """A weight as the graph computes with it: a narrow one widened (one Cast, however often read)."""
        if name not in self.narrow:
            return name
        if name not in self.widened:
            self.widened[name] = self.op("Cast", [name], to=self.elem)
        return self.widened[name]

    def name(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}_{self.count}"

    def const(self, value, prefix: str = "const") -> str:
        name = self.name(prefix)
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def scalar(self, value: float) -> str:
        return self.const(np.asarray(value, self.dtype), "scalar")

    def shape(self, dims) -> str:
        return self.const(np.array(dims, np.int64), "shape")

    def op(self, op_type: str, inputs, prefix: str | None = None, **attrs) -> str:
        out = self.name(prefix or op_type.lower())
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=f"{out}/{op_type}", **attrs))
        return out

    def output(self, source: str, name: str) -> None:
        self.nodes.append(helper.make_node("Identity", [source], [name], name=f"{name}/Identity"))

    # --- layers ---
    def to_fp32(self, x: str) -> str:
        return x if self.dtype == np.float32 else self.op("Cast", [x], to=TensorProto.FLOAT)

    def from_fp32(self, x: str) -> str:
        return x if self.dtype == np.float32 else self.op("Cast", [x], to=self.elem)

    def rms_norm(self, x: str, weight: str) -> str:
        """``x * 1/sqrt(mean(x*x) + eps) * weight`` (statistics in fp32)."""
        x32 = self.to_fp32(x)
        mean_sq = self.op("ReduceMean", [self.op("Mul", [x32, x32])], axes=[-1], keepdims=1)
        eps = self.const(np.float32(self.config.rms_norm_eps), "eps")
        inv = self.op("Reciprocal", [self.op("Sqrt", [self.op("Add", [mean_sq, eps])])])
        return self.op("Mul", [self.from_fp32(self.op("Mul", [x32, inv])), self.weight(weight)])

    def heads(self, x: str, seq: int, n_heads: int) -> str:
        """``[1, seq, n*d]`` ─► ``[1, n, seq, d]``."""
        d = self.config.head_dim
        return self.op("Transpose", [self.op("Reshape", [x, self.shape([1, seq, n_heads, d])])], perm=[0, 2, 1, 3])

    def rope(self, x: str, cos: str, sin: str, rot: str) -> str:
        """``x * cos + rotate_half(x) * sin`` on ``[1, n, seq, d]`` with ``cos``/``sin`` ``[seq, d]``."""
        rotated = self.op("MatMul", [x, rot])
        return self.op("Add", [self.op("Mul", [x, cos]), self.op("Mul", [rotated, sin])])

    def attention(self, x: str, layer: int, seq: int, cos: str, sin: str, rot: str, mask: str,
                  past: tuple[str, str] | None) -> tuple[str, str, str]:
        """Self-attention of ``x`` ``[1, seq, hidden]``; returns (output, new K, new V).

        ``past`` (decode): the cache K/V, concatenated before the new K/V. ``mask``: added to the scores
        ``[1, kv, n_rep*seq, slots]`` (broadcast).
        """
        c, p = self.config, f"model.layers.{layer}.self_attn."
        d, kv, rep = c.head_dim, c.num_kv_heads, c.num_rep
        project = lambda name: self.op("MatMul", [x, self.weight(p + name)])
        q = self.rope(self.heads(project("q_proj.weight"), seq, c.num_heads), cos, sin, rot)
        k = self.rope(self.heads(project("k_proj.weight"), seq, kv), cos, sin, rot)
        v = self.heads(project("v_proj.weight"), seq, kv)
        keys, values = k, v
        if past is not None:
            keys = self.op("Concat", [past[0], k], axis=2)
            values = self.op("Concat", [past[1], v], axis=2)
        # grouped-query attention: the rep query heads of one K/V head stacked along the sequence axis
        grouped = q if rep == 1 else self.op("Reshape", [q, self.shape([1, kv, rep * seq, d])])
        scores = self.op("MatMul", [grouped, self.op("Transpose", [keys], perm=[0, 1, 3, 2])])
        scores = self.op("Add", [self.op("Mul", [scores, self.scalar(1.0 / np.sqrt(d))]), mask])
        probs = self.from_fp32(self.op("Softmax", [self.to_fp32(scores)], axis=-1))
        context = self.op("MatMul", [probs, values])  # [1, kv, rep*seq, d]
        if rep != 1:
            context = self.op("Reshape", [context, self.shape([1, c.num_heads, seq, d])])
        merged = self.op("Reshape", [self.op("Transpose", [context], perm=[0, 2, 1, 3]),
                                     self.shape([1, seq, c.num_heads * d])])
        return self.op("MatMul", [merged, self.weight(p + "o_proj.weight")]), k, v

    def mlp(self, x: str, layer: int) -> str:
        p = f"model.layers.{layer}.mlp."
        gate = self.op("MatMul", [x, self.weight(p + "gate_proj.weight")])
        silu = self.op("Mul", [gate, self.op("Sigmoid", [gate])])
        up = self.op("MatMul", [x, self.weight(p + "up_proj.weight")])
        return self.op("MatMul", [self.op("Mul", [silu, up]), self.weight(p + "down_proj.weight")])

    def decoder(self, seq: int, mask: str, past: list | None) -> None:
        """The whole network from ``input_ids`` to the ``logits`` and ``present.*`` outputs."""
        c = self.config
        rot = self.const(rotate_half_matrix(c.head_dim, self.dtype), "rotate_half")
        x = self.op("Gather", ["model.embed_tokens.weight", "input_ids"], axis=0)
        if "model.embed_tokens.weight" in self.narrow:  # the rows looked up, widened (not the whole table)
            x = self.op("Cast", [x], to=self.elem)
        for layer in range(c.num_layers):
            p = f"model.layers.{layer}."
            attn, k, v = self.attention(self.rms_norm(x, p + "input_layernorm.weight"), layer, seq, "rope_cos",
                                        "rope_sin", rot, mask, None if past is None else past[layer])
            x = self.op("Add", [x, attn])
            x = self.op("Add", [x, self.mlp(self.rms_norm(x, p + "post_attention_layernorm.weight"), layer)])
            self.output(k, f"present.{layer}.key")
            self.output(v, f"present.{layer}.value")
        x = self.rms_norm(x, "model.norm.weight")
        head = (self.op("Transpose", [self.weight("model.embed_tokens.weight")], perm=[1, 0])
                if c.tie_word_embeddings else self.weight("lm_head.weight"))
        self.output(self.op("MatMul", [x, head]), "logits")

    def model(self, name: str, inputs: list, seq: int) -> onnx.ModelProto:
        c = self.config
        info = lambda n, elem, shape: helper.make_tensor_value_info(n, elem, shape)
        present = [1, c.num_kv_heads, seq, c.head_dim]
        outputs = [info("logits", self.elem, [1, seq, c.vocab_size])]
        outputs += [info(n, self.elem, present) for n in present_names(c)]
        graph = helper.make_graph(self.nodes, name, inputs, outputs, self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                  producer_name="lpx_tvm.app.models.llama")
        model.ir_version = IR_VERSION
        helper.set_model_props(model, {"llama_config": json.dumps(asdict(c))})
        return model


def _check_seq(config: LlamaConfig, prompt_len) -> int:
    if isinstance(prompt_len, bool) or not isinstance(prompt_len, (int, np.integer)) or prompt_len <= 0:
        raise LpxUserError(f"prompt_len must be a positive integer, got {prompt_len!r}")
    if prompt_len > config.max_context:
        raise LpxUserError(f"prompt_len {prompt_len} exceeds max_context {config.max_context}")
    return int(prompt_len)


_PROTOBUF_LIMIT = 2 ** 31  # bytes: a serialised ONNX model holding its weights inside must stay under 2 GB


def _graph(config, seed: int, weights: dict | None, external: bool) -> _Graph:
    """A graph's initializers, after refusing (before drawing any weight) weights protobuf cannot hold."""
    if external and weights is None:
        raise LpxUserError("external=True keeps the weights apart from the graph: pass the arrays (weights=)")
    nbytes = config.weight_bytes() if weights is None else sum(w.nbytes for w in weights.values())
    if not external and nbytes >= _PROTOBUF_LIMIT:
        raise LpxUserError(f"a decoder of {config.parameter_count() / 1e9:.2f} B parameters holds "
                           f"{nbytes / 1e9:.2f} GB of weights, past ONNX's 2 GB limit on a model with its weights "
                           "inside; build it with external=True (its weights held apart, as generate does), or size "
                           "it with lpx-tvm plan, which needs no graph")
    return _Graph(config, llama_weights(config, seed) if weights is None else weights, external)


def build_prefill(config, prompt_len: int, seed: int = 0, weights: dict | None = None,
                  external: bool = False) -> onnx.ModelProto:
    """The prefill graph for a prompt of ``prompt_len`` tokens (positions ``0 .. prompt_len-1``).

    Inputs: ``input_ids`` int64 ``[1, prompt_len]``, ``rope_cos`` / ``rope_sin`` ``[prompt_len, head_dim]``
    (:func:`rope_tables`). Outputs: ``logits`` ``[1, prompt_len, vocab]``, ``present.{i}.key`` /
    ``.value`` ``[1, kv_heads, prompt_len, head_dim]``. The causal mask is a constant. ``weights``: what
    :func:`llama_weights` draws for ``config`` and ``seed``, where the caller holds them already (one draw serves
    a model's prefill and decode graphs); drawn in fp16 for an fp32 graph, the graph widens them where it reads
    them. ``external``: the graph holds the given weights as external data (:data:`WEIGHTS_FILE`), not their
    bytes: no copy, and no 2 GB limit; pass the same arrays to ONNX Runtime (:func:`ort_sessions`) and to
    ``lpx_tvm.compile(..., weights=)``.
    """
    config = get_config(config)
    seq = _check_seq(config, prompt_len)
    g = _graph(config, seed, weights, external)
    causal = np.triu(np.full((seq, seq), MASK_VALUE, np.float32), k=1)
    mask = g.const(np.tile(causal, (config.num_rep, 1)).astype(g.dtype), "causal_mask")  # [rep*seq, seq]
    g.decoder(seq, mask, past=None)
    d = config.head_dim
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, seq]),
              helper.make_tensor_value_info("rope_cos", g.elem, [seq, d]),
              helper.make_tensor_value_info("rope_sin", g.elem, [seq, d])]
    return g.model(f"llama_prefill_{seq}", inputs, seq)


def build_decode(config, seed: int = 0, weights: dict | None = None, external: bool = False) -> onnx.ModelProto:
    """The one-token decode graph over the static cache (see the module docstring).

    Inputs: ``input_ids`` int64 ``[1, 1]``, ``rope_cos`` / ``rope_sin`` ``[1, head_dim]``,
    ``attention_mask`` ``[1, 1, 1, max_context]`` (:func:`decode_mask`), ``past_key_values.{i}.key`` /
    ``.value`` ``[1, kv_heads, max_context, head_dim]``. Outputs: ``logits`` ``[1, 1, vocab]``,
    ``present.{i}.key`` / ``.value`` ``[1, kv_heads, 1, head_dim]`` (the new token's only). ``weights`` and
    ``external``: as for :func:`build_prefill`.
    """
    config = get_config(config)
    g = _graph(config, seed, weights, external)
    # the cache slots' mask, then the new token's own slot (always valid): [1, 1, 1, max_context + 1]
    mask = g.op("Concat", ["attention_mask", g.const(np.zeros((1, 1, 1, 1), g.dtype), "self_slot")], axis=3)
    names = cache_names(config)
    g.decoder(1, mask, past=[(names[2 * i], names[2 * i + 1]) for i in range(config.num_layers)])
    d, cache = config.head_dim, [1, config.num_kv_heads, config.max_context, config.head_dim]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, 1]),
              helper.make_tensor_value_info("rope_cos", g.elem, [1, d]),
              helper.make_tensor_value_info("rope_sin", g.elem, [1, d]),
              helper.make_tensor_value_info("attention_mask", g.elem, [1, 1, 1, config.max_context])]
    inputs += [helper.make_tensor_value_info(n, g.elem, cache) for n in names]
    return g.model("llama_decode", inputs, 1)


def build_prefill_blocks(config, prompt_len: int, seed: int = 0) -> onnx.ModelProto:
    """The prefill's decoder blocks alone, from the embedded prompt to the final norm: what a long prompt
    costs the chip (the embedding lookup is a host gather, and a prefill needs only the last position's
    logits). Input ``hidden_states`` ``[1, prompt_len, hidden]``, output ``hidden`` of the same shape; the
    rotary tables (positions ``0 .. prompt_len-1``) and the causal mask are constants."""
    config = get_config(config)
    seq = _check_seq(config, prompt_len)
    weights = {k: v for k, v in llama_weights(config, seed).items()
               if k not in ("model.embed_tokens.weight", "lm_head.weight")}
    g = _Graph(config, weights)
    cos, sin = rope_tables(config, range(seq))
    g.inits += [numpy_helper.from_array(cos, "rope_cos"), numpy_helper.from_array(sin, "rope_sin")]
    causal = np.triu(np.full((seq, seq), MASK_VALUE, np.float32), k=1)
    mask = g.const(np.tile(causal, (config.num_rep, 1)).astype(g.dtype), "causal_mask")
    rot = g.const(rotate_half_matrix(config.head_dim, g.dtype), "rotate_half")
    x = "hidden_states"
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}."
        attn, _, _ = g.attention(g.rms_norm(x, p + "input_layernorm.weight"), layer, seq, "rope_cos", "rope_sin",
                                 rot, mask, None)
        x = g.op("Add", [x, attn])
        x = g.op("Add", [x, g.mlp(g.rms_norm(x, p + "post_attention_layernorm.weight"), layer)])
    g.output(g.rms_norm(x, "model.norm.weight"), "hidden")
    shape = [1, seq, config.hidden_size]
    graph = helper.make_graph(g.nodes, f"llama_prefill_blocks_{seq}",
                              [helper.make_tensor_value_info("hidden_states", g.elem, shape)],
                              [helper.make_tensor_value_info("hidden", g.elem, shape)], g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="lpx_tvm.app.models.llama")
    model.ir_version = IR_VERSION
    return model


def save_llama(config_or_name, directory, prompt_len: int, seed: int = 0) -> dict[str, Path]:
    """Write ``prefill.onnx`` (for ``prompt_len`` tokens), ``decode.onnx``, the weights both read
    (:data:`WEIGHTS_FILE`, ONNX external data: one copy for the two graphs, and no 2 GB limit) and
    ``config.json`` to ``directory``; returns their paths by kind. ``onnx.load`` of either graph reads the
    weights back; :func:`lpx_tvm.frontend.mapped_external_data` maps them without a copy."""
    config = get_config(config_or_name)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"prefill": out / "prefill.onnx", "decode": out / "decode.onnx", "weights": out / WEIGHTS_FILE,
             "config": out / "config.json"}
    weights = llama_weights(config, seed)
    offsets = weight_offsets(weights)
    with open(paths["weights"], "wb") as fh:
        for name, value in weights.items():
            fh.seek(offsets[name])
            fh.write(memoryview(value).cast("B"))
    onnx.save(build_prefill(config, prompt_len, seed, weights, external=True), paths["prefill"])
    onnx.save(build_decode(config, seed, weights, external=True), paths["decode"])
    paths["config"].write_text(json.dumps({**asdict(config), "prompt_len": int(prompt_len), "seed": seed},
                                          indent=2) + "\n")
    return paths


def with_weights_inside(model: onnx.ModelProto, weights: dict) -> onnx.ModelProto:
    """A copy of ``model`` whose external-data initializers hold their bytes (what ORT's quantiser reads)."""
    inside = onnx.ModelProto()
    inside.CopyFrom(model)
    for init in inside.graph.initializer:
        if uses_external_data(init):
            init.CopyFrom(numpy_helper.from_array(np.asarray(weights[init.name]), init.name))
    return inside


def config_of(model: onnx.ModelProto) -> LlamaConfig:
    """The :class:`LlamaConfig` a graph of this module was built from (stored in its metadata)."""
    props = {p.key: p.value for p in model.metadata_props}
    if "llama_config" not in props:
        raise LpxUserError("not a graph built by lpx_tvm.app.models.llama (no llama_config metadata)")
    return LlamaConfig(**json.loads(props["llama_config"]))


# ---------------------------------------------------------------------------
# reference generation in ONNX Runtime
# ---------------------------------------------------------------------------
def ort_session(model: onnx.ModelProto):
    """An ONNX Runtime CPU session of ``model`` (the default ``session_factory``)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


class _SharedWeightSession:
    """An ONNX Runtime session whose large weights are graph inputs fed from arrays it shares with others."""

    def __init__(self, session, weights: dict):
        self.session, self.weights = session, weights

    def run(self, output_names, feeds: dict) -> list:
        return self.session.run(output_names, {**feeds, **self.weights})


def ort_sessions(*models, min_bytes: int = 1 << 16, weights: dict | None = None) -> list:
    """ONNX Runtime CPU sessions of graphs that share their weights (a decoder's prefill and decode graphs):
    every initializer of ``min_bytes`` or more becomes a graph input, fed at each run from one numpy array
    per name and content, which ORT reads in place. The weights are held once for all the sessions, where
    each session copied them (and serialising a model for ORT copied them once more). An initializer held as
    external data is fed from ``weights`` (by name)."""
    import onnxruntime as ort
    from onnx import numpy_helper

    arrays, sessions = {}, []
    for model in models:
        # the graph without its large initializers: its nodes, inputs and outputs are small to copy
        graph = onnx.GraphProto(name=model.graph.name, node=model.graph.node, input=model.graph.input,
                                output=model.graph.output, value_info=model.graph.value_info)
        fed = {}
        for init in model.graph.initializer:
            if uses_external_data(init):
                if weights is None or init.name not in weights:
                    raise LpxUserError(f"initializer {init.name!r} is held as external data: pass its array in "
                                       "weights={name: array}")
                fed[init.name] = weights[init.name]
            elif len(init.raw_data) < min_bytes:
                graph.initializer.append(init)
                continue
            else:
                key = (init.name, hash(init.raw_data))
                if key not in arrays:
                    arrays[key] = numpy_helper.to_array(init)
                fed[init.name] = arrays[key]
            graph.input.append(onnx.helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
        slim = onnx.ModelProto(ir_version=max(model.ir_version, 4), opset_import=model.opset_import, graph=graph)
        options = ort.SessionOptions()
        options.log_severity_level = 3
        # a weight the graph widens (a Cast of an input) is ready from the start: in ORT's default order every
        # Cast runs first and all the widened weights live at once, in an arena that keeps them. Priority order
        # widens each just before its product, and without the arena its buffer is freed after it; the full
        # optimiser's rewrites keep more widened weights alive (1.1 GB, not 0.5, over a 4-layer 0.3 B prefill)
        options.execution_order = ort.ExecutionOrder.PRIORITY_BASED
        options.enable_cpu_mem_arena = False
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        session = ort.InferenceSession(slim.SerializeToString(), options, providers=["CPUExecutionProvider"])
        sessions.append(_SharedWeightSession(session, fed))
    return sessions


def generate_reference(config, prompt_ids, new_tokens: int, seed: int = 0,
                       session_factory: Callable | None = None) -> dict:
    """Greedy generation: one prefill, then ``new_tokens`` decode steps over the static numpy cache.

    The prefill's last logits choose the first token; decode step ``j`` (position ``len(prompt) + j``)
    feeds the last chosen token and chooses the next, so ``new_tokens + 1`` tokens are chosen in all,
    and ``len(prompt) + new_tokens <= max_context``.

    Parameters
    ----------
    config : LlamaConfig or preset name
    prompt_ids : sequence of int
    new_tokens : int
        Decode steps (0: prefill only).
    seed : int
        Weight seed (:func:`llama_weights`).
    session_factory : callable, optional
        ``factory(onnx.ModelProto) -> session`` with ONNX Runtime's ``session.run(None, feeds) -> list``
        (outputs in :func:`output_names` order); ONNX Runtime CPU (:func:`ort_session`) by default. Pass
        one that wraps ``lpx_tvm.compile`` to generate on lpx.

    Returns
    -------
    dict
        ``tokens`` (list of ``new_tokens + 1`` ids), ``sequence`` (prompt + tokens), ``prefill_logits``
        (``[prompt_len, vocab]``), ``step_logits`` (``[new_tokens, vocab]``, decode step ``j`` at position
        ``prompt_len + j``), ``logits`` (``[new_tokens + 1, vocab]``: the logits each token was chosen
        from), ``positions`` (of the decode steps) and ``cache`` (final, with ``prompt_len + new_tokens``
        valid slots).
    """
    config = get_config(config)
    prompt = [int(t) for t in np.asarray(prompt_ids, dtype=np.int64).reshape(-1)]
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, (int, np.integer)) or new_tokens < 0:
        raise LpxUserError(f"new_tokens must be a non-negative integer, got {new_tokens!r}")
    if not prompt or len(prompt) + new_tokens > config.max_context:
        raise LpxUserError(f"prompt of {len(prompt)} tokens + {new_tokens} decode steps must be 1 .. "
                           f"max_context ({config.max_context})")
    if any(not 0 <= t < config.vocab_size for t in prompt):
        raise LpxUserError(f"prompt ids must be in [0, {config.vocab_size})")
    factory = session_factory or ort_session
    names = output_names(config)
    prefill = factory(build_prefill(config, len(prompt), seed))
    outputs = dict(zip(names, prefill.run(None, prefill_feeds(config, prompt)), strict=True))
    del prefill
    cache = write_cache(initial_cache(config), {n: outputs[n] for n in names[1:]}, 0)
    prefill_logits = np.asarray(outputs["logits"][0], np.float32)
    tokens, step_logits = [int(np.argmax(prefill_logits[-1]))], []
    decode = factory(build_decode(config, seed)) if new_tokens else None
    positions = list(range(len(prompt), len(prompt) + new_tokens))
    for position in positions:
        outputs = dict(zip(names, decode.run(None, decode_feeds(config, tokens[-1], position, cache)), strict=True))
        write_cache(cache, {n: outputs[n] for n in names[1:]}, position)
        step_logits.append(np.asarray(outputs["logits"][0, 0], np.float32))
        tokens.append(int(np.argmax(step_logits[-1])))
    steps = np.stack(step_logits) if step_logits else np.zeros((0, config.vocab_size), np.float32)
    return {"tokens": tokens, "sequence": prompt + tokens, "prefill_logits": prefill_logits,
            "step_logits": steps, "logits": np.concatenate([prefill_logits[-1:], steps]),
            "positions": positions, "cache": cache}
