"""Lowering (``codegen/lower.py``): a Relax function ─► the LPX operator graph. Each table op becomes a node
named ``<function>/<op>_<k>`` (k counts the ops lowered so far); reshapes are aliases; constant
sub-expressions fold in numpy; batch norm becomes a per-channel MUL and ADD; composite functions are
inlined except the idioms lpx runs as one operator."""

import numpy as np
import pytest
from onnx import helper
from tvm import relax

import lpx_tvm
from conftest import make_model, tensor_info, weights
from lpx_tvm.codegen.graph import Graph
from lpx_tvm.codegen.lower import lower
from lpx_tvm.codegen.relax_ops import LoweringError
from lpx_tvm.runtime_sim import Opcode


def _lower(shapes, build, name="f") -> Graph:
    """Lower ``build(*params)`` as the body of a Relax function of float32 parameters of ``shapes``."""
    bb = relax.BlockBuilder()
    params = [relax.Var(f"p{i}", relax.TensorType(s, "float32")) for i, s in enumerate(shapes)]
    with bb.function("f", params):
        with bb.dataflow():
            out = bb.emit_output(build(bb, *params))
        bb.emit_func_output(out)
    return lower(bb.get()["f"], name)


def _kinds(g):
    return [(n.kind, n.layer) for n in g.nodes]


def _data(g, tid):
    return g.tensors[g.base(tid)].data.reshape(g.tensors[tid].shape)


def test_table_ops_become_nodes_in_order_named_after_the_function_and_their_position():
    bias = np.arange(8, dtype=np.float32)
    g = _lower([(4, 8)], lambda bb, x: relax.op.add(bb.emit(relax.op.nn.relu(x)), relax.const(bias)), "blk")
    assert _kinds(g) == [("RELU", "blk/relu_1"), ("ADD", "blk/add_2")]
    (x,) = g.inputs
    relu, add = g.nodes
    assert (relu.inputs, add.inputs[0], g.outputs) == ([x], relu.output, [add.output])
    np.testing.assert_array_equal(_data(g, add.inputs[1]), bias)
    assert (g.tensors[x].shape, g.tensors[add.output].shape) == ((4, 8), (4, 8))
    assert g.tensors[add.output].dtype == np.dtype(np.float32)


def test_a_reshape_is_an_alias_and_a_permute_of_an_activation_is_a_transpose():
    def build(bb, x):
        flat = bb.emit(relax.op.reshape(x, (6, 4)))
        return relax.op.permute_dims(flat, [1, 0])
    g = _lower([(2, 3, 4)], build)
    # the reshape took position 1 but made no node
    assert _kinds(g) == [("TRANSPOSE", "f/permute_dims_2")]
    (node,) = g.nodes
    (flat,) = node.inputs
    assert (g.tensors[flat].shape, g.tensors[flat].alias_of, g.base(flat)) == ((6, 4), g.inputs[0], g.inputs[0])
    assert node.attrs == {"perm": (1, 0)}
    assert g.tensors[node.output].shape == (4, 6)


def test_gemms_transposed_weight_is_transposed_in_numpy_and_the_matmul_has_no_activation_yet(rng):
    w = rng.standard_normal((3, 8)).astype(np.float32)  # ONNX Gemm's transB weight [N, K]
    g = _lower([(4, 8)], lambda bb, x: relax.op.matmul(x, bb.emit(relax.op.permute_dims(relax.const(w), [1, 0]))))
    assert _kinds(g) == [("matmul", "f/matmul_2")]
    (node,) = g.nodes
    np.testing.assert_array_equal(_data(g, node.inputs[1]), w.T)
    assert g.tensors[node.inputs[1]].data.flags.c_contiguous
    assert (node.attrs["act"], node.attrs["act_args"]) == (Opcode.NOP, (0.0, 0.0))
    assert g.tensors[node.output].shape == (4, 3)


def test_an_elementwise_op_of_constants_folds_in_numpy(rng):
    a, b = rng.standard_normal(8).astype(np.float32), rng.standard_normal(8).astype(np.float32)
    g = _lower([(4, 8)], lambda bb, x: relax.op.add(x, bb.emit(relax.op.multiply(relax.const(a), relax.const(b)))))
    assert _kinds(g) == [("ADD", "f/add_2")]
    np.testing.assert_array_equal(_data(g, g.nodes[0].inputs[1]), a * b)


def test_batch_norm_becomes_a_per_channel_multiply_and_add_of_its_folded_statistics(rng):
    gamma, beta, mean = (rng.standard_normal(3).astype(np.float32) for _ in range(3))
    var = rng.uniform(0.5, 1.5, 3).astype(np.float32)

    def build(bb, x):
        bn = bb.emit(relax.op.nn.batch_norm(x, *map(relax.const, (gamma, beta, mean, var)), axis=1, epsilon=1e-3,
                                            training=False))
        return relax.TupleGetItem(bn, 0)
    g = _lower([(1, 3, 4, 4)], build)
    assert _kinds(g) == [("MUL", "f/batch_norm_1"), ("ADD", "f/batch_norm_1")]
    mul, add = g.nodes
    assert (mul.inputs[0], add.inputs[0], g.outputs) == (g.inputs[0], mul.output, [add.output])
    scale = gamma.astype(np.float64) / np.sqrt(var.astype(np.float64) + 1e-3)
    np.testing.assert_allclose(_data(g, mul.inputs[1]), scale.reshape(1, 3, 1, 1), rtol=1e-6)
    np.testing.assert_allclose(_data(g, add.inputs[1]), (beta - mean * scale).reshape(1, 3, 1, 1), rtol=1e-6,
                               atol=1e-7)


def test_a_matmul_with_a_vector_operand_gains_and_drops_a_unit_axis(rng):
    """numpy's x[8] @ w[8, 3] = [3]: the node computes [1, 8] @ [8, 3] = [1, 3], the output is its alias [3]."""
    w = rng.standard_normal((8, 3)).astype(np.float32)
    g = _lower([(8,)], lambda bb, x: relax.op.matmul(x, relax.const(w)))
    (node,) = g.nodes
    a = node.inputs[0]
    assert (g.tensors[a].shape, g.base(a)) == ((1, 8), g.inputs[0])
    assert g.tensors[node.output].shape == (1, 3)
    (out,) = g.outputs
    assert (g.tensors[out].shape, g.base(out)) == ((3,), node.output)


def test_a_tuple_result_is_several_outputs_and_an_op_with_no_row_is_an_error():
    g = _lower([(2, 4)], lambda bb, x: relax.Tuple([bb.emit(relax.op.exp(x)), bb.emit(relax.op.nn.relu(x))]))
    assert _kinds(g) == [("EXP", "f/exp_1"), ("RELU", "f/relu_2")]
    assert g.outputs == [n.output for n in g.nodes]
    with pytest.raises(LoweringError, match="relax.floor has no LPX lowering"):
        _lower([(2, 4)], lambda bb, x: relax.op.floor(x))


def test_a_partitioned_function_inlines_conv_bias_relu_and_keeps_hard_swish_as_one_operator(rng):
    """From ONNX through partition_for_lpx: the lpx function calls two composites, lpx.conv2d_bias_relu
    (inlined: its three ops) and lpx.hard_swish (an idiom: one node for its four ops). Each layer names the
    ONNX tensor it computes where one does (the Conv's converter makes the conv and its bias add: the add
    gives c)."""
    model = make_model([helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
                        helper.make_node("Relu", ["c"], ["r"]), helper.make_node("HardSwish", ["r"], ["y"])],
                       [tensor_info("x", [1, 3, 8, 8])], [tensor_info("y", None)],
                       [weights(rng, "w", (4, 3, 3, 3)), weights(rng, "b", (4,))])
    mod = lpx_tvm.partition_for_lpx(lpx_tvm.from_onnx(model), "tiny", "fp32")
    (func,) = [f for _, f in mod.functions.items()
               if isinstance(f, relax.Function) and f.attrs and f.attrs.get("Codegen") == "lpx"]
    g = lower(func, "f")
    assert _kinds(g) == [("conv2d", "f/conv2d_1"), ("ADD", "f/add_2@c"), ("RELU", "f/relu_3@r"),
                         ("HARD_SWISH", "f/hard_swish_4@y")]
    conv = g.nodes[0]
    assert {k: conv.attrs[k] for k in ("strides", "padding", "dilation", "groups")} == {
        "strides": [1, 1], "padding": [1, 1, 1, 1], "dilation": [1, 1], "groups": 1}
    assert [g.tensors[t].shape for t in conv.inputs] == [(1, 3, 8, 8), (4, 3, 3, 3)]
    assert g.tensors[g.outputs[0]].shape == (1, 4, 8, 8)
