"""``lpx-tvm generate``: a Llama-style decoder's prefill and decode steps (greedy, or sampled) on a system of chips, each
step compared with ONNX Runtime running the same graphs.

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

import json
import time
from math import ceil
from pathlib import Path

import numpy as np

from . import llama


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


def _tokenizer(model):
    """The ``tokenizers`` Tokenizer of a decoder folder's ``tokenizer.json``, or None."""
    path = Path(str(model)) / "tokenizer.json"
    if not path.is_file():
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
            raise ValueError("give the prompt as text or as ids, not both")
        if tokenizer is None:
            raise ValueError(f"a text prompt needs a tokenizer.json in the decoder's folder; {model} has none "
                             "(give --prompt-ids instead)")
        prompt_ids = tokenizer.encode(text).ids
        if not prompt_ids:
            raise ValueError(f"the prompt {text!r} encodes to no tokens")
    if prompt_ids is None:
        return None
    ids = [int(i) for i in prompt_ids]
    bad = [i for i in ids if not 0 <= i < vocab]
    if not ids or bad:
        raise ValueError(f"prompt ids must be tokens of the vocabulary (0 to {vocab - 1}), got "
                         f"{bad or 'none'}")
    return ids


def _models(model, prompt_len: int, seed: int):
    """(config, prefill graph, decode graph) from a preset name or a ``save_llama`` directory."""
    path = Path(str(model))
    if path.is_dir():
        import onnx

        missing = [f for f in ("prefill.onnx", "decode.onnx") if not (path / f).is_file()]
        if missing:
            raise ValueError(f"{path} is not a decoder folder: it has no {' or '.join(missing)} (write one with "
                             f"lpx_tvm.app.llama.save_llama, or give a preset: {', '.join(llama.PRESETS)})")
        prefill, decode = onnx.load(str(path / "prefill.onnx")), onnx.load(str(path / "decode.onnx"))
        config = llama.config_of(decode)
        length = prefill.graph.input[0].type.tensor_type.shape.dim[1].dim_value
        return config, prefill, decode, length
    config = llama.get_config(model)
    if config.dtype != "fp32":  # lpx stores the graph's tensors in the dtype asked for; the graph stays fp32
        config = config.replace(dtype="fp32")
    return config, llama.build_prefill(config, prompt_len, seed), llama.build_decode(config, seed), prompt_len


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


def _chip_of(compiled):
    sim = next(iter(compiled.simulators.values()))
    return sim.chip_config


def _cycles(compiled) -> int:
    return sum(sim.stats.cycles for sim in compiled.simulators.values())


def generate(model="llama-tiny", tokens: int = 16, system: str | None = None, parallel: str = "pipeline",
             config: str | None = None, chips: int | None = None, dtype: str = "fp32", prompt_len: int = 8,
             seed: int = 0, progress=None, prompt_ids=None, prompt: str | None = None, temperature: float = 0.0,
             top_k: int | None = None) -> dict:
    """Prefill a prompt, then ``tokens`` decode steps on lpx, each checked against ONNX Runtime.

    Parameters
    ----------
    model : str or Path
        A Llama preset (``llama-tiny``, ``llama-small``, ``llama-gpt2s``) or a ``save_llama`` directory.
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

    Returns
    -------
    dict
        ``tokens`` (lpx's), ``reference_tokens`` (ONNX Runtime's choice at each step, on lpx's history),
        ``agree``, per-step ``steps`` (token, ORT's token, logits cosine, max abs error), the timing
        (``ttft_us``, ``per_token_us``, ``tokens_per_s_per_user``), per-chip utilisation and bytes per link.
    """
    import lpx_tvm

    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:  # (prompt_len: llama checks it)
        raise ValueError(f"tokens must be a positive integer, got {tokens!r}")
    if not (isinstance(temperature, (int, float)) and 0 <= temperature < float("inf")):
        raise ValueError(f"temperature must be a number >= 0 (0: greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive integer, got {top_k!r}")
    folder = Path(str(model)).is_dir()
    tokenizer = _tokenizer(model) if folder else None
    if folder:  # its prefill graph was saved for a prompt length
        cfg, prefill_graph, decode_graph, prompt_len = _models(model, prompt_len, seed)
        given = _prompt_ids(model, tokenizer, prompt_ids, prompt, cfg.vocab_size)
        if given is not None and len(given) != prompt_len:
            raise ValueError(f"{model}'s prefill graph takes {prompt_len} prompt tokens, the prompt has {len(given)} "
                             f"(save it again with lpx_tvm.app.llama.save_llama for {len(given)})")
    else:  # a preset's prefill graph is built for the prompt
        given = _prompt_ids(model, None, prompt_ids, prompt, llama.get_config(model).vocab_size)
        cfg, prefill_graph, decode_graph, prompt_len = _models(model, len(given) if given else prompt_len, seed)
    if prompt_len + tokens > cfg.max_context:
        raise ValueError(f"{prompt_len} prompt tokens and {tokens} more exceed the model's context of "
                         f"{cfg.max_context}")
    say = progress or (lambda text: None)
    names = llama.cache_names(cfg)
    options = dict(config=config, system=system, parallel=parallel, chips=chips, dtype=dtype)
    start = time.perf_counter()
    say("compiling the prefill graph ...")
    prefill = lpx_tvm.compile(prefill_graph, **options)
    say("compiling the decode graph (KV cache resident) ...")
    decode = lpx_tvm.compile(decode_graph, state=names, **options)
    compile_s = time.perf_counter() - start
    ort_prefill, ort_decode = llama.ort_sessions(prefill_graph, decode_graph)  # the weights held once
    del prefill_graph, decode_graph
    prompt = (np.asarray(given, np.int64) if given is not None
              else np.random.default_rng(seed + 1).integers(0, cfg.vocab_size, prompt_len).astype(np.int64))
    draws = np.random.default_rng(seed + 2)  # one uniform a step, for lpx's choice and ORT's alike

    def compare(got_logits, want_logits):
        draw = float(draws.random()) if temperature else None
        return _compare(got_logits, want_logits, lambda x: _choose(x, draw, temperature, top_k))

    feeds = llama.prefill_feeds(cfg, prompt)
    got = dict(zip(llama.output_names(cfg), prefill(**feeds)))
    want = dict(zip(llama.output_names(cfg), ort_prefill.run(None, feeds)))
    cache = llama.write_cache(llama.initial_cache(cfg), want, 0)  # ORT's, on the host
    presents = llama.present_names(cfg)
    nbytes = {cache_name: decode.write_state(cache_name, got[present], (slice(None), slice(None),
                                                                         slice(0, prompt_len)))
              for cache_name, present in zip(names, presents)}
    ttft_cycles = _cycles(prefill) + _write_back_cycles(decode, names, nbytes)
    steps = [compare(got["logits"][0, -1], want["logits"][0, -1])]
    token = steps[-1]["token"]
    chosen = [token]
    blank = {n: np.zeros_like(cache[n]) for n in names}  # resident on the chips: the host sends nothing
    for step in range(tokens):
        position = prompt_len + step
        say(f"decode step {step + 1}/{tokens} (position {position})")
        step_feeds = llama.decode_feeds(cfg, token, position, cache)
        got = dict(zip(llama.output_names(cfg), decode(**{**step_feeds, **blank})))
        want = dict(zip(llama.output_names(cfg), ort_decode.run(None, step_feeds)))
        slot = (slice(None), slice(None), slice(position, position + 1))
        nbytes = {cache_name: decode.write_state(cache_name, got[present], slot)
                  for cache_name, present in zip(names, presents)}
        llama.write_cache(cache, want, position)
        steps.append(compare(got["logits"][0, -1], want["logits"][0, -1]))
        token = steps[-1]["token"]
        chosen.append(token)
    chip = _chip_of(decode)
    write_cycles = _write_back_cycles(decode, names, nbytes) if tokens else 0  # a step writes one slot a cache
    step_cycles = _cycles(decode) + write_cycles
    report = {"model": str(model), "system": system or chip.name, "parallel": parallel if system else "single chip",
              "dtype": dtype, "prompt_len": prompt_len, "new_tokens": tokens, "prompt": prompt.tolist(),
              "tokens": chosen, "reference_tokens": [s["reference_token"] for s in steps],
              "sampling": {"temperature": temperature, "top_k": top_k} if temperature else "greedy",
              "agree": all(s["token"] == s["reference_token"] for s in steps), "steps": steps,
              "ttft_cycles": ttft_cycles, "ttft_us": 1e6 * ttft_cycles / chip.clock_hz,
              "decode_cycles": _cycles(decode), "kv_write_cycles": write_cycles, "per_token_cycles": step_cycles,
              "per_token_us": 1e6 * step_cycles / chip.clock_hz,
              "tokens_per_s_per_user": chip.clock_hz / step_cycles, "compile_s": compile_s,
              "weight_bytes": cfg.weight_bytes(), "cache_bytes": cfg.cache_bytes(),
              "kv_write_bytes_per_chip": kv_bytes_per_chip(decode, names, nbytes)}
    report.update(_system_figures(decode))
    if tokenizer is not None:
        report["text"] = tokenizer.decode(chosen)
    return report


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


def table(report: dict) -> str:
    """The run as text: the steps, then the timing, the chips and the links."""
    from tabulate import tabulate

    rows = [[k, s["token"], s["reference_token"],
             "yes" if s["token"] == s["reference_token"] else f"NO (ORT's margin {s['reference_margin']:.2g})",
             f"{s['cosine']:.6f}", f"{s['max_abs_err']:.2e}"] for k, s in enumerate(report["steps"])]
    text = tabulate(rows, headers=["step", "lpx token", "ORT token", "same", "logits cosine", "max abs err"],
                    tablefmt="github")
    chips = [[c, v["cycles"], f"{100 * v['mac_utilisation']:.1f}"] for c, v in report["chips"].items()]
    text += "\n\n" + tabulate(chips, headers=["chip", "decode cycles", "% MAC peak"], tablefmt="github")
    if report["links"]:
        links = [[f"{l['from']} ─► {l['peer']}", l["transfers"], l["bytes"]] for l in report["links"]]
        text += "\n\n" + tabulate(links, headers=["link", "transfers a step", "bytes a step"], tablefmt="github")
    text += (f"\n\n{report['model']} on {report['system']} ({report['parallel']}, {report['dtype']}): "
             f"{report['notes']}\n"
             f"time to first token {report['ttft_us']:.1f} µs ({report['prompt_len']} prompt tokens); "
             f"{report['per_token_us']:.1f} µs a token ({report['decode_cycles']} cycles decoding + "
             f"{report['kv_write_cycles']} writing the new K/V into the resident cache) = "
             f"{report['tokens_per_s_per_user']:.0f} tokens/s per user; "
             f"{'every token equal to ONNX Runtime' if report['agree'] else 'TOKENS DIFFER from ONNX Runtime'}"
             + ("" if report.get("sampling", "greedy") == "greedy" else
                f" (sampled at temperature {report['sampling']['temperature']}, top-k "
                f"{report['sampling']['top_k'] or 'all'}, one draw a step for both)"))
    text += f"\nprompt ids {report['prompt']}; generated ids {report['tokens']}"
    if "text" in report:
        text += f"\ntext: {report['text']!r}"
    return text


def write_json(report: dict, path) -> None:
    Path(path).write_text(json.dumps(report, indent=1))
