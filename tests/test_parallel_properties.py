"""Seeded random graphs on systems of chips: every case compiles, simulates and matches ONNX Runtime on exactly
the chips asked for, or fails at compile time with a named reason (a SystemCompileError). None fails at run time,
and none runs on fewer chips than asked.

MLPs and transformer blocks of widths that are no multiple of 320 and heads that need not divide the chips, and
mixtures of experts, on 2, 3, 4, 6 and 8 chips of a tsp-node and on 4, 8 and 16 chips of an lpx-node, under each
strategy and auto. Each test counts how many cases ran and how many were refused, per strategy: a strategy that
stopped applying (tensor parallelism disabled, say) changes the counts.
"""

import numpy as np
import pytest
from onnx import helper, numpy_helper

from conftest import make_model, mlp_stack, ort_reference, tensor_info, weights
import lpx_tvm
from lpx_tvm.app.models.moe import MoeConfig, build_moe_block
from lpx_tvm.codegen import SystemCompileError
from lpx_tvm.runtime import total_offloaded_calls

SYSTEMS = {"tsp-node": (2, 3, 4, 6, 8), "lpx-node": (4, 8, 16)}
STRATEGIES = ("pipeline", "tensor", "expert", "auto")


def transformer_block(rng, seq: int, hidden: int, heads: int, ffn: int):
    """One post-norm encoder block: attention by ``heads`` heads, a residual, LayerNorm, a ReLU MLP."""
    d = hidden // heads
    inits = [weights(rng, n, (hidden, hidden), 1 / np.sqrt(hidden)) for n in ("wq", "wk", "wv", "wo")]
    inits += [weights(rng, "w1", (hidden, ffn), 1 / np.sqrt(hidden)), weights(rng, "w2", (ffn, hidden), 1 / np.sqrt(ffn)),
              numpy_helper.from_array(np.array([seq, heads, d], np.int64), "split"),
              numpy_helper.from_array(np.array([seq, hidden], np.int64), "merge"),
              numpy_helper.from_array(np.array(1 / np.sqrt(d), np.float32), "scale"),
              numpy_helper.from_array(np.ones(hidden, np.float32), "gamma"),
              numpy_helper.from_array(np.zeros(hidden, np.float32), "beta")]
    n = helper.make_node
    nodes = []
    for name in ("q", "k", "v"):
        nodes += [n("MatMul", ["x", f"w{name}"], [f"{name}2"]), n("Reshape", [f"{name}2", "split"], [f"{name}3"]),
                  n("Transpose", [f"{name}3"], [f"{name}h"], perm=[1, 0, 2])]
    nodes += [n("Transpose", ["kh"], ["kt"], perm=[0, 2, 1]), n("MatMul", ["qh", "kt"], ["s0"]),
              n("Mul", ["s0", "scale"], ["s"]), n("Softmax", ["s"], ["p"], axis=-1), n("MatMul", ["p", "vh"], ["c"]),
              n("Transpose", ["c"], ["ct"], perm=[1, 0, 2]), n("Reshape", ["ct", "merge"], ["cm"]),
              n("MatMul", ["cm", "wo"], ["o"]), n("Add", ["x", "o"], ["r"]),
              n("LayerNormalization", ["r", "gamma", "beta"], ["ln"], axis=-1),
              n("MatMul", ["ln", "w1"], ["f1"]), n("Relu", ["f1"], ["f1r"]), n("MatMul", ["f1r", "w2"], ["f2"]),
              n("Add", ["ln", "f2"], ["y"])]
    return make_model(nodes, [tensor_info("x", [seq, hidden])], [tensor_info("y", [seq, hidden])], inits)


def _check_case(model, x, parallel, chips, system):
    """Compile; a named refusal ends the case; else the run must match ORT, on the chips asked for."""
    try:
        compiled = lpx_tvm.compile(model, system=system, parallel=parallel, chips=chips)
    except SystemCompileError as err:
        assert str(err), "a refusal names its reason"
        return "refused"
    before = total_offloaded_calls()
    (out,) = compiled(x)  # nothing may fail from here on
    assert total_offloaded_calls() - before == compiled.report.lpx_functions >= 1
    # on the chips asked for (a mixture's router, a program without experts, runs whole on one of them)
    assert max(len(s.program.chips) for s in compiled.simulators.values()) == chips
    np.testing.assert_allclose(out, ort_reference(model, {"x": x})[0], rtol=1e-4, atol=1e-4)
    return "ran"


def _mlp_case(seed):
    rng = np.random.default_rng(seed)
    widths = [int(w) for w in rng.integers(5, 400, size=int(rng.integers(2, 6)))]
    batch = int(rng.integers(1, 9))
    return mlp_stack(rng, widths, batch), rng.standard_normal((batch, widths[0])).astype(np.float32), rng


def _transformer_case(seed):
    rng = np.random.default_rng(1000 + seed)
    heads = int(rng.choice([1, 2, 3, 4, 5, 6]))
    hidden = heads * int(rng.integers(4, 40))
    seq = int(rng.integers(1, 24))
    model = transformer_block(rng, seq, hidden, heads, int(rng.integers(8, 300)))
    return model, rng.standard_normal((seq, hidden)).astype(np.float32), rng


def _count(system: str, cases) -> dict:
    """``{strategy: (ran, refused)}`` over ``cases`` (model, input, rng), each under every strategy on a chip
    count the case's rng draws from the system's."""
    counts = {parallel: [0, 0] for parallel in STRATEGIES}
    for model, x, rng in cases:
        for parallel in STRATEGIES:
            outcome = _check_case(model, x, parallel, int(rng.choice(SYSTEMS[system])), system)
            counts[parallel][outcome == "refused"] += 1
    return {k: tuple(v) for k, v in counts.items()}


# (ran, refused) per strategy, as measured when the collectives began to fit the topology: a pipeline is
# refused where a graph has fewer operators than the chips asked for, a tensor split where no product splits
# over them, expert parallelism where there are no experts
@pytest.mark.slow
@pytest.mark.parametrize("system, seeds, counts", [
    ("tsp-node", 40, {"pipeline": (19, 21), "tensor": (40, 0), "expert": (0, 40), "auto": (40, 0)}),
    pytest.param("lpx-node", 12, {"pipeline": (4, 8), "tensor": (12, 0), "expert": (0, 12), "auto": (12, 0)},
                 marks=pytest.mark.slow),
])
def test_random_mlps_under_every_strategy(system, seeds, counts):
    assert _count(system, [_mlp_case(seed) for seed in range(seeds)]) == counts


@pytest.mark.slow
@pytest.mark.parametrize("system, seeds, counts", [
    ("tsp-node", 16, {"pipeline": (16, 0), "tensor": (16, 0), "expert": (0, 16), "auto": (16, 0)}),
    pytest.param("lpx-node", 6, {"pipeline": (6, 0), "tensor": (6, 0), "expert": (0, 6), "auto": (6, 0)},
                 marks=pytest.mark.slow),
])
def test_random_transformer_blocks_under_every_strategy(system, seeds, counts):
    assert _count(system, [_transformer_case(seed) for seed in range(seeds)]) == counts


@pytest.mark.slow
@pytest.mark.parametrize("system, seeds, ran", [("tsp-node", 12, 32),
                                                pytest.param("lpx-node", 6, 4, marks=pytest.mark.slow)])
def test_random_mixtures_of_experts_on_every_chip_count(system, seeds, ran):
    """Expert parallelism on every chip count of the system: ``ran`` of them run, the others are refused."""
    outcomes = []
    for seed in range(seeds):
        rng = np.random.default_rng(2000 + seed)
        config = MoeConfig(hidden=int(rng.choice([24, 48, 64, 72])), ffn=int(rng.integers(8, 100)),
                           experts=int(rng.integers(2, 9)), top_k=2, tokens=int(rng.integers(1, 4)))
        model = build_moe_block(config, seed=seed)
        x = rng.standard_normal((config.tokens, config.hidden)).astype(np.float32)
        outcomes += [_check_case(model, x, "expert", chips, system) for chips in SYSTEMS[system]]
    assert outcomes.count("ran") == ran and outcomes.count("refused") == len(outcomes) - ran
