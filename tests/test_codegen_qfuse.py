"""int8 fusion of QDQ graphs (``codegen/qfuse.py``): DQ ─► conv/matmul ─► Q becomes one int8 operator with its
bias in accumulator units and its requantisation scale ``sx·sw / sy``; a DQ·c folds into the DEQUANTIZE's
scale; Q(DQ(x)) with the same parameters is x. Graphs are built as ``lower`` builds them (attributes as
floats, weights dequantised with their integers in ``Graph.quantized``); every scale is a power of two, so
the expected numbers are exact."""

import numpy as np

from lpx_tvm.codegen.graph import Graph
from lpx_tvm.codegen.qfuse import convert_on_host, fuse_int8
from lpx_tvm.runtime_sim import Opcode

NO_ACT = dict(act=Opcode.NOP, act_args=(0.0, 0.0))


def _dq(g, x, scale, zp, layer="f/dequantize_1"):
    return g.add_node("DEQUANTIZE", [x], g.tensors[x].shape, "float32", layer, scale=scale, zero_point=zp)


def _q(g, x, scale, zp, layer="f/quantize_9", dtype="int8"):
    return g.add_node("QUANTIZE", [x], g.tensors[x].shape, dtype, layer, scale=scale, zero_point=zp)


def _quantized_weight(g, q, scale, zp):
    """A weight as lowering leaves it: its float value, with (integers, scale, zero point) of its rank."""
    scale, zp = (np.asarray(v, np.float32).reshape(1, -1) for v in (scale, zp))
    tid = g.constant(((q.astype(np.float32) - zp) * scale).astype(np.float32))
    g.quantized[tid] = (q, scale, zp)
    return tid


def _qdq_matmul(w_scale, w_zp, act=Opcode.NOP):
    """x int8 [4, 8] ─► DQ(0.5, 3) ─► @ w [8, 3] + bias ─► Q(0.125, -1)."""
    g = Graph()
    x = g.add_tensor((4, 8), "int8")
    g.inputs = [x]
    q = np.arange(-12, 12, dtype=np.int8).reshape(8, 3)
    w = _quantized_weight(g, q, w_scale, w_zp)
    bias = g.constant(np.array([0.25, -0.5, 0.3], np.float32))
    mm = g.add_node("matmul", [_dq(g, x, 0.5, 3.0), w, bias], (4, 3), "float32", "f/matmul_2", act=act,
                    act_args=(0.0, 0.0))
    g.outputs = [_q(g, mm, 0.125, -1.0)]
    return g, x, q


def _data(g, tid):
    return g.tensors[g.base(tid)].data


def test_a_complete_qdq_matmul_becomes_one_int8_matmul_with_bias_and_requantisation_per_channel():
    """Weight scales per output column 0.25, 0.5, 1: accumulator scales sx·sw = 0.125, 0.25, 0.5.
    Bias in accumulator units: rint(0.25 / 0.125, -0.5 / 0.25, 0.3 / 0.5) = (2, -2, rint(0.6) = 1).
    Requantisation sx·sw / sy with sy = 0.125: (1, 2, 4)."""
    g, x, q = _qdq_matmul([0.25, 0.5, 1.0], [0, 0, 0])
    out = g.outputs[0]
    assert fuse_int8(g) == 1
    (node,) = g.nodes  # DQ, matmul, Q: one node
    assert (node.kind, node.inputs[0], node.output, node.layer) == ("qmatmul", x, out, "f/matmul_2+quantize")
    assert (node.attrs["zp_in"], node.attrs["zp_out"], node.attrs["zp_w"]) == (3, -1, 0)
    np.testing.assert_array_equal(_data(g, node.inputs[1]), q)
    bias_q, requant = _data(g, node.inputs[2]), _data(g, node.inputs[3])
    assert (bias_q.dtype, requant.dtype) == (np.dtype(np.int32), np.dtype(np.float32))
    np.testing.assert_array_equal(bias_q, [2, -2, 1])
    np.testing.assert_array_equal(requant, [1.0, 2.0, 4.0])


def test_a_per_tensor_weight_may_have_a_zero_point_and_keeps_it():
    g, x, q = _qdq_matmul([0.25], [5])
    assert fuse_int8(g) == 1
    (node,) = g.nodes
    assert (node.kind, node.attrs["zp_w"]) == ("qmatmul", 5)
    # one weight scale 0.25: accumulator scale 0.125 for every column, requant 0.125 / 0.125 = 1
    np.testing.assert_array_equal(_data(g, node.inputs[2]), [2, -4, 2])  # rint(2, -4, 2.4)
    np.testing.assert_array_equal(_data(g, node.inputs[3]), [1.0, 1.0, 1.0])


def test_per_channel_zero_points_or_an_activation_other_than_relu_keep_the_float_operator():
    for w_zp, act in [([1, 0, 0], Opcode.NOP), ([0, 0, 0], Opcode.GELU)]:
        g, x, q = _qdq_matmul([0.25, 0.5, 1.0], w_zp, act)
        assert fuse_int8(g) == 0
        assert [n.kind for n in g.nodes] == ["DEQUANTIZE", "matmul", "QUANTIZE"]


def test_a_dequantise_times_a_constant_number_is_one_dequantise_with_the_scale_times_it():
    """DQ(x; 0.5, zp 3) · 0.25 ─► DQ(x; 0.125, zp 3); c · DQ(x) likewise; DQ(x) / 4 ─► DQ(x; 0.125). The
    first DQ, now unread, is dropped."""
    for kind, operands in [("MUL", lambda dq, c: [dq, c]), ("MUL", lambda dq, c: [c, dq]),
                           ("DIV", lambda dq, c: [dq, c])]:
        g = Graph()
        x = g.add_tensor((2, 8), "int8")
        g.inputs = [x]
        c = g.constant(np.float32(0.25 if kind == "MUL" else 4.0))
        scaled = g.add_node(kind, operands(_dq(g, x, 0.5, 3.0), c), (2, 8), "float32", "f/mul_2")
        g.outputs = [g.add_node("RELU", [scaled], (2, 8), "float32", "f/relu_3")]
        assert fuse_int8(g) == 1
        assert [(n.kind, n.inputs, n.output) for n in g.nodes] == [("DEQUANTIZE", [x], scaled),
                                                                   ("RELU", [scaled], g.outputs[0])]
        assert g.nodes[0].attrs == {"scale": 0.125, "zero_point": 3.0}
        assert g.nodes[0].layer == "f/dequantize_1+mul_2"


def test_the_dequantise_stays_for_its_other_readers_and_non_scalar_or_zero_constants_do_not_fold():
    g = Graph()
    x = g.add_tensor((2, 8), "int8")
    dq = _dq(g, x, 0.5, 3.0)
    scaled = g.add_node("MUL", [dq, g.constant(np.float32(0.25))], (2, 8), "float32", "f/mul_2")
    g.inputs, g.outputs = [x], [g.add_node("ADD", [scaled, dq], (2, 8), "float32", "f/add_3")]
    assert fuse_int8(g) == 1
    assert [(n.kind, n.attrs.get("scale")) for n in g.nodes] == [("DEQUANTIZE", 0.5), ("DEQUANTIZE", 0.125),
                                                                 ("ADD", None)]
    for constant in (np.full(8, 0.25, np.float32), np.float32(0.0)):  # one value per column; a zero scale
        g = Graph()
        x = g.add_tensor((2, 8), "int8")
        scaled = g.add_node("MUL", [_dq(g, x, 0.5, 3.0), g.constant(constant)], (2, 8), "float32", "f/mul_2")
        g.inputs, g.outputs = [x], [g.add_node("RELU", [scaled], (2, 8), "float32", "f/relu_3")]
        assert fuse_int8(g) == 0
        assert [n.kind for n in g.nodes] == ["DEQUANTIZE", "MUL", "RELU"]


def test_a_quantise_of_a_dequantise_through_a_reshape_with_the_same_parameters_is_the_integers():
    """x int8 [2, 8] ─► DQ(0.5, 3) ─► reshape [16] ─► Q(0.5, 3): the Q's output becomes an alias of x, and the
    DQ is dead. With another scale (0.25) both stay."""
    for q_scale, kinds in [(0.5, ["DEQUANTIZE"]), (0.25, ["DEQUANTIZE", "QUANTIZE", "DEQUANTIZE"])]:
        g = Graph()
        x = g.add_tensor((2, 8), "int8")
        flat = g.add_tensor((16,), "float32", alias_of=_dq(g, x, 0.5, 3.0))
        ints = _q(g, flat, q_scale, 3.0)
        g.inputs, g.outputs = [x], [_dq(g, ints, 0.1, 0.0, "f/dequantize_3")]
        assert fuse_int8(g) == (1 if q_scale == 0.5 else 0)
        assert [n.kind for n in g.nodes] == kinds
        assert g.base(ints) == (x if q_scale == 0.5 else ints)


def test_a_residual_add_of_two_dequantised_operands_and_a_relu_becomes_qadd():
    """DQ(a; 0.5, 1) + DQ(b; 0.25, -2) ─► RELU ─► Q(0.125, 4): ONNX Runtime's QLinearAdd with the RELU inside."""
    g = Graph()
    a, b = g.add_tensor((2, 8), "int8"), g.add_tensor((2, 8), "int8")
    added = g.add_node("ADD", [_dq(g, a, 0.5, 1.0), _dq(g, b, 0.25, -2.0, "f/dequantize_2")], (2, 8), "float32",
                       "f/add_3")
    out = _q(g, g.add_node("RELU", [added], (2, 8), "float32", "f/relu_4"), 0.125, 4.0)
    g.inputs, g.outputs = [a, b], [out]
    assert fuse_int8(g) == 1
    (node,) = g.nodes
    assert (node.kind, node.inputs, node.output) == ("QADD", [a, b], out)
    assert node.attrs == {"scale_a": 0.5, "zp_a": 1.0, "scale_b": 0.25, "zp_b": -2.0, "scale_out": 0.125,
                          "zp_out": 4.0, "act": Opcode.RELU}


def test_a_product_of_two_dequantised_activations_requantises_by_sa_sb_over_sy():
    """DQ(a; 0.5, 1) @ DQ(b; 0.25, 0) ─► Q(0.0625, 2): requant 0.5 · 0.25 / 0.0625 = 2 per column (n = 3), a
    zero int32 bias."""
    g = Graph()
    a, b = g.add_tensor((4, 8), "int8"), g.add_tensor((8, 3), "int8")
    mm = g.add_node("matmul", [_dq(g, a, 0.5, 1.0), _dq(g, b, 0.25, 0.0, "f/dequantize_2")], (4, 3), "float32",
                    "f/matmul_3", **NO_ACT)
    g.inputs, g.outputs = [a, b], [_q(g, mm, 0.0625, 2.0)]
    assert fuse_int8(g) == 1
    (node,) = g.nodes
    assert (node.kind, node.inputs[:2]) == ("qmatmul", [a, b])
    assert (node.attrs["zp_in"], node.attrs["zp_w"], node.attrs["zp_out"]) == (1, 0, 2)
    np.testing.assert_array_equal(_data(g, node.inputs[2]), np.zeros(3, np.int32))
    np.testing.assert_array_equal(_data(g, node.inputs[3]), np.full(3, 2.0, np.float32))


def test_a_max_pool_between_equal_quantisation_parameters_runs_on_the_integers():
    window = dict(kernel=(2, 2), stride=(2, 2), pad=(0, 0, 0, 0), dilation=(1, 1))
    for q_scale, kinds in [(0.5, ["MAXPOOL"]), (0.25, ["DEQUANTIZE", "MAXPOOL", "QUANTIZE"])]:
        g = Graph()
        x = g.add_tensor((1, 2, 4, 4), "int8")
        pooled = g.add_node("MAXPOOL", [_dq(g, x, 0.5, 3.0)], (1, 2, 2, 2), "float32", "f/max_pool2d_2", **window)
        g.inputs, g.outputs = [x], [_q(g, pooled, q_scale, 3.0)]
        fuse_int8(g)
        assert [n.kind for n in g.nodes] == kinds
        if q_scale == 0.5:
            assert (g.nodes[0].inputs, g.nodes[0].output) == ([x], g.outputs[0])


def test_the_host_quantises_an_input_and_dequantises_an_output_so_the_link_carries_integers():
    """x fp32 ─► Q(0.5, 3) ─► an op on the integers ─► DQ(0.25, -1) ─► output: the chip's input becomes the Q's
    output and its output the DQ's input; the host is told the scale and zero point of each."""
    g = Graph()
    x = g.add_tensor((2, 8), "float32")
    q = _q(g, x, 0.5, 3.0)
    r = g.add_node("MAXPOOL", [q], (2, 8), "int8", "f/pool_2", kernel=(1, 1))
    out = _dq(g, r, 0.25, -1.0, "f/dequantize_3")
    g.inputs, g.outputs = [x], [out]
    assert convert_on_host(g) == 2
    assert (g.inputs, g.outputs) == ([q], [r])
    assert (g.host_converted, g.widened) == ({q: (0.5, 3)}, {r: (0.25, -1)})
    assert [n.kind for n in g.nodes] == ["MAXPOOL"]
