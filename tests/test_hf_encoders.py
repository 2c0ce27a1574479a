"""Hugging Face encoders (random weights from configs, nothing downloaded) exported to ONNX by either of
torch.onnx's exporters, in fp16 on lpx against ONNX Runtime in fp32: their attention masks hold float32's
lowest, which made every output NaN in fp16 before it saturated."""

import io

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch", reason="needs the optional dependency torch (lpx-tvm[hf])")
transformers = pytest.importorskip("transformers", reason="needs the optional dependency transformers (lpx-tvm[hf])")
pytest.importorskip("onnxscript", reason="needs the optional dependency onnxscript (torch.onnx's exporter)")

import lpx_tvm  # noqa: E402
from conftest import ort_reference  # noqa: E402
from lpx_tvm.runtime import total_offloaded_calls  # noqa: E402

pytestmark = pytest.mark.slow


class _LastHidden(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def _encoder(name):
    torch.manual_seed(0)
    if name == "bert":
        return transformers.BertModel(transformers.BertConfig(
            hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256, vocab_size=1000,
            max_position_embeddings=64))
    if name == "distilbert":
        return transformers.DistilBertModel(transformers.DistilBertConfig(
            dim=128, n_layers=2, n_heads=4, hidden_dim=256, vocab_size=1000, max_position_embeddings=64))
    return transformers.T5EncoderModel(transformers.T5Config(d_model=128, num_layers=2, num_heads=4, d_ff=256,
                                                             d_kv=32, vocab_size=1000))


def _export(model, args, dynamo: bool) -> onnx.ModelProto:
    names = ["input_ids", "attention_mask"]
    if dynamo:
        return torch.onnx.export(model, args, input_names=names, dynamo=True, verbose=False).model_proto
    buffer = io.BytesIO()
    torch.onnx.export(model, args, buffer, input_names=names, dynamo=False)
    return onnx.load_from_string(buffer.getvalue())


# T5 goes through the TorchScript exporter: torch.onnx's dynamo path fails on its attention's view
@pytest.mark.parametrize("name, dynamo", [("bert", True), ("bert", False), ("distilbert", True), ("t5", False)])
def test_a_hugging_face_encoder_in_fp16_is_finite_one_program_and_matches_ort_in_fp32(name, dynamo):
    model = _LastHidden(_encoder(name)).eval()
    ids = torch.randint(0, 1000, (1, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(1, 16, dtype=torch.int64)
    mask[0, 12:] = 0  # padding: its keys are masked with float32's lowest
    graph = _export(model, (ids, mask), dynamo)
    compiled = lpx_tvm.compile(graph, config="tsp", dtype="fp16")
    assert compiled.report.lpx_functions == 1, compiled.report.summary()
    calls = total_offloaded_calls()
    (out,) = compiled(ids.numpy(), mask.numpy())
    assert total_offloaded_calls() - calls == 1
    (want,) = ort_reference(graph, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})
    assert np.isfinite(out).all()
    got, want = np.asarray(out, np.float64).ravel(), want.astype(np.float64).ravel()
    assert got @ want / (np.linalg.norm(got) * np.linalg.norm(want)) >= 0.999
