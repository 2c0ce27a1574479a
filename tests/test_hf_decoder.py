"""Decoders in Hugging Face form through ``generate``: random-weight transformers models (nothing downloaded),
exported by torch.onnx with their KV cache as inputs and outputs (optimum's names), each run on lpx with the
cache resident and checked against transformers' own greedy ``generate``."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="needs the optional dependency torch (lpx-tvm[hf])")
pytest.importorskip("transformers", reason="needs the optional dependency transformers (lpx-tvm[hf])")
pytest.importorskip("onnxscript", reason="needs the optional dependency onnxscript (torch.onnx's exporter)")

from lpx_tvm.app.cli import main  # noqa: E402
from lpx_tvm.app.llm.generate import generate  # noqa: E402
from lpx_tvm.app.llm.hf_decoder import HFDecoder, export_decoder, random_causal_lm  # noqa: E402
from lpx_tvm.runtime import total_offloaded_calls  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [5, 17, 99, 3, 42, 7]
TOKENS = 16
pytestmark = pytest.mark.slow


def _transformers_greedy(model, prompt, new_tokens: int) -> list:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False)
    return out[0, len(prompt):].tolist()


def _first_miss_is_a_near_tie(report, margin: float) -> None:
    """Tokens may part only where ORT's own logits put the two tokens within ``margin`` (after that, the two
    histories differ and are not compared)."""
    miss = next((s for s in report["steps"] if s["token"] != s["reference_token"]), None)
    assert miss is None or miss["reference_margin"] < margin, miss



def _position_sensitive(model):
    """The model with every matrix (projections, embeddings, head) scaled by 10: std 0.2, GPT-2's
    initializer_range here. At transformers' default 0.02 attention is near-uniform and the tokens barely depend
    on positions (Llama's repeat 83, 73, 83, 73 ...), so a decode step fed the wrong position would pass."""
    if model.config.model_type != "gpt2":  # (random_causal_lm draws GPT-2 at std 0.2 already)
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.dim() == 2:
                    parameter.mul_(10)
    return model


def _greedy_with_positions(model, prompt, new_tokens: int, shift: int) -> list:
    """Greedy tokens with no cache, each step run over the whole sequence, the prompt at positions 0 .. n-1 and
    every generated token ``shift`` positions later than its place (``shift=1``: a decode position off by one)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            positions = list(range(len(prompt))) + [p + shift for p in range(len(prompt), len(ids))]
            logits = model(input_ids=torch.tensor([ids]), position_ids=torch.tensor([positions])).logits
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(arch, sharp) ─► (its transformers model, the folder torch.onnx's export went to), made once; ``sharp``:
    the weights :func:`_position_sensitive` makes."""
    made = {}

    def get(arch, sharp=False):
        if (arch, sharp) not in made:
            model = random_causal_lm(arch, layers=4)
            if sharp:
                model = _position_sensitive(model)
            folder = tmp_path_factory.mktemp(f"{arch}-sharp" if sharp else arch)
            export_decoder(model, folder)
            made[arch, sharp] = model, folder
        return made[arch, sharp]
    return get


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gpt2"])
def test_a_hugging_face_decoder_generates_transformers_own_greedy_tokens_in_one_program(exported, arch):
    """One chip, 16 tokens after a 6-token prompt. 4 layers, of which TVM merges the 3 identical ones into one
    function: each cache still gets its own resident slot (it did not, silently, before). The weights make the
    tokens depend on their positions: decoded with every generated token one position late, transformers
    itself gives other tokens, so a decode step fed the wrong position cannot pass."""
    model, folder = exported(arch, sharp=True)
    want = _transformers_greedy(model, PROMPT, TOKENS + 1)
    assert _greedy_with_positions(model, PROMPT, TOKENS + 1, shift=0) == want
    shifted = _greedy_with_positions(model, PROMPT, TOKENS + 1, shift=1)
    assert shifted[0] == want[0] and sum(a != b for a, b in zip(shifted, want)) >= TOKENS // 2
    calls = total_offloaded_calls()
    report = generate(folder, tokens=TOKENS, prompt_ids=PROMPT)
    assert report["tokens"] == want
    assert report["agree"] and min(s["cosine"] for s in report["steps"]) > 0.99999
    assert report["programs"] == {"prefill": 1, "decode": 1}
    assert total_offloaded_calls() - calls == 1 + TOKENS  # the prefill, then each step: all on lpx
    assert report["context"] == len(PROMPT) + TOKENS


def test_a_hugging_face_decoder_on_a_tsp_node_pipeline_gives_the_same_tokens(exported):
    """The prefill and each step: one system program each (every chip's part of it in one call)."""
    model, folder = exported("llama", sharp=True)
    calls = total_offloaded_calls()
    report = generate(folder, tokens=TOKENS, prompt_ids=PROMPT, system="tsp-node", parallel="pipeline")
    assert total_offloaded_calls() - calls == 1 + TOKENS
    assert report["tokens"] == _transformers_greedy(model, PROMPT, TOKENS + 1)
    assert len(report["chips"]) == 7  # a stage a chip, the LM head's chip included


def test_a_hugging_face_decoder_in_fp16_keeps_onnx_runtime_s_tokens_but_at_a_near_tie(exported):
    """fp16 storage on the chips against the fp32 graph in ORT: a token may differ only where ORT's own logits
    put the two tokens within fp16's rounding of each other (the report's reference_margin)."""
    _, folder = exported("qwen2")
    report = generate(folder, tokens=TOKENS, prompt_ids=PROMPT, dtype="fp16")
    _first_miss_is_a_near_tie(report, 1e-2)
    assert min(s["cosine"] for s in report["steps"]) > 0.999


def test_the_lpx_graph_returns_only_the_new_positions_of_each_cache(exported):
    """A step sends back one slot a cache, not the concatenated past (25 slots here)."""
    _, folder = exported("llama")
    decoder = HFDecoder(folder)
    (graph, _), (_, decode_shapes) = decoder.graphs(prompt_len=6, context=24)
    assert [o.name for o in graph.graph.output] == ["logits", *[f"new.{i}.{k}" for i in range(4)
                                                                for k in ("key", "value")]]
    assert decode_shapes["attention_mask"] == [1, 25] and decode_shapes["past_key_values.3.value"] == [1, 2, 24, 16]


def test_the_readme_s_hugging_face_commands_run(tmp_path):
    """The README's lines: write a decoder as optimum lays one out, then generate from it with no flags (one
    chip), from its .onnx file, and from a text prompt through its tokenizer.json."""
    tokenizers = pytest.importorskip("tokenizers", reason="needs the optional dependency tokenizers")
    folder = tmp_path / "hf-llama"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "hf_decoder.py"), "llama", str(folder)], check=True,
                   capture_output=True)
    assert {p.name for p in folder.iterdir()} >= {"model.onnx", "config.json", "tokenizer.json"}
    assert json.loads((folder / "config.json").read_text())["num_hidden_layers"] == 4
    assert main(["generate", str(folder), "--tokens", "4", "--json", str(tmp_path / "a.json")]) == 0
    one_chip = json.loads((tmp_path / "a.json").read_text())
    assert one_chip["parallel"] == "single chip" and len(one_chip["tokens"]) == 5
    assert main(["generate", str(folder / "model.onnx"), "--tokens", "4", "--json", str(tmp_path / "b.json")]) == 0
    assert json.loads((tmp_path / "b.json").read_text())["tokens"] == one_chip["tokens"]  # the same seeded prompt
    assert main(["generate", str(folder), "--prompt", "the cat sat on the mat", "--tokens", "4",
                 "--json", str(tmp_path / "c.json")]) == 0
    text = json.loads((tmp_path / "c.json").read_text())
    tokenizer = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert text["prompt"] == [tokenizer.token_to_id(w) for w in "the cat sat on the mat".split()]
    assert text["text"] == " ".join(tokenizer.id_to_token(t) for t in text["tokens"])


def test_what_a_hugging_face_decoder_cannot_be_is_named(tmp_path, exported):
    _, folder = exported("llama")
    with pytest.raises(ValueError, match="exceed the cache's context of 8"):
        generate(folder, tokens=4, prompt_ids=PROMPT, context=8)
    with pytest.raises(ValueError, match="exceeds the model's 128 positions"):
        generate(folder, tokens=4, prompt_ids=PROMPT, context=200)
    with pytest.raises(ValueError, match=r"prompt ids must be tokens of the vocabulary \(0 to 255\), got \[300\]"):
        generate(folder, tokens=4, prompt_ids=[300])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="nor a graph in Hugging Face form"):
        generate(empty, tokens=2)


def test_a_hugging_face_decoder_in_int8_runs_its_qdq_graph_as_onnx_runtime_does(exported):
    """``dtype="int8"`` on the float graph: ORT's quantiser makes it QDQ (calibrated on seeded steps), lpx
    runs it with int8 kernels in one program a step, and ORT runs the same QDQ graph. PyTorch's safe softmax
    then tests the softmax for NaN and selects from its quantised copy (NAN_SELECT), on the chip."""
    _, folder = exported("llama")
    calls = total_offloaded_calls()
    report = generate(folder, tokens=8, prompt_ids=PROMPT, dtype="int8")
    assert report["quantised"].startswith("quantised by ONNX Runtime's static quantiser")
    assert report["programs"] == {"prefill": 1, "decode": 1}
    assert total_offloaded_calls() - calls == 1 + 8
    _first_miss_is_a_near_tie(report, 0.05)  # a step of the logits' int8 scale
    assert min(s["cosine"] for s in report["steps"]) > 0.999


def test_a_graph_that_is_no_decoder_or_no_file_is_named(tmp_path):
    import onnx
    from onnx import helper

    from conftest import make_model, tensor_info

    path = tmp_path / "relu.onnx"
    onnx.save(make_model([helper.make_node("Relu", ["x"], ["y"])], [tensor_info("x", [2])], [tensor_info("y", [2])],
                         []), str(path))
    with pytest.raises(ValueError, match="relu.onnx is not a decoder in Hugging Face form: it has no past_key_values"):
        generate(path, tokens=2)
    with pytest.raises(ValueError, match="missing.onnx: no such file"):
        generate(tmp_path / "missing.onnx", tokens=2)
