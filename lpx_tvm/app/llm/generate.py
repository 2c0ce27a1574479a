"""``lpx-tvm generate``: a decoder LLM's prefill and decode steps (greedy, or sampled) on a system of chips, each
step compared with ONNX Runtime running the same graphs. The decoder is the project's own Llama-style graphs
(a preset, or a ``save_llama`` folder) or a graph in Hugging Face form (:mod:`.hf_decoder`).

The decode program keeps every layer's KV cache resident in the SRAM of the chips that hold the layer
(``state``): a step sends only its token, its rotary tables and the mask, and its new K/V come back and
are written into the cache slot of their position. That write is a host transfer on each chip that holds
the cache (the chips' host links work side by side), and is charged to the step; the prompt's K/V are
written the same way after the prefill, and charged to the time to first token.

ONNX Runtime runs the same prefill and decode graphs on the tokens lpx chose (so both see the same
history), keeping its cache on the host; each step reports whether both chose the same token and how far
apart their logits are.
"""

from __future__ import annotations

import gc
import threading
import time
from concurrent.futures import Future
from math import ceil
from pathlib import Path

import numpy as np

from ...frontend import mapped_external_data
from ...runtime_sim.errors import LpxUserError
from ..models import llama
from ..output import Report, Table
from .hf_decoder import GRAPH_FILES, HFDecoder, graph_file


def _choose(logits: np.ndarray, draw: float | None, temperature: float, top_k: int | None) -> int:
    """The token: the largest logit (greedy, ``temperature`` 0), else the one the uniform ``draw`` picks from
    the softmax of the ``top_k`` largest logits over ``temperature`` (inverse CDF, so the same draw applied
    to two sets of logits picks the same token where they agree)."""
    logits = np.asarray(logits, np.float64)
    if not temperature:
        return int(np.argmax(logits))
    order = np.argsort(-logits, kind="stable")[:top_k] if top_k else np.argsort(-logits, kind="stable")
    scaled = logits[order] / temperature
    probs = np.exp(scaled - scaled.max())
    cdf = np.cumsum(probs / probs.sum())
    return int(order[min(int(np.searchsorted(cdf, draw, side="right")), len(order) - 1)])


def _tokenizer(path):
    """The ``tokenizers`` Tokenizer of a ``tokenizer.json``, or None where there is none."""
    if path is None or not Path(path).is_file():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ImportError(f"{path} needs the tokenizers package: pip install tokenizers") from None
    return Tokenizer.from_file(str(path))


def _prompt_ids(model, tokenizer, prompt_ids, text, vocab: int) -> list | None:
    """The prompt as token ids: given, or ``text`` encoded by the folder's tokenizer; checked against the
    vocabulary."""
    if text is not None:
        if prompt_ids is not None:
            raise LpxUserError("give the prompt as text or as ids, not both")
        if tokenizer is None:
            raise LpxUserError(f"a text prompt needs a tokenizer.json in the decoder's folder; {model} has none "
                               "(give --prompt-ids instead)")
        prompt_ids = tokenizer.encode(text).ids
        if not prompt_ids:
            raise LpxUserError(f"the prompt {text!r} encodes to no tokens")
    if prompt_ids is None:
        return None
    ids = [int(i) for i in prompt_ids]
    bad = [i for i in ids if not 0 <= i < vocab]
    if not ids or bad:
        raise LpxUserError(f"prompt ids must be tokens of the vocabulary (0 to {vocab - 1}), got "
                           f"{bad or 'none'}")
    return ids


class _BuiltDecoder:
    """The project's own decoder graphs (a preset, or a ``save_llama`` folder): a prefill graph for the prompt
    and a decode graph over ``config.max_context`` slots, both returning only the new K/V."""

    def __init__(self, name: str, config, prefill, decode, prompt_len: int, weights: dict | None = None,
                 built: bool = False):
        self.name, self.config, self.prefill_graph, self.decode_graph = name, config, prefill, decode
        self.prompt_len, self.weights = prompt_len, weights  # (weights: the graphs' external data, by name)
        self.cache_names, self.new_kv_names = llama.cache_names(config), llama.present_names(config)
        self.outputs = llama.output_names(config)
        self.vocab_size, self.max_context = config.vocab_size, config.max_context
        self.weight_bytes, self.tokenizer, self.kv_dtype = config.weight_bytes(), None, config.np_dtype
        self.built = built  # a preset built here (not a folder's graphs): its graphs can be built again

    def take_prompt(self, given, default: int) -> None:
        """Check a given prompt against the length the prefill graph was built or saved for."""
        if given is not None and len(given) != self.prompt_len:
            raise LpxUserError(f"{self.name}'s prefill graph takes {self.prompt_len} prompt tokens, the prompt has "
                               f"{len(given)} (save it again with lpx_tvm.app.models.llama.save_llama for {len(given)})")

    def context_for(self, positions: int, context: int | None) -> int:
        """The cache's slots: the decode graph's own (``_open_decoder`` checked a given one)."""
        return self.max_context

    def cache_bytes(self, context: int) -> int:
        return self.config.cache_bytes()

    def cache_shape(self, context: int) -> tuple:
        c = self.config  # (its context is the graph's max_context: _open_decoder checks a given one)
        return (1, c.num_kv_heads, c.max_context, c.head_dim)

    def graphs(self, prompt_len: int, context: int) -> tuple:
        """((prefill graph, its input shapes), (decode graph, its input shapes)) for lpx."""
        return (self.prefill_graph, None), (self.decode_graph, None)

    def prefill_feeds(self, prompt) -> dict:
        return llama.prefill_feeds(self.config, prompt)

    def decode_feeds(self, token: int, position: int, context: int) -> dict:
        return llama.decode_feeds(self.config, token, position, {})

    def reference(self) -> "_BuiltReference":
        sessions = llama.ort_sessions(self.prefill_graph, self.decode_graph, weights=self.weights)
        return _BuiltReference(self.config, *sessions)

    def sequence_reference(self):
        """ORT's logits at every position of a token sequence in one run, of a prefill graph as long as the
        sequence: a preset's (built here, its weights held apart from its graphs) that was not quantised; else
        None, and ORT goes step by step beside lpx. The logits at a position depend on the tokens up to it
        only, so one run over the prompt and lpx's tokens answers every step, for a tenth of the steps' cost
        (llama-1b: 2.1-2.7 s for 160 positions, against 0.6-1.1 s a step)."""
        if not self.built or self.weights is None:
            return None
        config, weights = self.config, self.weights

        def logits(ids) -> np.ndarray:
            graph = llama.build_prefill(config, len(ids), weights=weights, external=True)
            (session,) = llama.ort_sessions(graph, weights=weights)
            return session.run(["logits"], llama.prefill_feeds(config, ids))[0][0]
        return logits

    def drop_graphs(self) -> None:
        self.prefill_graph = self.decode_graph = None

    def drop_prefill_graph(self) -> None:
        """The prefill graph is compiled: its copy of the weights need not stay while the decode graph
        compiles (ORT holds its own)."""
        self.prefill_graph = None

    def quantize(self, seed: int = 0, steps: int = 4) -> str:
        """Replace both graphs by their QDQ int8 forms (ONNX Runtime's static quantiser), calibrated on ORT's run
        of a seeded prompt and ``steps`` decode steps after it; returns how, in words."""
        import lpx_tvm

        if self.weights is not None:  # ORT's quantiser reads the weights from the graphs
            self.prefill_graph = llama.with_weights_inside(self.prefill_graph, self.weights)
            self.decode_graph = llama.with_weights_inside(self.decode_graph, self.weights)
            self.weights = None
        reference, rng = self.reference(), np.random.default_rng(seed + 3)
        prompt = rng.integers(0, self.vocab_size, self.prompt_len)
        prefill_feeds = [llama.prefill_feeds(self.config, prompt)]
        reference.prefill(prompt)
        decode_feeds = []
        for _ in range(min(steps, self.max_context - self.prompt_len)):
            token = int(rng.integers(0, self.vocab_size))
            cache = {name: array.copy() for name, array in reference.cache.items()}
            decode_feeds.append(llama.decode_feeds(self.config, token, reference.position, cache))
            reference.step(token)
        self.prefill_graph = lpx_tvm.quantize(self.prefill_graph, prefill_feeds)
        self.decode_graph = lpx_tvm.quantize(self.decode_graph, decode_feeds)
        return (f"quantised by ONNX Runtime's static quantiser, calibrated on a seeded {self.prompt_len}-token prompt "
                f"and {len(decode_feeds)} decode steps")


class _BuiltReference:
    """ORT on the same two graphs, its static cache on the host."""

    def __init__(self, config, prefill, decode):
        self.config, self.sessions, self.position = config, (prefill, decode), 0
        self.cache = llama.initial_cache(config)

    def prefill(self, prompt) -> np.ndarray:
        want = self.sessions[0].run(None, llama.prefill_feeds(self.config, prompt))
        llama.write_cache(self.cache, want[1:], 0)
        self.position = len(prompt)
        return want[0][0, -1]

    def step(self, token: int) -> np.ndarray:
        want = self.sessions[1].run(None, llama.decode_feeds(self.config, token, self.position, self.cache))
        llama.write_cache(self.cache, want[1:], self.position)
        self.position += 1
        return want[0][0, -1]


def _open_decoder(model, prompt_len: int, seed: int, context: int | None, dtype: str = "fp32"):
    """The decoder a ``generate`` MODEL names: a preset, a ``save_llama`` folder, or a graph in Hugging Face
    form (an ``.onnx`` file or an optimum folder)."""
    path = Path(str(model))
    if path.suffix == ".onnx" and not path.exists():
        raise LpxUserError(f"{path}: no such file")
    own = [f for f in ("prefill.onnx", "decode.onnx") if (path / f).is_file()] if path.is_dir() else []
    if not own and graph_file(path) is not None:
        decoder = HFDecoder(path)
        decoder.tokenizer = _tokenizer(decoder.tokenizer_path())
        return decoder
    if path.is_dir() or path.suffix == ".onnx":
        if len(own) == 2:
            import onnx

            # the graphs without their weights: a weights file both graphs read is mapped once, in place
            prefill, decode = (onnx.load(str(path / name), load_external_data=False)
                               for name in ("prefill.onnx", "decode.onnx"))
            weights = mapped_external_data(decode, path) or None
            config = llama.config_of(decode)
            if context is not None and context != config.max_context:
                raise LpxUserError(f"{path}'s decode graph was saved for a context of {config.max_context}, not "
                                   f"{context} (save it again, or leave --context out)")
            length = prefill.graph.input[0].type.tensor_type.shape.dim[1].dim_value
            decoder = _BuiltDecoder(str(path), config, prefill, decode, length, weights)
            decoder.tokenizer = _tokenizer(path / "tokenizer.json")
            return decoder
        missing = [f for f in ("prefill.onnx", "decode.onnx") if f not in own]
        raise LpxUserError(f"{path} is not a decoder folder: it has no {' or '.join(missing)} (write one with "
                           "lpx_tvm.app.models.llama.save_llama), nor a graph in Hugging Face form (past_key_values.N "
                           f"inputs, present.N outputs: an .onnx file, or an optimum folder with "
                           f"{' or '.join(GRAPH_FILES)}); or give a preset: {', '.join(llama.PRESETS)}")
    config = llama.get_config(model)
    if config.dtype != "fp32":  # lpx stores the graph's tensors in the dtype asked for; the graph stays fp32
        config = config.replace(dtype="fp32")
    if context is not None:
        config = config.replace(max_context=context)
    # one draw for both graphs, held apart from them (external data: no copy in either graph, nor in ONNX
    # Runtime or TVM), in fp16 where the chips store fp16 (the graphs widen it exactly, so lpx and ONNX Runtime
    # compute with the same weights, and no fp32 copy exists); ORT's quantiser needs the weights inside
    external = dtype != "int8"
    weights = llama.llama_weights(config.replace(dtype="fp16") if dtype == "fp16" else config, seed)
    return _BuiltDecoder(str(model), config, llama.build_prefill(config, prompt_len, seed, weights, external),
                         llama.build_decode(config, seed, weights, external), prompt_len,
                         weights if external else None, built=True)


def kv_bytes_per_chip(compiled, names: list, nbytes: dict) -> dict:
    """System chip ─► bytes of new K/V a step writes into the caches it holds."""
    per_chip = {}
    for name in names:
        for symbol, arg in compiled.state_where.get(name, ()):
            sim = compiled.simulators[symbol]
            chips = [d[0] for d in sim.destinations(arg)]
            for chip in chips:
                per_chip[chip] = per_chip.get(chip, 0) + nbytes[name]
    return per_chip


def _write_back_cycles(compiled, names: list, nbytes: dict) -> int:
    """Cycles to write these state tensors' new bytes over the host links: per chip its bytes at the link
    rate plus one DMA latency; the chips in parallel (the slowest sets the time)."""
    per_chip = kv_bytes_per_chip(compiled, names, nbytes)
    chip = _chip_of(compiled)
    if not per_chip:
        return 0
    return max(ceil(b / chip.host_bytes_per_cycle) for b in per_chip.values()) + chip.latency_cycles["MEM"]


def _streamed_bytes(compiled) -> int:
    """Bytes of weights a call of ``compiled`` streams from host memory (those its chips' SRAM does not hold)."""
    total = 0
    for sim in compiled.simulators.values():
        for _, chip_sim in sim.chips:
            total += sum(weight.host.nbytes for weight in chip_sim.program.streamed)
    return total


def _chip_of(compiled):
    sim = next(iter(compiled.simulators.values()))
    return sim.chip_config


def generate(model="llama-tiny", tokens: int = 16, system: str | None = None, parallel: str = "pipeline",
             config: str | None = None, chips: int | None = None, dtype: str = "fp32", prompt_len: int = 8,
             seed: int = 0, progress=None, prompt_ids=None, prompt: str | None = None, temperature: float = 0.0,
             top_k: int | None = None, context: int | None = None) -> dict:
    """Prefill a prompt, then ``tokens`` decode steps on lpx, each checked against ONNX Runtime.

    Parameters
    ----------
    model : str or Path
        A Llama preset (``llama-tiny``, ``llama-small``, ``llama-gpt2s``, ``llama-1b``), a ``save_llama``
        directory, or a decoder in Hugging Face form: an ``.onnx`` graph with ``past_key_values.N`` inputs and
        ``present.N`` outputs, or an optimum export folder (with its ``tokenizer.json`` where there is one).
    tokens : int
        Decode steps after the prefill.
    system, parallel, config, chips, dtype
        As for :func:`lpx_tvm.compile` (``dtype`` is the storage type on the chips; the graphs are fp32).
    prompt_len : int
        Prompt tokens (seeded, in the vocabulary) for a preset, where no prompt is given.
    prompt_ids : sequence of int, optional
        The prompt's tokens (a folder's prefill graph takes as many as it was saved for).
    prompt : str, optional
        The prompt as text, encoded by the folder's ``tokenizer.json`` (the ``tokenizers`` package); the
        tokens come back as ``text`` too.
    temperature, top_k : optional
        Greedy at temperature 0 (the default); else each step samples from the ``top_k`` largest logits at
        ``temperature``, with one seeded uniform draw a step applied to lpx's logits and to ORT's alike.
    context : int, optional
        Cache slots on the chips: a preset's ``max_context`` by default, and for a Hugging Face graph the
        prompt and the new tokens.

    Returns
    -------
    dict
        ``tokens`` (lpx's), ``reference_tokens`` (ONNX Runtime's choice at each step, on lpx's history),
        ``agree``, per-step ``steps`` (token, ORT's token, logits cosine, max abs error), the timing
        (``ttft_us``, ``per_token_us``, ``tokens_per_s_per_user``), per-chip utilisation and bytes per link,
        and the flow's own time: ``compile_s`` and ``decode_wall_s`` (simulating the steps and checking each
        against ORT: ``reference`` says how, one ORT run over the whole sequence at the end for a preset, else
        ORT's step on a thread beside lpx's).
    """
    import lpx_tvm

    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:  # (prompt_len: llama checks it)
        raise LpxUserError(f"tokens must be a positive integer, got {tokens!r}")
    if not (isinstance(temperature, (int, float)) and 0 <= temperature < float("inf")):
        raise LpxUserError(f"temperature must be a number >= 0 (0: greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise LpxUserError(f"top_k must be a positive integer, got {top_k!r}")
    say = progress or (lambda text: None)
    if context is not None and (isinstance(context, bool) or not isinstance(context, int) or context < 1):
        raise LpxUserError(f"context must be a positive integer, got {context!r}")
    if not Path(str(model)).exists() and Path(str(model)).suffix != ".onnx":  # a preset: built for the prompt
        given = _prompt_ids(model, None, prompt_ids, prompt, llama.get_config(model).vocab_size)
        decoder = _open_decoder(model, len(given) if given else prompt_len, seed, context, dtype)
    else:
        decoder = _open_decoder(model, prompt_len, seed, context)
        given = _prompt_ids(model, decoder.tokenizer, prompt_ids, prompt, decoder.vocab_size)
        decoder.take_prompt(given, prompt_len)
    prompt_len = decoder.prompt_len
    context = decoder.context_for(prompt_len + tokens, context)
    if prompt_len + tokens > context:
        raise LpxUserError(f"{prompt_len} prompt tokens and {tokens} more exceed the cache's context of {context}")
    if decoder.max_context and context > decoder.max_context:
        raise LpxUserError(f"a context of {context} exceeds the model's {decoder.max_context} positions")
    names, new_names = decoder.cache_names, decoder.new_kv_names
    options = dict(config=config, system=system, parallel=parallel, chips=chips, dtype=dtype)
    quantised = None
    if dtype == "int8":  # both run the QDQ graphs: lpx as int8 kernels, ORT as it defines QDQ
        say("quantising the decoder (int8) ...")
        quantised = decoder.quantize(seed)
    # ORT on the graphs as they came, before lpx pins and edits them: one run over the whole sequence at the
    # end where the decoder can build its graph, else a step of ORT's beside each of lpx's
    sequence = decoder.sequence_reference()
    reference = None if sequence else decoder.reference()
    (prefill_graph, prefill_shapes), (decode_graph, decode_shapes) = decoder.graphs(prompt_len, context)
    weights = decoder.weights  # (a preset's: held apart from its graphs, for ORT and TVM alike)
    start = time.perf_counter()
    say("compiling the prefill graph ...")
    prefill = lpx_tvm.compile(prefill_graph, input_shapes=prefill_shapes, weights=weights,
                              hold_weights=bool(weights), **options)
    compile_s = time.perf_counter() - start
    del prefill_graph
    decoder.drop_prefill_graph()
    prompt = (np.asarray(given, np.int64) if given is not None
              else np.random.default_rng(seed + 1).integers(0, decoder.vocab_size, prompt_len).astype(np.int64))
    draws = np.random.default_rng(seed + 2)  # one uniform a step, for lpx's choice and ORT's alike

    steps, pending = [], []  # pending: (lpx's logits, the step's draw) that ORT's one run answers at the end

    def check(got_logits, want) -> int:
        """lpx's token at this step; ORT's answer to it now (``want()``), or with the others at the end."""
        draw = float(draws.random()) if temperature else None
        if sequence:
            pending.append((np.array(got_logits), draw))
            return _choose(got_logits, draw, temperature, top_k)
        steps.append(_compare(got_logits, want(), lambda x: _choose(x, draw, temperature, top_k)))
        return steps[-1]["token"]

    say("running the prefill ...")
    got = dict(zip(decoder.outputs, prefill(**decoder.prefill_feeds(prompt))))
    token = check(got["logits"][0, -1], lambda: reference.prefill(prompt))
    prefill_cycles, prefill_programs = prefill.stats.cycles, prefill.report.lpx_functions
    held = prefill.held
    # the prefill has run: its programs go before the decode program is built (they name the weights held
    # apart, where there are such; any they carry, converted or cut, the host never holds twice at once)
    del prefill
    gc.collect()
    say("compiling the decode graph (KV cache resident) ...")
    start = time.perf_counter()
    decode = lpx_tvm.compile(decode_graph, input_shapes=decode_shapes, state=names, weights=weights,
                             hold_weights=held or bool(weights), **options)  # (over the prefill's weights)
    compile_s += time.perf_counter() - start
    del decode_graph
    decoder.drop_graphs()  # compiled, and ORT holds its own: their weights need not stay
    nbytes = {name: decode.write_state(name, got[new], (slice(None), slice(None), slice(0, prompt_len)))
              for name, new in zip(names, new_names)}
    ttft_cycles = prefill_cycles + _write_back_cycles(decode, names, nbytes)
    chosen = [token]
    # resident on the chips: the host sends nothing
    blank = {n: np.zeros(decoder.cache_shape(context), decoder.kv_dtype) for n in names}
    stepping = time.perf_counter()
    for step in range(tokens):
        position = prompt_len + step
        left = f", about {(time.perf_counter() - stepping) / step * (tokens - step):.0f} s left" if step else ""
        say(f"decode step {step + 1}/{tokens} (position {position}{left})")
        want = None if sequence else _meanwhile(reference.step, token)
        got = dict(zip(decoder.outputs, decode(**decoder.decode_feeds(token, position, context), **blank)))
        slot = (slice(None), slice(None), slice(position, position + 1))
        nbytes = {name: decode.write_state(name, got[new], slot) for name, new in zip(names, new_names)}
        token = check(got["logits"][0, -1], want)
        chosen.append(token)
    if sequence:  # every step's answer from one run over the prompt and the tokens lpx fed itself
        say(f"checking the {tokens + 1} steps against one ONNX Runtime run over {prompt_len + tokens} positions ...")
        want = sequence(np.concatenate([prompt, np.asarray(chosen[:-1], np.int64)]))
        steps = [_compare(logits, want[prompt_len - 1 + k], lambda x, d=draw: _choose(x, d, temperature, top_k))
                 for k, (logits, draw) in enumerate(pending)]
    decode_wall_s = time.perf_counter() - stepping  # simulating the steps and checking each against ORT
    chip = _chip_of(decode)
    write_cycles = _write_back_cycles(decode, names, nbytes)  # a step writes one slot a cache
    decode_cycles = decode.stats.cycles
    step_cycles = decode_cycles + write_cycles
    report = {"model": str(model), "system": system or chip.name, "parallel": parallel if system else "single chip",
              "dtype": dtype, "prompt_len": prompt_len, "context": context, "new_tokens": tokens,
              "prompt": prompt.tolist(), "tokens": chosen, "reference_tokens": [s["reference_token"] for s in steps],
              "sampling": {"temperature": temperature, "top_k": top_k} if temperature else "greedy",
              "agree": all(s["token"] == s["reference_token"] for s in steps), "steps": steps,
              "ttft_cycles": ttft_cycles, "ttft_us": 1e6 * ttft_cycles / chip.clock_hz,
              "decode_cycles": decode_cycles, "kv_write_cycles": write_cycles, "per_token_cycles": step_cycles,
              "per_token_us": 1e6 * step_cycles / chip.clock_hz,
              "tokens_per_s_per_user": chip.clock_hz / step_cycles, "compile_s": compile_s,
              "decode_wall_s": decode_wall_s,
              "reference": "one ONNX Runtime run over the whole sequence" if sequence else "ONNX Runtime step by step",
              "programs": {"prefill": prefill_programs, "decode": decode.report.lpx_functions},
              "weight_bytes": decoder.weight_bytes, "cache_bytes": decoder.cache_bytes(context),
              "kv_write_bytes_per_chip": kv_bytes_per_chip(decode, names, nbytes)}
    if held is not None:  # the decode program over the prefill's resident weights: where it kept them
        report["resident_weights"] = {"held_by_name_bytes": decode.held_bytes, "shared_bytes": held.shared,
                                      "moved_bytes": held.moved}
    if quantised:
        report["quantised"] = quantised
    streamed = _streamed_bytes(decode)
    if streamed:  # weights the chips cannot hold cross the host link every step: the figures above count it
        report["streamed_bytes_per_step"] = streamed
    report.update(_system_figures(decode))
    if decoder.tokenizer is not None:
        report["text"] = decoder.tokenizer.decode(chosen)
    return report


def _meanwhile(call, *args):
    """Start ``call(*args)`` on a thread of its own; the function returned waits for its value (or raises its
    error). ORT's answer to a step needs only the token lpx chose before it, and ORT lets go of the GIL: it
    computes while lpx simulates the same step. A daemon, so an error in lpx's step leaves nothing to join."""
    done = Future()

    def work():
        try:
            done.set_result(call(*args))
        except BaseException as err:  # handed to the waiter, whatever it is
            done.set_exception(err)
    threading.Thread(target=work, name="ort-reference", daemon=True).start()
    return done.result


def _compare(got: np.ndarray, want: np.ndarray, choose=lambda x: int(np.argmax(x))) -> dict:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    cosine = float(got @ want / max(np.linalg.norm(got) * np.linalg.norm(want), 1e-300))
    token, reference = choose(got), choose(want)
    # where the choices differ: how far apart ORT's own logits put the two tokens (a near-tie, or not)
    return {"token": token, "reference_token": reference, "cosine": cosine,
            "max_abs_err": float(np.abs(got - want).max()), "reference_margin": float(want[reference] - want[token])}


def _system_figures(compiled) -> dict:
    sim = next(iter(compiled.simulators.values()))
    chips = {str(chip): {"cycles": s.stats.cycles, "mac_utilisation": s.stats.mac_utilisation}
             for chip, s in sim.chips}
    links = [{"from": c, "port": p, **v} for (c, p), v in sorted(sim.links.items())]
    return {"chips": chips, "links": links, "notes": sim.notes}


def table(report: dict) -> Report:
    """The run's :class:`~lpx_tvm.app.output.Report`: the steps, the chips and the links, then the timing."""
    rows = [[k, s["token"], s["reference_token"],
             "yes" if s["token"] == s["reference_token"] else f"NO (ORT's margin {s['reference_margin']:.2g})",
             f"{s['cosine']:.6f}", f"{s['max_abs_err']:.2e}"] for k, s in enumerate(report["steps"])]
    blocks = [Table(["step", "lpx token", "ORT token", "same", "logits cosine", "max abs err"], rows, name="steps")]
    chips = [[c, v["cycles"], f"{100 * v['mac_utilisation']:.1f}"] for c, v in report["chips"].items()]
    blocks.append(Table(["chip", "decode cycles", "% MAC peak"], chips, name="chips"))
    if report["links"]:
        links = [[f"{l['from']} ─► {l['peer']}", l["transfers"], l["bytes"]] for l in report["links"]]
        blocks.append(Table(["link", "transfers a step", "bytes a step"], links, name="links"))
    text = (f"{report['model']} on {report['system']} ({report['parallel']}, {report['dtype']}): "
             f"{report['notes']}\n"
             f"time to first token {report['ttft_us']:.1f} µs ({report['prompt_len']} prompt tokens); "
             f"{report['per_token_us']:.1f} µs a token ({report['decode_cycles']} cycles decoding + "
             f"{report['kv_write_cycles']} writing the new K/V into the resident cache) = "
             f"{report['tokens_per_s_per_user']:.0f} tokens/s per user; "
             f"{'every token equal to ONNX Runtime' if report['agree'] else 'TOKENS DIFFER from ONNX Runtime'}"
             + ("" if report.get("sampling", "greedy") == "greedy" else
                f" (sampled at temperature {report['sampling']['temperature']}, top-k "
                f"{report['sampling']['top_k'] or 'all'}, one draw a step for both)"))
    if "quantised" in report:
        text += f"\nint8: {report['quantised']}; ONNX Runtime runs the same QDQ graphs"
    if report.get("streamed_bytes_per_step"):
        text += (f"\nstreamed weights: {report['streamed_bytes_per_step'] / 1e6:.1f} MB of the weights do not fit the "
                 "chips' SRAM and cross the host link every step (a --system of more chips holds them)")
    if "resident_weights" in report:
        held = report["resident_weights"]
        text += (f"\nresident weights: {held['held_by_name_bytes'] / 1e6:.1f} MB named by the decode program, "
                 f"read where the host holds them (no copy); it keeps {held['shared_bytes'] / 1e6:.1f} "
                 f"MB of them on the chip and at the address the prefill's put them, "
                 f"{held['moved_bytes'] / 1e6:.1f} MB elsewhere")
    text += (f"\nsimulated: compiled in {report['compile_s']:.1f} s; {report['new_tokens']} decode steps in "
             f"{report['decode_wall_s']:.1f} s ({report['new_tokens'] / report['decode_wall_s']:.2f} steps/s, each "
             f"checked against ONNX Runtime: {report.get('reference', 'ONNX Runtime step by step')})")
    text += f"\nprompt ids {report['prompt']}; generated ids {report['tokens']}"
    if "text" in report:
        text += f"\ntext: {report['text']!r}"
    blocks.append(text)
    return Report(f"{report['model']} on {report['system']}, token by token against ONNX Runtime", blocks, report)
