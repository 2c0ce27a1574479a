"""int8 decode steps (issue 50, item 5): a quantised embedding table is gathered as integers and dequantised on
lpx (never dequantised whole on the host, on every call); a move between a DequantizeLinear and a QuantizeLinear
of the same parameters (the rotary embedding's halves, a grouped cache's expansion) runs on the integers; the
quantiser's per-reader copies of one DequantizeLinear are one instruction. Scales are powers of two, so the
expected numbers are exact; the Hugging Face decode steps are checked against ONNX Runtime on the same QDQ
graph."""

from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import lpx_tvm
from conftest import ort_run, run_on_lpx
from lpx_tvm.codegen.graph import Graph
from lpx_tvm.codegen.qfuse import fuse_int8


def _dq(g, x, scale, zp, layer="f/dequantize_1"):
    return g.add_node("DEQUANTIZE", [x], g.tensors[x].shape, "float32", layer, scale=scale, zero_point=zp)


def _q(g, x, scale, zp, layer="f/quantize_9"):
    return g.add_node("QUANTIZE", [x], g.tensors[x].shape, "int8", layer, scale=scale, zero_point=zp)


def _gather_model():
    """ids int64 [1, 2] ─► Gather(DequantizeLinear(table int8 [16, 8], 0.5, 3)) + x ─► Q/DQ(0.25, 0): an int8
    embedding. Its integers lie in -20 .. 20, so every sum is a multiple of 0.25 well inside int8's range."""
    table = (np.arange(16 * 8, dtype=np.int64).reshape(16, 8) % 41 - 20).astype(np.int8)
    nodes = [helper.make_node("DequantizeLinear", ["table_q", "s", "zp"], ["table"]),
             helper.make_node("Gather", ["table", "ids"], ["rows"], axis=0),
             helper.make_node("Add", ["rows", "x"], ["sum"]),
             helper.make_node("QuantizeLinear", ["sum", "s_y", "zp_y"], ["sum_q"]),
             helper.make_node("DequantizeLinear", ["sum_q", "s_y", "zp_y"], ["y"])]
    graph = helper.make_graph(
        nodes, "embedding", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 2]),
                             helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 8])],
        [numpy_helper.from_array(table, "table_q"), numpy_helper.from_array(np.array(0.5, np.float32), "s"),
         numpy_helper.from_array(np.array(3, np.int8), "zp"),
         numpy_helper.from_array(np.array(0.25, np.float32), "s_y"),
         numpy_helper.from_array(np.array(0, np.int8), "zp_y")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), table


def test_an_int8_embedding_is_gathered_as_integers_and_dequantised_on_lpx_not_on_the_host(rng):
    """The host gathers two rows of integers (TVM imports Gather as a wrap of negative ids, ``less``, ``add``,
    ``where``, and a ``take``); lpx dequantises them and adds x, in one call. (Before, the host dequantised the
    whole 16 × 8 table, on every call, then gathered.)"""
    model, table = _gather_model()
    ids = np.array([[3, 11]], np.int64)
    x = (rng.integers(-8, 8, (1, 2, 8)) * 0.25).astype(np.float32)
    compiled = lpx_tvm.compile(model, config="tiny", dtype="int8")
    (y,) = run_on_lpx(compiled, [ids, x], programs=1, host_ops={
        "relax.shape_to_tensor": 1, "relax.less": 1, "relax.add": 1, "relax.where": 1, "relax.take": 2})
    want = (table[ids].astype(np.float32) - 3) * 0.5 + x
    np.testing.assert_array_equal(y, want)
    np.testing.assert_array_equal(y, ort_run(model, {"ids": ids, "x": x})[0])
