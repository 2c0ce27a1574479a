"""PyTorch modules through ``lpx_tvm.from_pytorch`` (torch.export, then TVM's ExportedProgram importer), each
compared with torch itself; Hugging Face models from configs with seeded random weights, nothing downloaded."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs the optional dependency torch (lpx-tvm[torch])")

import lpx_tvm  # noqa: E402
from conftest import run_on_lpx  # noqa: E402
from lpx_tvm.runtime import total_offloaded_calls  # noqa: E402


def _cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_an_mlp_from_pytorch_runs_on_lpx_in_one_program_and_matches_torch():
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    x = torch.randn(4, 64)
    compiled = lpx_tvm.compile(mlp, config="tiny", example_inputs=(x,))
    (out,) = run_on_lpx(compiled, [x.numpy()], programs=1)
    with torch.no_grad():
        expected = mlp(x).numpy()
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    assert mlp.training  # exported in eval mode, given back as it came


class _LastHidden(torch.nn.Module):
    """A Hugging Face model's ``last_hidden_state``: the tensor torch.export and lpx compare on."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x).last_hidden_state


def _hf(name):
    transformers = pytest.importorskip("transformers", reason="needs the optional dependency transformers (lpx-tvm[hf])")
    torch.manual_seed(0)
    if name == "bert":
        config = transformers.BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=256, vocab_size=1000, max_position_embeddings=64)
        return _LastHidden(transformers.BertModel(config)), torch.randint(0, 1000, (1, 16))
    config = transformers.ViTConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=256, image_size=32, patch_size=8)
    return _LastHidden(transformers.ViTModel(config)), torch.randn(1, 3, 32, 32)


@pytest.mark.parametrize("name", ["bert", "vit"])
@pytest.mark.slow
def test_hugging_face_encoders_from_pytorch_put_their_flops_on_lpx_and_match_torch(name):
    model, x = _hf(name)
    compiled = lpx_tvm.compile(lpx_tvm.from_pytorch(model, x), config="tsp")
    assert compiled.report.offloaded_pct >= 99.0, compiled.report.summary()
    calls = total_offloaded_calls()
    out = compiled(x.numpy())
    # each layer's attention leaves torch's safe-softmax fix-up (equal, max, logical_not, where) on the host,
    # which cuts the graph after that layer's scores: 2 layers make 3 lpx programs, each run once
    assert compiled.report.lpx_functions == 3, compiled.report.summary()
    assert compiled.report.host_ops["relax.where"] == 2 * 2 and compiled.report.host_ops["relax.max"] == 2
    assert total_offloaded_calls() - calls == 3
    with torch.no_grad():
        expected = model.eval()(x).numpy()
    assert _cosine(out[0] if isinstance(out, (list, tuple)) else out, expected) >= 0.9999


def test_what_from_pytorch_cannot_take_is_named():
    with pytest.raises(ValueError, match="takes a torch.nn.Module, got str"):
        lpx_tvm.from_pytorch("model.onnx", torch.zeros(1))
    with pytest.raises(ValueError, match="example input 0 is a ndarray, not a torch.Tensor"):
        lpx_tvm.from_pytorch(torch.nn.ReLU(), np.zeros(3))
    with pytest.raises(ValueError, match="compiles on example inputs"):
        lpx_tvm.compile(torch.nn.ReLU())

    class DataDependent(torch.nn.Module):
        def forward(self, x):
            return x[x > 0]  # a shape that depends on the values: torch.export refuses it

    with pytest.raises(ValueError, match="cannot"):
        lpx_tvm.from_pytorch(DataDependent(), torch.randn(8))


@pytest.mark.slow
def test_a_hugging_face_llama_exported_by_torch_onnx_compiles_to_one_program():
    """LlamaForCausalLM (2 layers, GQA, random weights) through torch.onnx (dynamo): its K/V heads repeated
    for the query heads (Expand) and PyTorch's safe softmax (where(isnan(·), 0, ·)) run on lpx, so the
    decoder is one program; only the lookups by token id and position (take, and the index wrap of a
    negative id) stay on the host. Logits as ORT's."""
    transformers = pytest.importorskip("transformers", reason="needs the optional dependency transformers (lpx-tvm[hf])")
    pytest.importorskip("onnxscript", reason="needs the optional dependency onnxscript (torch.onnx's exporter)")
    import onnxruntime as ort

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128, vocab_size=256,
                                      max_position_embeddings=128)
    model = transformers.LlamaForCausalLM(config).eval()

    class Logits(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, ids):
            return self.model(input_ids=ids, use_cache=False).logits

    ids = torch.randint(0, 256, (1, 8))
    onnx_model = torch.onnx.export(Logits(model).eval(), (ids,), dynamo=True, verbose=False).model_proto
    compiled = lpx_tvm.compile(onnx_model, config="tsp")
    assert compiled.report.lpx_functions == 1, compiled.report.summary()
    assert set(op.removeprefix("relax.") for op in compiled.report.host_ops) <= {
        "take", "less", "where", "add", "shape_to_tensor"}, compiled.report.summary()
    calls = total_offloaded_calls()
    out = compiled(ids.numpy())
    assert total_offloaded_calls() - calls == 1
    want = ort.InferenceSession(onnx_model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {onnx_model.graph.input[0].name: ids.numpy()})[0]
    np.testing.assert_allclose(out[0] if isinstance(out, (list, tuple)) else out, want, rtol=1e-4, atol=1e-5)



def _resnet18():
    """torchvision's resnet18, written out (torchvision's PyPI wheel does not load with the CPU torch): a 7×7
    stride-2 stem, a max pool, four stages of two basic blocks (64, 128, 256, 512 channels, the first block of
    each later stage strided, with a 1×1 projection), a global average pool and a 1000-way classifier."""
    nn = torch.nn

    class Basic(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
            self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
            self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else nn.Identity())

        def forward(self, x):
            y = torch.relu(self.bn1(self.conv1(x)))
            return torch.relu(self.bn2(self.conv2(y)) + self.down(x))

    stages, cin = [], 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        stages += [Basic(cin, cout, stride), Basic(cout, cout, 1)]
        cin = cout
    return nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1),
                         *stages, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 1000))


@pytest.mark.slow
def test_a_resnet18_from_pytorch_puts_its_flops_on_lpx_and_matches_torch():
    """resnet18 with seeded random weights (its batch norms' statistics drawn too, so they are not identities),
    through torch.export and TVM's ExportedProgram importer."""
    torch.manual_seed(0)
    model = _resnet18()
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.running_mean.normal_(0, 0.1)
            module.running_var.uniform_(0.5, 1.5)
    model.train(False)
    x = torch.randn(1, 3, 224, 224)
    compiled = lpx_tvm.compile(lpx_tvm.from_pytorch(model, x), config="tsp")
    assert compiled.report.offloaded_pct >= 99.0, compiled.report.summary()
    calls = total_offloaded_calls()
    out = compiled(x.numpy())
    assert total_offloaded_calls() - calls == compiled.report.lpx_functions
    with torch.no_grad():
        expected = model(x).numpy()
    assert _cosine(out[0] if isinstance(out, (list, tuple)) else out, expected) >= 0.9999
