"""Epilogue folding (``codegen/fuse.py``): a single-reader per-channel MUL/DIV/ADD by a constant, and then an
activation, fold into the conv2d or matmul before them; the exact node list that results, and the folded
weights against numpy."""

import numpy as np

from lpx_tvm.codegen.fuse import fuse_epilogues
from lpx_tvm.codegen.graph import Graph
from lpx_tvm.runtime_sim import Opcode

NO_ACT = dict(act=Opcode.NOP, act_args=(0.0, 0.0))


def _matmul_graph(rng, m=4, k=8, n=3, weight=True):
    """x[m, k] @ w[k, n] (w a constant, or a second input), layer f/matmul_1."""
    g = Graph()
    x = g.add_tensor((m, k), "float32")
    g.inputs = [x]
    w = g.constant(rng.standard_normal((k, n)).astype(np.float32)) if weight else g.add_tensor((k, n), "float32")
    if not weight:
        g.inputs.append(w)
    mm = g.add_node("matmul", [x, w], (m, n), "float32", "f/matmul_1", **NO_ACT)
    return g, x, w, mm


def _data(g, tid):
    return g.tensors[g.base(tid)].data


def test_bias_add_then_relu_fold_into_the_matmul_as_its_epilogue(rng):
    g, x, w, mm = _matmul_graph(rng)
    bias = np.array([0.5, -1.0, 2.0], np.float32)
    added = g.add_node("ADD", [mm, g.constant(bias)], (4, 3), "float32", "f/add_2")
    out = g.add_node("RELU", [added], (4, 3), "float32", "f/relu_3")
    g.outputs = [out]
    fuse_epilogues(g)
    (node,) = g.nodes  # three nodes became one
    assert (node.kind, node.inputs[:2], node.output) == ("matmul", [x, w], out)
    assert (node.attrs["act"], node.attrs["act_args"]) == (Opcode.RELU, (0.0, 0.0))
    assert node.layer == "f/matmul_1+add_2+relu_3"
    assert len(node.inputs) == 3
    np.testing.assert_array_equal(_data(g, node.inputs[2]), bias)  # 0 (no bias yet) + bias


def test_batch_norm_scale_and_shift_fold_into_the_convolutions_weight_and_bias(rng):
    """conv(x, w) + b, then lowering's batch norm (· s, + t), all per output channel [1, 3, 1, 1]:
    one conv with weight w · s (per output channel) and bias b · s + t, shaped [3, 1]."""
    g = Graph()
    x = g.add_tensor((1, 2, 5, 5), "float32")
    g.inputs = [x]
    w = rng.standard_normal((3, 2, 3, 3)).astype(np.float32)
    b, s, t = (rng.standard_normal(3).astype(np.float32) for _ in range(3))
    conv = g.add_node("conv2d", [x, g.constant(w)], (1, 3, 3, 3), "float32", "f/conv2d_1", strides=[1, 1],
                      padding=[0, 0, 0, 0], dilation=[1, 1], groups=1, **NO_ACT)
    biased = g.add_node("ADD", [conv, g.constant(b.reshape(1, 3, 1, 1))], (1, 3, 3, 3), "float32", "f/add_2")
    scaled = g.add_node("MUL", [biased, g.constant(s.reshape(1, 3, 1, 1))], (1, 3, 3, 3), "float32", "f/bn_3")
    out = g.add_node("ADD", [scaled, g.constant(t.reshape(1, 3, 1, 1))], (1, 3, 3, 3), "float32", "f/bn_3")
    g.outputs = [out]
    fuse_epilogues(g)
    (node,) = g.nodes
    assert (node.kind, node.output, node.attrs["act"]) == ("conv2d", out, Opcode.NOP)
    np.testing.assert_allclose(_data(g, node.inputs[1]), w * s[:, None, None, None], rtol=1e-6)
    assert g.tensors[node.inputs[2]].shape == (3, 1)
    np.testing.assert_allclose(_data(g, node.inputs[2]).reshape(-1), b * s + t, rtol=1e-6)


def test_a_division_by_a_constant_folds_as_its_reciprocal_into_the_weight(rng):
    g, x, w, mm = _matmul_graph(rng)
    weight = _data(g, w).copy()
    out = g.add_node("DIV", [mm, g.constant(np.float32(4.0))], (4, 3), "float32", "f/divide_2")
    g.outputs = [out]
    fuse_epilogues(g)
    (node,) = g.nodes
    np.testing.assert_allclose(_data(g, node.inputs[1]), weight / 4, rtol=1e-6)
    np.testing.assert_array_equal(_data(g, node.inputs[2]), np.zeros(3))  # no bias: 0 · ¼


def test_a_product_of_two_activations_takes_a_scalar_scale_as_an_epilogue_operand(rng):
    """Attention's scores q @ kᵀ · 1/√d: no weight to fold into, so the scale rides as the EPILOGUE's
    fourth operand, one value per output column (n = 3), with a zero bias before it."""
    g, x, y, mm = _matmul_graph(rng, weight=False)
    out = g.add_node("MUL", [mm, g.constant(np.float32(0.125))], (4, 3), "float32", "f/multiply_2")
    g.outputs = [out]
    fuse_epilogues(g)
    (node,) = g.nodes
    assert node.inputs[:2] == [x, y]
    assert len(node.inputs) == 4
    np.testing.assert_array_equal(_data(g, node.inputs[2]), np.zeros(3, np.float32))
    np.testing.assert_array_equal(_data(g, node.inputs[3]), np.full(3, 0.125, np.float32))


def test_leaky_relu_and_clip_carry_their_attributes_as_the_epilogues_act_args(rng):
    for kind, attrs, args in [("LEAKY_RELU", {"alpha": 0.25}, (0.25, 0.0)), ("CLIP", {"lo": -1.0, "hi": 6.0},
                                                                              (-1.0, 6.0))]:
        g, x, w, mm = _matmul_graph(rng)
        g.outputs = [g.add_node(kind, [mm], (4, 3), "float32", "f/act_2", **attrs)]
        fuse_epilogues(g)
        (node,) = g.nodes
        assert (node.attrs["act"], node.attrs["act_args"]) == (Opcode[kind], args)


def test_nothing_folds_after_an_activation_because_the_activation_must_come_last(rng):
    """matmul ─► RELU ─► ADD(c): relu(x) + c is not relu(x + c), so only the RELU folds."""
    g, x, w, mm = _matmul_graph(rng)
    r = g.add_node("RELU", [mm], (4, 3), "float32", "f/relu_2")
    out = g.add_node("ADD", [r, g.constant(np.ones(3, np.float32))], (4, 3), "float32", "f/add_3")
    g.outputs = [out]
    fuse_epilogues(g)
    assert [(n.kind, n.output) for n in g.nodes] == [("matmul", r), ("ADD", out)]
    assert g.nodes[0].attrs["act"] == Opcode.RELU


def test_an_intermediate_with_another_reader_or_a_non_constant_or_per_row_operand_does_not_fold(rng):
    cases = []
    # the matmul's result is read twice (by the ADD and by the graph's output)
    g, x, w, mm = _matmul_graph(rng)
    g.outputs = [g.add_node("ADD", [mm, g.constant(np.ones(3, np.float32))], (4, 3), "float32", "f/add_2"), mm]
    cases.append(g)
    # a residual add: the other operand is an activation
    g, x, w, mm = _matmul_graph(rng)
    res = g.add_tensor((4, 3), "float32")
    g.inputs.append(res)
    g.outputs = [g.add_node("ADD", [mm, res], (4, 3), "float32", "f/add_2")]
    cases.append(g)
    # one value per row [4, 1], not per output column: no per-column bias can carry it
    g, x, w, mm = _matmul_graph(rng)
    g.outputs = [g.add_node("MUL", [mm, g.constant(np.ones((4, 1), np.float32))], (4, 3), "float32", "f/mul_2")]
    cases.append(g)
    # c / matmul is not matmul · (1/c)
    g, x, w, mm = _matmul_graph(rng)
    g.outputs = [g.add_node("DIV", [g.constant(np.float32(2)), mm], (4, 3), "float32", "f/divide_2")]
    cases.append(g)
    for g in cases:
        before = [(n.kind, list(n.inputs), n.output) for n in g.nodes]
        fuse_epilogues(g)
        assert [(n.kind, n.inputs, n.output) for n in g.nodes] == before
        assert len(g.nodes) == 2


def test_a_bias_after_a_scaled_product_of_two_activations_stays_an_op_of_its_own(rng):
    """0.125·(x@y) + b: the epilogue computes (acc + bias) · scale, and the bias used to replace the scale
    operand, so the program computed x@y + b, silently (found writing these tests). b / 0.125 as the bias would
    overflow for a mask of float32's lowest, so the add is not folded."""
    g, x, y, mm = _matmul_graph(rng, weight=False)
    s = g.add_node("MUL", [mm, g.constant(np.float32(0.125))], (4, 3), "float32", "f/multiply_2")
    b = np.array([1.0, 2.0, 3.0], np.float32)
    g.outputs = [g.add_node("ADD", [s, g.constant(b)], (4, 3), "float32", "f/add_3")]
    fuse_epilogues(g)
    assert [n.kind for n in g.nodes] == ["matmul", "ADD"]
    scale = g.tensors[g.base(g.nodes[0].inputs[3])].data
    np.testing.assert_array_equal(scale.reshape(-1), [0.125] * 3)  # the scale, per output column
