"""A decoder past 2 GB, as every exporter stores one, through ``generate`` and ``compile``, with its peak memory.

Builds a Hugging Face Llama with seeded random weights (hidden 1024, 2 layers, a vocabulary sized so that its
fp32 weights pass ``--gb`` GB; nothing is downloaded), exports it with ``torch.onnx`` (its weights as external
data, ``model.onnx.data``), then runs, each in a process of its own under ``/usr/bin/time``:

- ``lpx-tvm generate model.onnx --tokens N``: lpx's tokens against ONNX Runtime's, step by step;
- ``lpx-tvm compile model.onnx -o model.so`` (``--compile program``: ``--emit-program`` only, no library),
  the decode step pinned to one token over a past of 8;
- the library reloaded (``tvm.runtime.load_module``) and run on one decode step's seeded inputs, its logits
  against ONNX Runtime's on the same inputs.

Prints one JSON line: the weights' bytes, and per command its peak resident memory, that peak over the
weights, the wall time and (for ``generate``) whether every token equals ORT's. The fixed overhead is the
peak of the same ``generate`` on the same decoder with a vocabulary of 1,000 (``--baseline``). Exits 1 when
a command fails or a token differs. Needs ``pip install -e ".[hf]"``.

    python scripts/large_decoder.py --gb 2.2 --baseline
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE = 1024, 2, 16, 4, 4096


def vocabulary_for(gigabytes: float) -> int:
    """The vocabulary whose embedding table and (untied) head put the fp32 weights past ``gigabytes`` GB."""
    head_dim = HIDDEN // HEADS
    per_layer = HIDDEN * (2 * HIDDEN + 2 * KV_HEADS * head_dim) + 3 * HIDDEN * INTERMEDIATE + 2 * HIDDEN
    rest = LAYERS * per_layer + HIDDEN  # (the final norm)
    return max(1, -(-(int(gigabytes * 1e9) // 4 - rest) // (2 * HIDDEN)))


def build(directory: Path, vocab: int, seed: int = 0) -> Path:
    """Export the random-weight Llama to ``directory/model.onnx`` (and ``config.json``); returns the graph."""
    import torch
    import transformers

    from lpx_tvm.app.llm.hf_decoder import export_decoder

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                      num_key_value_heads=KV_HEADS, intermediate_size=INTERMEDIATE,
                                      vocab_size=vocab, max_position_embeddings=256, tie_word_embeddings=False)
    return export_decoder(transformers.LlamaForCausalLM(config).train(False), directory)


def timed(command: list) -> dict:
    """Run ``command``; its exit status, wall time and peak resident memory: ``/usr/bin/time``'s, or where that is
    not installed the same kernel figure (``getrusage``) read by a small parent of its own, so that each command's
    peak is its own."""
    time_bin = shutil.which("time")
    if time_bin:
        wrapped = [time_bin, "-f", "PEAK_KB %M", *command]
    else:
        wrapped = [sys.executable, "-c", "import resource, subprocess, sys; done = subprocess.run(sys.argv[1:]); "
                   "print('PEAK_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
                   "sys.exit(done.returncode)", *command]
    start = time.perf_counter()
    done = subprocess.run(wrapped, capture_output=True, text=True)
    lines = [line for line in done.stderr.splitlines() if line.startswith("PEAK_KB ")]
    peak_kb = int(lines[-1].split()[1]) if lines else 0
    return {"returncode": done.returncode, "wall_s": round(time.perf_counter() - start, 1),
            "peak_gb": round(peak_kb * 1024 / 1e9, 3), "stdout": done.stdout, "stderr": done.stderr}


def decode_shapes(past: int = 8) -> list:
    """``--input-shape`` flags pinning the graph to one token over ``past`` positions."""
    shapes = {"input_ids": [1, 1], "attention_mask": [1, past + 1], "position_ids": [1, 1]}
    head_dim = HIDDEN // HEADS
    shapes.update({f"past_key_values.{layer}.{kind}": [1, KV_HEADS, past, head_dim]
                   for layer in range(LAYERS) for kind in ("key", "value")})
    return [flag for name, dims in shapes.items() for flag in ("--input-shape", f"{name}={','.join(map(str, dims))}")]


def run_generate(graph: Path, tokens: int) -> dict:
    out = graph.parent / "generate.json"
    run = timed([sys.executable, "-m", "lpx_tvm.app", "generate", str(graph), "--tokens", str(tokens),
                 "--json", str(out)])
    if run["returncode"] == 0:
        report = json.loads(out.read_text())
        run.update(agree=report["agree"], tokens=report["tokens"], reference_tokens=report["reference_tokens"],
                   lpx_programs=report["programs"])
    return run


def decode_inputs(past: int = 8, seed: int = 0) -> dict:
    """One decode step's inputs for :func:`decode_shapes`: a token at position ``past`` over a seeded past."""
    import numpy as np

    rng = np.random.default_rng(seed)
    head_dim = HIDDEN // HEADS
    feeds = {"input_ids": np.array([[7]], np.int64), "attention_mask": np.ones((1, past + 1), np.int64),
             "position_ids": np.array([[past]], np.int64)}
    feeds.update({f"past_key_values.{layer}.{kind}": rng.standard_normal((1, KV_HEADS, past, head_dim), np.float32)
                  for layer in range(LAYERS) for kind in ("key", "value")})
    return feeds


_RUN_LIBRARY = """
import sys, numpy as np, tvm, lpx_tvm
from tvm import relax
feeds = np.load(sys.argv[2])
vm = relax.VirtualMachine(tvm.runtime.load_module(sys.argv[1]), tvm.cpu())
out = vm["main"](*[tvm.runtime.tensor(feeds[name]) for name in feeds.files])
np.save(sys.argv[3], out[0].numpy())
print("lpx calls", lpx_tvm.runtime.total_offloaded_calls())
"""


def run_library(graph: Path) -> dict:
    """The library ``compile -o`` wrote, reloaded in a process of its own and run on one decode step; its logits
    against ONNX Runtime's (run here, after it)."""
    import numpy as np
    import onnxruntime as ort

    feeds = decode_inputs()
    np.savez(graph.parent / "feeds.npz", **feeds)
    logits = graph.parent / "logits.npy"
    run = timed([sys.executable, "-c", _RUN_LIBRARY, str(graph.with_suffix(".so")), str(graph.parent / "feeds.npz"),
                 str(logits)])
    if run["returncode"] == 0:
        session = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
        wanted = {i.name for i in session.get_inputs()}
        reference = session.run(["logits"], {k: v for k, v in feeds.items() if k in wanted})[0]
        got = np.load(logits)
        run.update(lpx_calls=int(run["stdout"].split("lpx calls")[-1]),
                   max_abs_err=float(np.abs(got - reference).max()),
                   same_token=bool(got[0, -1].argmax() == reference[0, -1].argmax()))
    return run


def run_compile(graph: Path, what: str) -> dict:
    target = ["-o", str(graph.with_suffix(".so"))] if what == "library" else [
        "--emit-program", str(graph.with_suffix(".bin"))]
    return timed([sys.executable, "-m", "lpx_tvm.app", "compile", str(graph), *decode_shapes(), *target])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=2.2, help="fp32 weights past this many GB (default 2.2)")
    parser.add_argument("--tokens", type=int, default=4, help="decode steps (default 4)")
    parser.add_argument("--compile", choices=("library", "program", "none"), default="library",
                        help="what compile writes (default library: -o model.so)")
    parser.add_argument("--baseline", action="store_true",
                        help="also run generate on the same decoder with a vocabulary of 1,000 (the fixed overhead)")
    args = parser.parse_args(argv)
    result, ok = {}, True
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        graph = build(Path(tmp) / "large", vocabulary_for(args.gb))
        result["build_s"] = round(time.perf_counter() - start, 1)
        weights = sum(f.stat().st_size for f in graph.parent.glob("model.onnx*"))  # (the graph with its data)
        result["weights_gb"] = round(weights / 1e9, 3)
        runs = {"generate": run_generate(graph, args.tokens)}
        if args.compile != "none":
            runs[f"compile_{args.compile}"] = run_compile(graph, args.compile)
        if args.compile == "library" and runs["compile_library"]["returncode"] == 0:
            runs["run_library"] = run_library(graph)
        if args.baseline:
            runs["generate_vocab_1000"] = run_generate(build(Path(tmp) / "small", 1000), args.tokens)
        for name, run in runs.items():
            if run["returncode"] != 0 or run.get("agree") is False or run.get("same_token") is False:
                ok = False
                print(f"{name} failed:\n{run['stderr'][-3000:]}", file=sys.stderr)
            run.pop("stdout"), run.pop("stderr")
            if name != "generate_vocab_1000":
                run["peak_over_weights"] = round(run["peak_gb"] * 1e9 / weights, 2)
        result.update(runs)
    if "generate_vocab_1000" in result:
        overhead = result["generate_vocab_1000"]["peak_gb"]
        for name in ("generate", f"compile_{args.compile}", "run_library"):
            if name in result:
                result[name]["peak_less_overhead_over_weights"] = round(
                    (result[name]["peak_gb"] - overhead) * 1e9 / weights, 2)
    print(json.dumps(result))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
