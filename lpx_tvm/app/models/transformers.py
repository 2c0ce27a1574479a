"""Transformer models built offline with onnx.helper and seeded weights (no torch needed).

Both use the ops PyTorch's exporter writes: MatMul + Add for linear layers,
Reshape/Transpose for heads, Softmax, LayerNormalization, and GELU as
``x * 0.5 * (1 + Erf(x / sqrt 2))``. Token and position embeddings are a Gather
on the host (no FLOPs); everything else can run on lpx.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


class _Builder:
    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.nodes, self.inits = [], []
        self.count = 0

    def name(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}_{self.count}"

    def const(self, value: np.ndarray, prefix: str = "c") -> str:
        name = self.name(prefix)
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def weight(self, shape, std: float) -> str:
        return self.const((self.rng.standard_normal(shape) * std).astype(np.float32), "w")

    def op(self, op_type: str, inputs, **attrs) -> str:
        out = self.name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], **attrs))
        return out

    def linear(self, x: str, d_in: int, d_out: int) -> str:
        y = self.op("MatMul", [x, self.weight((d_in, d_out), 1 / np.sqrt(d_in))])
        return self.op("Add", [y, self.weight((d_out,), 0.02)])

    def layer_norm(self, x: str, d: int) -> str:
        gamma = self.const((1 + 0.1 * self.rng.standard_normal(d)).astype(np.float32))
        beta = self.const((0.1 * self.rng.standard_normal(d)).astype(np.float32))
        return self.op("LayerNormalization", [x, gamma, beta], axis=-1, epsilon=1e-5)

    def gelu(self, x: str) -> str:
        scaled = self.op("Div", [x, self.const(np.float32(np.sqrt(2.0)))])
        erf = self.op("Erf", [scaled])
        one_plus = self.op("Add", [erf, self.const(np.float32(1.0))])
        half = self.op("Mul", [x, self.const(np.float32(0.5))])
        return self.op("Mul", [half, one_plus])

    def attention(self, x: str, seq: int, hidden: int, heads: int, causal: bool) -> str:
        dh = hidden // heads
        split = self.const(np.array([1, seq, heads, dh], np.int64))

        def heads_of(t, perm):
            return self.op("Transpose", [self.op("Reshape", [t, split])], perm=perm)
        q = heads_of(self.linear(x, hidden, hidden), [0, 2, 1, 3])
        k_t = heads_of(self.linear(x, hidden, hidden), [0, 2, 3, 1])
        v = heads_of(self.linear(x, hidden, hidden), [0, 2, 1, 3])
        scores = self.op("Div", [self.op("MatMul", [q, k_t]), self.const(np.float32(np.sqrt(dh)))])
        if causal:
            mask = np.triu(np.full((seq, seq), -1e4, np.float32), k=1)
            scores = self.op("Add", [scores, self.const(mask)])
        ctx = self.op("MatMul", [self.op("Softmax", [scores], axis=-1), v])
        merged = self.op("Reshape", [self.op("Transpose", [ctx], perm=[0, 2, 1, 3]),
                                     self.const(np.array([1, seq, hidden], np.int64))])
        return self.linear(merged, hidden, hidden)

    def mlp(self, x: str, hidden: int) -> str:
        return self.linear(self.gelu(self.linear(x, hidden, 4 * hidden)), 4 * hidden, hidden)

    def embed(self, vocab: int, seq: int, hidden: int) -> str:
        table = self.weight((vocab, hidden), 0.5)
        tokens = self.op("Gather", [table, "input_ids"], axis=0)
        return self.op("Add", [tokens, self.weight((1, seq, hidden), 0.1)])

    def model(self, output: str, seq: int, out_shape, name: str, given=None) -> onnx.ModelProto:
        """The graph as a model: its input the token ids, or ``given`` (a value info) where it starts later."""
        self.nodes.append(helper.make_node("Identity", [output], ["output"]))
        given = given or helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, seq])
        graph = helper.make_graph(self.nodes, name, [given],
                                  [helper.make_tensor_value_info("output", TensorProto.FLOAT, out_shape)],
                                  self.inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def bert_encoder(layers: int = 2, hidden: int = 256, heads: int = 4, seq: int = 64, vocab: int = 1000,
                 seed: int = 0) -> onnx.ModelProto:
    """A BERT-style (post-LayerNorm) encoder returning the last hidden states."""
    b = _Builder(seed)
    x = b.layer_norm(b.embed(vocab, seq, hidden), hidden)
    for _ in range(layers):
        x = b.layer_norm(b.op("Add", [x, b.attention(x, seq, hidden, heads, causal=False)]), hidden)
        x = b.layer_norm(b.op("Add", [x, b.mlp(x, hidden)]), hidden)
    return b.model(x, seq, [1, seq, hidden], "bert_encoder")


def bert_base(layers: int = 12, hidden: int = 768, heads: int = 12, seq: int = 128, seed: int = 0) -> onnx.ModelProto:
    """BERT-base's encoder layers (12 × hidden 768, 12 heads, FFN 3072, erf GELU, LayerNormalization), from the
    embedded hidden state (``hidden_states`` ``[1, seq, hidden]``) to the last layer's."""
    b = _Builder(seed)
    x = "hidden_states"
    for _ in range(layers):
        x = b.layer_norm(b.op("Add", [x, b.attention(x, seq, hidden, heads, causal=False)]), hidden)
        x = b.layer_norm(b.op("Add", [x, b.mlp(x, hidden)]), hidden)
    given = helper.make_tensor_value_info("hidden_states", TensorProto.FLOAT, [1, seq, hidden])
    return b.model(x, seq, [1, seq, hidden], "bert_base", given)


def gpt2_decoder(layers: int = 2, hidden: int = 256, heads: int = 4, seq: int = 64, vocab: int = 1000,
                 seed: int = 0) -> onnx.ModelProto:
    """A GPT-2-style (pre-LayerNorm) decoder stack with causal attention, returning logits."""
    b = _Builder(seed)
    x = b.embed(vocab, seq, hidden)
    for _ in range(layers):
        x = b.op("Add", [x, b.attention(b.layer_norm(x, hidden), seq, hidden, heads, causal=True)])
        x = b.op("Add", [x, b.mlp(b.layer_norm(x, hidden), hidden)])
    logits = b.op("MatMul", [b.layer_norm(x, hidden), b.weight((hidden, vocab), 1 / np.sqrt(hidden))])
    return b.model(logits, seq, [1, seq, vocab], "gpt2_decoder")
