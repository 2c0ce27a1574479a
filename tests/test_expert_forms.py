"""Expert parallel on the forms exporters write, and the refusals when it cannot apply.

Hugging Face Mixtral and Qwen3-MoE blocks, random weights from their configs (nothing downloaded), exported by
``torch.onnx.export(dynamo=True)``: their experts' weights are gathered by index, which
:func:`lpx_tvm.expert_forms.dense_experts` rewrites into experts the strategy can spread, the router's top-k on lpx.
"""

import re

import numpy as np
import pytest

from conftest import mlp_stack, ort_reference, run_on_lpx
import lpx_tvm
from lpx_tvm.app.models.moe import MoeConfig, build_moe_block
from lpx_tvm.expert_forms import dense_experts
from lpx_tvm.codegen import SystemCompileError

HIDDEN, FFN, EXPERTS, TOP_K, TOKENS = 64, 32, 8, 2, 3


def test_expert_parallel_of_a_model_with_no_experts_is_refused_naming_why():
    model = mlp_stack(np.random.default_rng(0), [64, 64, 64], batch=2)
    # (the refusal is the model's, or the first function's where a strategy's chips are checked per function)
    with pytest.raises(SystemCompileError, match=r"no mixture of experts") as refused:
        lpx_tvm.compile(model, system="tsp-node", parallel="expert", chips=4)
    assert re.search(r"1 (chip )?of the 4 (chips )?asked for", str(refused.value)), refused.value


def test_expert_parallel_on_all_of_a_system_with_no_experts_is_refused():
    model = mlp_stack(np.random.default_rng(0), [64, 64], batch=2)
    with pytest.raises(SystemCompileError, match="1 chip of the 8 asked for"):
        lpx_tvm.compile(model, system="tsp-node", parallel="expert")


def test_more_chips_than_experts_is_refused_rather_than_using_fewer():
    from lpx_tvm.codegen.graph import Graph
    from lpx_tvm.codegen.parallel.expert import split_experts
    from lpx_tvm.runtime_sim import load_config
    from lpx_tvm.runtime_sim.system import load_system

    g = Graph()  # y = x + Σ_e relu(x @ W_e) @ V_e, four experts
    x = g.add_tensor((2, 8), "float32")
    g.inputs, acc = [x], None
    for e in range(4):
        h = g.add_node("matmul", [x, g.constant(np.ones((8, 4), np.float32))], (2, 4), "float32", f"e{e}.up")
        r = g.add_node("RELU", [h], (2, 4), "float32", f"e{e}.relu")
        y = g.add_node("matmul", [r, g.constant(np.ones((4, 8), np.float32))], (2, 8), "float32", f"e{e}.down")
        acc = y if acc is None else g.add_node("ADD", [acc, y], (2, 8), "float32", f"sum{e}")
    g.outputs = [g.add_node("ADD", [x, acc], (2, 8), "float32", "residual")]
    system = load_system("tsp-node")
    with pytest.raises(SystemCompileError, match=r"4 experts do not spread over 8 chips .*ask for 4 chips or fewer"):
        split_experts(g, load_config("tsp"), system, "fp32", 8)
    assert len(split_experts(g, load_config("tsp"), system, "fp32", 4).parts) == 4


def test_expert_parallel_on_one_chip_of_a_model_with_no_experts_runs():
    model = mlp_stack(np.random.default_rng(1), [64, 64], batch=2)
    x = np.random.default_rng(2).standard_normal((2, 64)).astype(np.float32)
    compiled = lpx_tvm.compile(model, system="tsp-node", parallel="expert", chips=1)
    (out,) = run_on_lpx(compiled, [x], programs=1)
    (sim,) = compiled.simulators.values()
    assert len(sim.sims) == 1
    np.testing.assert_allclose(out, ort_reference(model, {"x": x})[0], rtol=1e-5, atol=1e-5)


def test_dense_experts_refuses_a_model_with_no_router():
    with pytest.raises(ValueError, match="routes by a TopK; this model has none"):
        dense_experts(mlp_stack(np.random.default_rng(0), [64, 64], batch=2))


def test_dense_experts_refuses_a_model_without_static_shapes():
    from onnx import TensorProto, helper

    model = mlp_stack(np.random.default_rng(0), [64, 64], batch=2)
    model.graph.input[0].CopyFrom(helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64]))
    with pytest.raises(ValueError, match=r"needs static shapes; pin x\['batch', 64\]"):
        dense_experts(model)


def test_dense_experts_refuses_a_top_k_whose_experts_it_cannot_find():
    # the block moe.py builds takes its top-k with a host TopK over the softmax, then gathers by one-hot
    # products: no GatherND of stacked weights, so there is nothing to rewrite
    with pytest.raises(ValueError, match="no product scales the experts' outputs by the top-k weights"):
        dense_experts(build_moe_block(MoeConfig(hidden=64, ffn=32, experts=4)))


# ---- Hugging Face blocks as torch.onnx exports them -------------------------------------------------------------


def _hf_block(arch: str, seed: int = 0):
    """A Mixtral or Qwen3-MoE sparse MoE block with seeded random weights (std 0.1: the router's logits spread
    about 0.8, so which experts win depends on the token)."""
    import torch
    import transformers

    if arch == "mixtral":
        config = transformers.MixtralConfig(hidden_size=HIDDEN, intermediate_size=FFN, num_local_experts=EXPERTS,
                                            num_experts_per_tok=TOP_K)
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block
    elif arch == "qwen3_moe":  # Qwen3-MoE's default leaves the top-k probabilities as they are (norm_topk_prob=False)
        config = transformers.Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=FFN, num_experts=EXPERTS,
                                             num_experts_per_tok=TOP_K)
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block
    elif arch.startswith("deepseek_v3"):  # sigmoid scores, picked with a bias, renormalised, scaled; a shared expert
        groups = 2 if arch.endswith("grouped") else 1
        config = transformers.DeepseekV3Config(hidden_size=HIDDEN, moe_intermediate_size=FFN, n_routed_experts=EXPERTS,
                                               num_experts_per_tok=TOP_K, n_shared_experts=1, n_group=groups,
                                               topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True)
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE as Block
    else:  # gpt-oss: a router with a bias, softmax of the top-k logits, experts with biases and a clamped SwiGLU
        config = transformers.GptOssConfig(hidden_size=HIDDEN, intermediate_size=FFN, num_local_experts=EXPERTS,
                                           num_experts_per_tok=TOP_K)
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

        class Block(torch.nn.Module):  # (the MLP returns the router's scores too; its decoder layer drops them)
            def __init__(self, config):
                super().__init__()
                self.mlp = GptOssMLP(config)

            def forward(self, x):
                return self.mlp(x)[0]
    # the experts implementation torch.export can trace (eager loops over data-dependent experts, grouped_mm
    # calls an op the ONNX exporter has no translation for)
    config._experts_implementation = "batched_mm"
    torch.manual_seed(seed)
    block = Block(config).eval()
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.normal_(0.0, 0.1)
    return block


@pytest.fixture(scope="module")
def exported():
    """arch ─► (the block as torch.onnx exported it, that model rewritten by dense_experts), made once."""
    torch = pytest.importorskip("torch", reason="needs the optional dependency torch (lpx-tvm[hf])")
    pytest.importorskip("transformers", reason="needs the optional dependency transformers (lpx-tvm[hf])")
    pytest.importorskip("onnxscript", reason="needs the optional dependency onnxscript (torch.onnx's exporter)")
    made = {}

    def get(arch):
        if arch not in made:
            block = _hf_block(arch)
            example = torch.randn(1, TOKENS, HIDDEN)
            model = torch.onnx.export(block, (example,), dynamo=True, optimize=True, verbose=False).model_proto
            made[arch] = model, dense_experts(model)
        return made[arch]
    return get


def _tokens(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, TOKENS, HIDDEN)).astype(np.float32)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
@pytest.mark.slow
def test_an_exported_block_gathers_its_experts_and_the_rewrite_spreads_none_of_that_to_the_host(exported, arch):
    model, dense = exported(arch)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("TopK") == 1 and ops.count("GatherND") == 2  # the form torch.onnx writes
    ops = [n.op_type for n in dense.graph.node]
    assert "TopK" not in ops and "GatherND" not in ops
    assert ops.count("MatMul") == 3 * EXPERTS  # each expert's gate select, gate_up and down products
    assert ("Div" in ops) == (arch == "mixtral")  # Mixtral renormalises its top-k probabilities, Qwen3 here not


@pytest.mark.slow
def test_deepseek_v3_routing_over_one_group_is_rewritten_and_its_shared_expert_kept(exported):
    model, dense = exported("deepseek_v3")
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("TopK") == 3 and "Where" in ops and "GatherElements" in ops  # groups, then experts
    ops = [n.op_type for n in dense.graph.node]
    assert not {"TopK", "Where", "GatherElements", "GatherND", "ScatterElements"} & set(ops)
    assert ops.count("MatMul") == 3 * EXPERTS + 3  # each routed expert's select, gate_up, down; the shared one's 3


@pytest.mark.slow
def test_deepseek_v3_routing_limited_to_some_groups_is_refused_naming_why(exported):
    with pytest.raises(ValueError, match=r"limited to 1 groups of experts of 2 \(topk_group < n_group\)"):
        exported("deepseek_v3_grouped")


@pytest.mark.slow
def test_gpt_oss_experts_gather_biases_too_and_their_clamps_become_relus(exported):
    model, dense = exported("gpt_oss")
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("GatherND") == 4 and ops.count("Clip") == 2  # weights and biases; the SwiGLU's two clamps
    ops = [n.op_type for n in dense.graph.node]
    assert "Clip" not in ops and "GatherND" not in ops and "TopK" not in ops
    assert "Exp" in ops  # its gates are the softmax of the top-k logits


@pytest.mark.parametrize("arch, chips", [(arch, chips) for arch in ("mixtral", "qwen3_moe", "gpt_oss") for chips in (2, 4, 8)]
                         + [("deepseek_v3", 4), ("deepseek_v3", 8)])
@pytest.mark.slow
def test_an_exported_hf_block_runs_expert_parallel_on_the_chips_asked_and_matches_onnx_runtime(exported, arch,
                                                                                               chips):
    model, dense = exported(arch)
    x = _tokens(3)
    compiled = lpx_tvm.compile(dense, system="tsp-node", parallel="expert", chips=chips)
    # one program: the router, its top-k and gates, the experts and the combine all on lpx
    (out,) = run_on_lpx(compiled, [x], programs=1)
    (sim,) = compiled.simulators.values()
    assert len(sim.sims) == chips and len(set(sim.program.chips)) == chips
    assert sim.program.parallel == "expert"
    assert f"{EXPERTS} experts over {chips} chips" in sim.program.notes
    assert f"{EXPERTS // chips} a chip, 1 all-reduce" in sim.program.notes
    np.testing.assert_allclose(out, ort_reference(model, {model.graph.input[0].name: x})[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3"])
@pytest.mark.slow
def test_the_tokens_compared_are_routed_to_different_experts(exported, arch):
    # a gate that kept every expert, or the same two for every token, passes a comparison on tokens that all
    # take the same two: show the reference routes the tokens apart, so the match above tests the top-k
    import onnxruntime as ort

    model, _ = exported(arch)
    x = _tokens(3)
    topk = [n for n in model.graph.node if n.op_type == "TopK"][-1]  # (DeepSeek-V3's first ones pick groups)
    probe = type(model)()
    probe.CopyFrom(model)
    probe.graph.output.add().name = topk.output[1]
    session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    chosen = session.run([topk.output[1]], {model.graph.input[0].name: x})[0].reshape(TOKENS, TOP_K)
    assert len({tuple(sorted(row)) for row in chosen.tolist()}) > 1


def test_auto_says_it_chose_expert_for_an_exported_block(exported):
    model, dense = exported("qwen3_moe")
    x = _tokens(8)
    compiled = lpx_tvm.compile(dense, system="tsp-node", parallel="auto", chips=4)
    (out,) = run_on_lpx(compiled, [x], programs=1)
    (sim,) = compiled.simulators.values()
    assert len(sim.sims) == 4 and sim.program.notes.startswith("auto chose expert")
    np.testing.assert_allclose(out, ort_reference(model, {model.graph.input[0].name: x})[0], rtol=1e-5, atol=1e-5)


def test_compile_rewrites_the_exported_block_itself_under_expert_parallel(exported):
    # the gathered form has no expert of its own to place: lpx_tvm.compile rewrites it (dense_experts) before
    # spreading its experts, as the CLI does, and it runs on the chips asked for and equals ORT
    model, _ = exported("mixtral")
    x = _tokens(5)
    compiled = lpx_tvm.compile(model, system="tsp-node", parallel="expert", chips=4)
    (out,) = run_on_lpx(compiled, [x], programs=1)
    (sim,) = compiled.simulators.values()
    assert len(sim.sims) == 4 and sim.program.parallel == "expert"
    np.testing.assert_allclose(out, ort_reference(model, {model.graph.input[0].name: x})[0], rtol=1e-5, atol=1e-5)
    # under pipeline parallelism it is compiled as it came: the top-k and the gathers on the host
    assert lpx_tvm.compile(model, system="tsp-node", parallel="pipeline").report.host_ops["relax.topk"] == 1


# ---- experts of their own, gated by a ScatterElements and a Gather each (the form issue 50 met) ------------------


def _scatter_block(gates: str):
    """A hand-written block with ``nn.ModuleList`` SwiGLU experts: TopK of the router's logits, the gates
    scattered into zeros and each expert's column gathered. ``gates``: "softmax" (of the top-k logits, Mixtral's
    arithmetic) or "renormalised" (top-k of the softmax, over their sum)."""
    import torch
    from torch import nn

    class Expert(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(HIDDEN, FFN, bias=False)
            self.up = nn.Linear(HIDDEN, FFN, bias=False)
            self.down = nn.Linear(FFN, HIDDEN, bias=False)

        def forward(self, x):
            return self.down(nn.functional.silu(self.gate(x)) * self.up(x))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
            self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))

        def forward(self, x):
            logits = self.router(x)
            if gates == "softmax":
                values, index = torch.topk(logits, TOP_K, dim=-1)
                values = torch.softmax(values, dim=-1)
            else:
                values, index = torch.topk(torch.softmax(logits, dim=-1), TOP_K, dim=-1)
                values = values / values.sum(dim=-1, keepdim=True)
            dense = torch.zeros_like(logits).scatter(-1, index, values)
            return sum(dense[:, e].unsqueeze(-1) * expert(x) for e, expert in enumerate(self.experts))

    torch.manual_seed(1)
    return Block().eval()


@pytest.fixture(scope="module")
def scattered():
    """gates ─► the block torch.onnx exported, made once."""
    torch = pytest.importorskip("torch", reason="needs the optional dependency torch (lpx-tvm[hf])")
    pytest.importorskip("onnxscript", reason="needs the optional dependency onnxscript (torch.onnx's exporter)")
    made = {}

    def get(gates):
        if gates not in made:
            example = torch.randn(TOKENS, HIDDEN)
            made[gates] = torch.onnx.export(_scatter_block(gates), (example,), dynamo=True, verbose=False).model_proto
        return made[gates]
    return get


@pytest.mark.parametrize("gates, chips", [("softmax", 8), ("renormalised", 4)])
@pytest.mark.slow
def test_a_scattered_gate_block_runs_on_the_chips_asked_and_matches_onnx_runtime(scattered, gates, chips):
    model = scattered(gates)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("ScatterElements") == 1 and ops.count("Gather") == EXPERTS  # the form the issue met
    dense = dense_experts(model)
    assert not {"TopK", "ScatterElements", "Gather"} & {n.op_type for n in dense.graph.node}
    x = np.random.default_rng(5).standard_normal((TOKENS, HIDDEN)).astype(np.float32)
    # compiled as exported: compile rewrites it (it ran on 1 chip of the 8 asked for, its top-k on the host)
    compiled = lpx_tvm.compile(model, system="tsp-node", parallel="expert", chips=chips)
    (out,) = run_on_lpx(compiled, [x], programs=1)  # the router's top-k and gates on lpx with the experts
    (sim,) = compiled.simulators.values()
    assert len(sim.sims) == chips and f"{EXPERTS} experts over {chips} chips" in sim.program.notes
    np.testing.assert_allclose(out, ort_reference(model, {model.graph.input[0].name: x})[0], rtol=1e-5, atol=1e-5)


# ---- the command line: the rewrite where expert parallel is asked, and a line per program naming its chips --------


@pytest.mark.slow
def test_the_cli_runs_the_issues_block_on_the_chips_asked_and_says_so(scattered, tmp_path, capsys):
    from onnx import save

    from lpx_tvm.app.cli import main

    path = tmp_path / "moe.onnx"
    save(scattered("softmax"), path)
    assert main(["run", str(path), "--system", "tsp-node", "--parallel", "expert", "--chips", "8"]) == 0
    out = capsys.readouterr().out
    assert "1 lpx subgraph(s)" in out and "host ops: none" in out
    (line,) = [x for x in out.splitlines() if x.startswith("lpx")]
    assert ": 8 chips [" in line and "8 experts over 8 chips" in line
    err = float(out.split("max_abs_err ")[1].split(",")[0])
    assert err < 1e-5


def test_the_cli_says_what_auto_chose_and_on_how_many_chips(exported, tmp_path, capsys):
    from onnx import save

    from lpx_tvm.app.cli import main

    path = tmp_path / "mixtral.onnx"
    save(exported("mixtral")[0], path)
    assert main(["run", str(path), "--system", "tsp-node", "--parallel", "auto", "--chips", "4"]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("lpx")]
    assert ": 4 chips [" in line and "auto chose expert" in line


def test_the_cli_names_why_expert_parallel_cannot_apply(tmp_path, capsys):
    from onnx import save

    from lpx_tvm.app.cli import main

    path = tmp_path / "mlp.onnx"
    save(mlp_stack(np.random.default_rng(0), [64, 64, 64], batch=2), path)
    assert main(["run", str(path), "--system", "tsp-node", "--parallel", "expert", "--chips", "4"]) == 1
    err = capsys.readouterr().err
    assert "SystemCompileError: expert parallel" in err and "no mixture of experts" in err
    assert re.search(r"1 (chip )?of the 4 (chips )?asked for", err), err


def test_the_cli_adds_why_the_rewrite_could_not_apply(tmp_path, capsys):
    # a TopK with no experts behind it: the rewrite is tried, refused, and its reason joins the compiler's
    from onnx import TensorProto, helper, numpy_helper, save

    from lpx_tvm.app.cli import main

    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("TopK", ["h", "k"], ["v", "i"], axis=-1)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
                              [helper.make_tensor_value_info("v", TensorProto.FLOAT, [2, 2])],
                              [numpy_helper.from_array(rng.standard_normal((64, 8)).astype(np.float32), "w"),
                               numpy_helper.from_array(np.array([2], np.int64), "k")])
    path = tmp_path / "topk.onnx"
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    assert main(["run", str(path), "--system", "tsp-node", "--parallel", "expert", "--chips", "2"]) == 1
    err = capsys.readouterr().err
    assert "no mixture of experts" in err and "the rewrite was tried and dense_experts: no product scales the " \
        "experts' outputs by the top-k weights" in err


@pytest.mark.slow
def test_the_cli_profile_names_the_chips_too(scattered, tmp_path, capsys):
    from onnx import save

    from lpx_tvm.app.cli import main

    path = tmp_path / "moe.onnx"
    save(scattered("renormalised"), path)
    assert main(["profile", str(path), "--system", "tsp-node", "--parallel", "expert", "--chips", "2"]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("lpx")]
    assert ": 2 chips [" in line and "8 experts over 2 chips" in line and "4 a chip" in line
