"""Write a small random-weight Hugging Face decoder as optimum lays one out, for ``lpx-tvm generate DIR``:
``model.onnx`` (torch.onnx, past_key_values.N in, present.N out), ``config.json`` and a word-level
``tokenizer.json``. Nothing is downloaded; needs ``pip install -e ".[hf]"`` and the tokenizers package.

    python scripts/hf_decoder.py llama /tmp/hf-llama [--layers 4] [--seed 0]
"""

import argparse

from lpx_tvm.app.llm.hf_decoder import ARCHITECTURES, export_decoder, random_causal_lm, word_tokenizer

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("arch", choices=ARCHITECTURES)
parser.add_argument("out", help="the folder to write")
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()
model = random_causal_lm(args.arch, args.layers, args.seed)
graph = export_decoder(model, args.out)
word_tokenizer(model.config.vocab_size, graph.parent / "tokenizer.json")
print(f"wrote {graph.parent}: model.onnx, config.json, tokenizer.json ({args.arch}, {args.layers} layers)")
