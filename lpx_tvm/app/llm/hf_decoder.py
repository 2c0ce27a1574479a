"""Decoders in Hugging Face form for ``lpx-tvm generate``: an ONNX graph whose inputs are ``input_ids``,
``attention_mask``, ``position_ids`` and ``past_key_values.N.key|value``, and whose outputs are ``logits``
and ``present.N.key|value`` (optimum's names and torch.onnx's, with symbolic sequence dimensions).

On lpx the cache is static and resident (see :mod:`.generate`): the decode graph is pinned to one token over
``context`` cache slots, of which the attention mask marks the filled ones. The graph's ``present`` is the
past concatenated with the new K/V; lpx returns only the new positions (a slice after the concatenation),
so a step sends back one slot a cache, not the whole cache. The prefill is pinned to the prompt over one
empty, masked slot (the frontend takes no empty dims): the empty slot's probability is exactly 0, so the
logits are those of a prefill with no past.

ONNX Runtime runs the graph as it came, as transformers does: a prefill with no past, then a growing cache
and a mask of ones.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from ...frontend import mapped_external_data
from ...runtime_sim.errors import LpxUserError
from ..models import llama

_PAST = re.compile(r"past_key_values\.(\d+)\.(key|value)$")
GRAPH_FILES = ("model.onnx", "decoder_model_merged.onnx", "decoder_with_past_model.onnx")


def graph_file(path) -> Path | None:
    """The graph a path names as a Hugging Face-form decoder would be: an ``.onnx`` file, or the first of
    :data:`GRAPH_FILES` in a folder (an optimum export); else None. (Whether it is one, :class:`HFDecoder`
    checks as it loads it, once.)"""
    path = Path(str(path))
    if path.is_file():
        return path if path.suffix == ".onnx" else None
    return next((path / name for name in GRAPH_FILES if (path / name).is_file()), None) if path.is_dir() else None


def _dims(value_info) -> list:
    return [d.dim_value if d.HasField("dim_value") else None for d in value_info.type.tensor_type.shape.dim]


_LENGTHS = {"input_ids": "sequence length", "attention_mask": "past plus sequence length",
            "position_ids": "sequence length"}


def _fixed_lengths(inputs: dict, cache_names: list) -> list:
    """``(input, axis, what, value)`` for each past or sequence length the graph fixes (axis 1 of the token
    inputs, axis 2 of each cache)."""
    axes = [(name, 2, "past length") for name in cache_names]
    axes += [(name, 1, what) for name, what in _LENGTHS.items() if name in inputs]
    fixed = []
    for name, axis, what in axes:
        dims = _dims(inputs[name])
        if axis < len(dims) and dims[axis] is not None:
            fixed.append((name, axis, what, dims[axis]))
    return fixed


class HFDecoder:
    """A Hugging Face-form decoder graph, pinned for lpx's prefill and decode and run by ORT as it came.

    Parameters
    ----------
    path : str or Path
        The ``.onnx`` file, or an optimum export folder (its ``config.json`` and ``tokenizer.json`` are read
        when there).
    """

    def __init__(self, path):
        found = graph_file(path)
        if found is None:
            raise LpxUserError(f"{path} is not a decoder in Hugging Face form: no .onnx graph with "
                               "past_key_values.N.key/value inputs")
        self.path, self.folder = found, found.parent
        # weights held as external data (every exporter's form past 2 GB) are mapped from their files in place,
        # for ORT and TVM alike; onnx.load would copy them into the graph, and each session and compile once more
        self.graph = onnx.load(str(found), load_external_data=False)
        self.weights = mapped_external_data(self.graph, found.parent) or None
        inputs = {i.name: i for i in self.graph.graph.input}
        if not any(_PAST.match(name) for name in inputs):
            raise LpxUserError(f"{found} is not a decoder in Hugging Face form: it has no past_key_values.N inputs "
                               "(a graph of the project's own is a folder of prefill.onnx and decode.onnx)")
        outputs = [o.name for o in self.graph.graph.output]
        if "use_cache_branch" in inputs:
            raise LpxUserError(f"{found} is optimum's merged decoder (an If on use_cache_branch), which lpx does not "
                               "take; export with past inputs and no merge (optimum-cli ... --no-post-process), "
                               "or give decoder_with_past_model.onnx")
        if "input_ids" not in inputs or "logits" not in outputs:
            raise LpxUserError(f"{found} has past_key_values inputs but no input_ids input or logits output")
        layers = sorted({int(_PAST.match(n).group(1)) for n in inputs if _PAST.match(n)})
        if layers != list(range(len(layers))):
            raise LpxUserError(f"{found}'s past_key_values layers are {layers}, not 0 .. {len(layers) - 1}")
        self.cache_names = [f"past_key_values.{i}.{kind}" for i in range(len(layers)) for kind in ("key", "value")]
        missing = [n for n in self.cache_names if n not in inputs] + [
            n.replace("past_key_values.", "present.") for n in self.cache_names
            if n.replace("past_key_values.", "present.") not in outputs]
        if missing:
            raise LpxUserError(f"{found} lacks {missing}: each past_key_values.N.key/value needs its present.N output")
        shape = _dims(inputs[self.cache_names[0]])
        if len(shape) != 4 or shape[1] is None or shape[3] is None:
            raise LpxUserError(f"{found}'s past_key_values.0.key is {shape}; lpx needs [batch, kv_heads, past, "
                               "head_dim] with kv_heads and head_dim fixed")
        fixed = _fixed_lengths(inputs, self.cache_names)
        if fixed:
            # lpx pins these per graph (the prefill to the prompt over one slot, a decode step to its cache): a
            # graph traced at one length keeps constants of that length, which ORT's folding then rejects
            (name, axis, what, value), more = fixed[0], len(fixed) - 1
            raise LpxUserError(f"{found}'s input {name!r} has its {what} (axis {axis}) fixed at {value}"
                               + (f" (and {more} more past or sequence axes too)" if more else "")
                               + "; lpx needs the past and sequence lengths symbolic: export them dynamic "
                               "(torch.onnx.export(..., dynamo=True, dynamic_shapes=...) with a torch.export.Dim on "
                               "each, as lpx_tvm.app.llm.hf_decoder.export_decoder does; optimum exports them so)")
        self.kv_heads, self.head_dim = shape[1], shape[3]
        self.vocab_size = _dims(next(o for o in self.graph.graph.output if o.name == "logits"))[-1]
        self.inputs = list(inputs)
        self.config = self._config_json()
        self.max_context = self.config.get("max_position_embeddings") or self.config.get("n_positions")
        self.kv_dtype = np.float16 if inputs[self.cache_names[0]].type.tensor_type.elem_type == TensorProto.FLOAT16 \
            else np.float32
        self.new_kv_names = [n.replace("past_key_values.", "new.") for n in self.cache_names]
        self.outputs = ["logits", *self.new_kv_names]
        self.prompt_len, self.tokenizer = None, None
        self.weight_bytes = (sum(len(init.raw_data) for init in self.graph.graph.initializer)
                             + sum(w.nbytes for w in (self.weights or {}).values()))

    def _config_json(self) -> dict:
        path = self.folder / "config.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    def tokenizer_path(self) -> Path | None:
        path = self.folder / "tokenizer.json"
        return path if path.is_file() else None

    def take_prompt(self, given, default: int) -> None:
        """The prefill is pinned to the prompt: given, or ``default`` seeded tokens."""
        self.prompt_len = len(given) if given else default

    def context_for(self, positions: int, context: int | None) -> int:
        """The cache's slots: as given, else just the ``positions`` the run needs."""
        return context or positions

    def cache_shape(self, context: int) -> tuple:
        return (1, self.kv_heads, context, self.head_dim)

    def cache_bytes(self, context: int) -> int:
        return len(self.cache_names) * self.kv_heads * context * self.head_dim * np.dtype(self.kv_dtype).itemsize

    # ---- lpx: the graph with new-K/V outputs, pinned -------------------------------------------------
    def graphs(self, prompt_len: int, context: int) -> tuple:
        """((prefill graph, its input shapes), (decode graph, its input shapes)) for lpx: one edited graph,
        pinned twice."""
        graph = self.lpx_graph()
        return (graph, self.shapes(prompt_len, 1)), (graph, self.shapes(1, context))

    def lpx_graph(self) -> onnx.ModelProto:
        """The graph with each ``present.N.*`` output replaced by ``new.N.*``: its positions after the past's
        (edited in place: ORT's session must be made first, :meth:`reference`)."""
        graph = self.graph.graph
        for past, new in zip(self.cache_names, self.new_kv_names):
            present = past.replace("past_key_values.", "present.")
            shape = f"{new}.past_len"
            graph.node.extend([
                helper.make_node("Shape", [past], [shape], start=2, end=3),
                helper.make_node("Slice", [present, shape, f"{new}.end", f"{new}.axis"], [new])])
            graph.initializer.extend([onnx.numpy_helper.from_array(np.array([2 ** 62], np.int64), f"{new}.end"),
                                      onnx.numpy_helper.from_array(np.array([2], np.int64), f"{new}.axis")])
        kept = [o for o in graph.output if not o.name.startswith("present.")]
        del graph.output[:]
        elem = TensorProto.FLOAT16 if self.kv_dtype == np.float16 else TensorProto.FLOAT
        graph.output.extend(kept + [helper.make_tensor_value_info(n, elem, None) for n in self.new_kv_names])
        return self.graph

    def shapes(self, seq: int, past: int) -> dict:
        """Input shapes for ``seq`` new tokens over ``past`` cache slots (batch 1)."""
        kv = [1, self.kv_heads, past, self.head_dim]
        shapes = {"input_ids": [1, seq], "attention_mask": [1, past + seq], "position_ids": [1, seq]}
        shapes = {k: v for k, v in shapes.items() if k in self.inputs}
        return {**shapes, **{n: kv for n in self.cache_names}}

    def prefill_feeds(self, prompt) -> dict:
        """lpx's prefill: the prompt over one empty slot, masked (0), positions from 0."""
        ids = np.asarray(prompt, np.int64).reshape(1, -1)
        mask = np.ones((1, 1 + ids.shape[1]), np.int64)
        mask[0, 0] = 0
        feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": np.arange(ids.shape[1])[None]}
        blank = np.zeros((1, self.kv_heads, 1, self.head_dim), self.kv_dtype)
        return {**{k: v for k, v in feeds.items() if k in self.inputs}, **{n: blank for n in self.cache_names}}

    def decode_feeds(self, token: int, position: int, context: int) -> dict:
        """lpx's decode step (without the resident cache): slots ``0 .. position-1`` filled, then the token."""
        mask = np.zeros((1, context + 1), np.int64)
        mask[0, :position] = 1
        mask[0, -1] = 1
        feeds = {"input_ids": np.array([[token]], np.int64), "attention_mask": mask,
                 "position_ids": np.array([[position]], np.int64)}
        return {k: v for k, v in feeds.items() if k in self.inputs}

    # ---- ORT: the graph as it came --------------------------------------------------------------------
    def reference(self) -> "_Reference":
        """ONNX Runtime on the unedited graph, as transformers runs it (make it before :meth:`lpx_graph`)."""
        (session,) = llama.ort_sessions(self.graph, weights=self.weights)
        return _Reference(self, session)

    def drop_graphs(self) -> None:
        self.graph = None

    def sequence_reference(self):
        """None: ORT answers this graph's steps one by one, as transformers runs it (see
        ``generate._BuiltDecoder.sequence_reference``)."""
        return None

    def drop_prefill_graph(self) -> None:
        """Nothing to drop: one graph serves the prefill and the decode step."""

    def quantize(self, seed: int = 0, prompt_len: int = 8, steps: int = 4) -> str:
        """Replace the graph by its QDQ int8 form (ONNX Runtime's static quantiser), calibrated on ORT's own run
        of a seeded prompt and ``steps`` decode steps after it; returns how, in words. A graph that is QDQ
        already is kept."""
        import lpx_tvm

        if any(n.op_type == "QuantizeLinear" for n in self.graph.graph.node):
            return "QDQ as given"
        reference = self.reference()
        if self.weights is not None:  # ORT's quantiser reads the weights from the graph
            self.graph, self.weights = llama.with_weights_inside(self.graph, self.weights), None
        rng = np.random.default_rng(seed + 3)
        feeds = []
        for ids in [rng.integers(0, self.vocab_size, (1, prompt_len))] + [
                rng.integers(0, self.vocab_size, (1, 1)) for _ in range(steps)]:
            feeds.append(reference.feeds(ids))
            reference.run(ids)
        self.graph = lpx_tvm.quantize(self.graph, feeds)
        return (f"quantised by ONNX Runtime's static quantiser, calibrated on a seeded {prompt_len}-token prompt and "
                f"{steps} decode steps")


class _Reference:
    """ORT's own decode: a prefill with no past, then one token a step over a cache that grows."""

    def __init__(self, decoder: HFDecoder, session):
        self.decoder, self.session = decoder, session
        self.outputs = [o.name for o in decoder.graph.graph.output]
        self.cache = {n: np.zeros((1, decoder.kv_heads, 0, decoder.head_dim), decoder.kv_dtype)
                      for n in decoder.cache_names}

    def feeds(self, ids: np.ndarray) -> dict:
        """The graph's inputs for ``ids`` after the cache held: a mask of ones, positions after the past."""
        past = self.cache[self.decoder.cache_names[0]].shape[2]
        feeds = {"input_ids": ids, "attention_mask": np.ones((1, past + ids.shape[1]), np.int64),
                 "position_ids": np.arange(past, past + ids.shape[1])[None]}
        return {**{k: v for k, v in feeds.items() if k in self.decoder.inputs}, **self.cache}

    def run(self, ids: np.ndarray) -> np.ndarray:
        """The last position's logits for ``ids``, their K/V appended to the cache."""
        got = dict(zip(self.outputs, self.session.run(None, self.feeds(ids))))
        self.cache = {n: got[n.replace("past_key_values.", "present.")] for n in self.decoder.cache_names}
        return got["logits"][0, -1]

    def prefill(self, prompt) -> np.ndarray:
        """The last position's logits for the prompt."""
        return self.run(np.asarray(prompt, np.int64).reshape(1, -1))

    def step(self, token: int) -> np.ndarray:
        """The logits after ``token``, appended to the cache."""
        return self.run(np.array([[token]], np.int64))


ARCHITECTURES = ("llama", "qwen2", "mistral", "gpt2")


def random_causal_lm(arch: str = "llama", layers: int = 4, seed: int = 0):
    """A small transformers causal LM of ``arch`` (:data:`ARCHITECTURES`) with seeded random weights: hidden
    64, 4 heads (2 K/V heads where the architecture groups them), vocabulary 256, 128 positions."""
    import torch
    import transformers

    if arch not in ARCHITECTURES:
        raise LpxUserError(f"arch must be one of {', '.join(ARCHITECTURES)}, got {arch!r}")
    torch.manual_seed(seed)
    if arch == "gpt2":  # (its default init, std 0.02, makes a tied-embedding model repeat its last token)
        config = transformers.GPT2Config(n_embd=64, n_layer=layers, n_head=4, vocab_size=256, n_positions=128,
                                         initializer_range=0.2)
        return transformers.GPT2LMHeadModel(config).train(False)
    kinds = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
             "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
             "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}
    config_class, model_class = kinds[arch]
    config = config_class(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=128, vocab_size=256, max_position_embeddings=128)
    return model_class(config).train(False)


def word_tokenizer(vocab_size: int, path) -> Path:
    """A word-level ``tokenizer.json`` (the ``tokenizers`` package) over ``vocab_size`` words: some English
    ones, then ``w<i>``; split on whitespace, joined by spaces."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    words = ("the a an of to and in is it that on was for with as at by this be from or are not have one all "
             "they we you he she cat dog sat ran mat hat red blue big small over under up down").split()
    words = [*dict.fromkeys(words)][:vocab_size]
    vocab = {w: i for i, w in enumerate(words + [f"w{i}" for i in range(len(words), vocab_size)])}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token=words[0]))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(path))
    return Path(path)


def export_decoder(model, directory, example_len: int = 4) -> Path:
    """Write a transformers causal LM as optimum lays a decoder out: ``model.onnx`` in Hugging Face form
    (``torch.onnx``, dynamo, symbolic sequence and past lengths) and its ``config.json``.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A causal LM (Llama, Qwen2, Mistral, GPT-2, ...), in inference mode (``train(False)``).
    directory : str or Path
    example_len : int
        The sequence and past lengths traced (the graph takes any).

    Returns
    -------
    Path
        The ``model.onnx`` written.
    """
    import torch
    from transformers import DynamicCache

    config = model.config
    layers = config.num_hidden_layers
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    class WithCache(torch.nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, input_ids, attention_mask, position_ids, past):
            cache = DynamicCache(config=self.lm.config)
            for layer in range(layers):
                cache.update(past[2 * layer], past[2 * layer + 1], layer)
            out = self.lm(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          past_key_values=cache, use_cache=True)
            return (out.logits, *[t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)])

    n = example_len
    past = [torch.zeros(1, kv_heads, n, head_dim) for _ in range(2 * layers)]
    args = (torch.zeros(1, n, dtype=torch.int64), torch.ones(1, 2 * n, dtype=torch.int64),
            torch.arange(n, 2 * n)[None], past)
    caches = [f"past_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    auto = torch.export.Dim.AUTO
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    program = torch.onnx.export(
        WithCache(model).train(False), args, input_names=["input_ids", "attention_mask", "position_ids", *caches],
        output_names=["logits", *[c.replace("past_key_values.", "present.") for c in caches]],
        dynamic_shapes=({1: auto}, {1: auto}, {1: auto}, [{2: auto}] * len(caches)), dynamo=True, verbose=False)
    program.save(str(out / "model.onnx"))
    config.to_json_file(str(out / "config.json"))
    return out / "model.onnx"
