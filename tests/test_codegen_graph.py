"""The LPX operator graph (``codegen/graph.py``): tensors are shapes and numpy dtypes, constants carry their
data, a reshape is an alias of its base's bytes, and the graph counts each base tensor's readers."""

import numpy as np

from lpx_tvm.codegen.graph import Graph, Node, Tensor


def test_tensors_get_consecutive_ids_int_shapes_and_numpy_dtypes():
    g = Graph()
    a = g.add_tensor([np.int64(2), 3], "float16")  # numpy ints and a dtype name in; plain ints and np.dtype out
    b = g.add_tensor((4,), np.dtype(np.int8))
    assert (a, b) == (0, 1)
    assert g.tensors[a] == Tensor((2, 3), np.dtype(np.float16))
    assert type(g.tensors[a].shape[0]) is int
    assert g.tensors[b].dtype == np.dtype(np.int8)
    # 2 · 3 halves of 2 bytes = 12 bytes; 4 int8 = 4 bytes; a 0-d fp32 scalar = 1 element of 4 bytes
    assert g.tensors[a].nbytes == 12
    assert g.tensors[b].nbytes == 4
    assert g.tensors[g.add_tensor((), "float32")].nbytes == 4


def test_a_constant_keeps_its_data_in_c_order_and_a_scalar_keeps_rank_zero():
    g = Graph()
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    transposed = g.constant(w.T)  # a Fortran-ordered view: copied to C order, same values
    scalar = g.constant(np.float32(2.5))  # not np.ascontiguousarray, which makes shape (1,)
    t = g.tensors[transposed]
    assert t.shape == (3, 2)
    assert t.data.flags.c_contiguous
    np.testing.assert_array_equal(t.data, [[0, 3], [1, 4], [2, 5]])
    assert g.tensors[scalar].shape == ()
    assert g.tensors[scalar].data.shape == ()
    assert [g.is_constant(transposed), g.is_constant(g.add_tensor((2,), "float32"))] == [True, False]


def test_a_c_ordered_constant_is_kept_as_is_not_copied():
    g = Graph()
    w = np.ones((4, 4), np.float32)
    assert g.tensors[g.constant(w)].data is w  # weights are large: no copy when none is needed


def test_add_node_makes_the_output_tensor_and_records_inputs_attrs_and_layer():
    g = Graph()
    x = g.add_tensor((2, 8), "float32")
    out = g.add_node("SOFTMAX", (x,), (2, 8), "float32", "f/softmax_1", axis=1)
    assert out == 1  # x is tensor 0
    assert g.nodes == [Node("SOFTMAX", [0], 1, {"axis": 1}, "f/softmax_1")]
    assert isinstance(g.nodes[0].inputs, list)  # a tuple in, a list out: later stages rewrite inputs
    assert (g.tensors[out].shape, g.tensors[out].dtype, g.tensors[out].data) == ((2, 8), np.dtype("float32"), None)
    assert g.producer() == {1: g.nodes[0]}


def test_base_follows_a_chain_of_reshape_aliases_to_the_tensor_that_owns_the_bytes():
    g = Graph()
    x = g.add_tensor((2, 3, 4), "float32")
    flat = g.add_tensor((6, 4), "float32", alias_of=x)
    row = g.add_tensor((24,), "float32", alias_of=flat)
    assert [g.base(x), g.base(flat), g.base(row)] == [x, x, x]


def test_resident_means_a_constant_or_state_seen_through_any_alias_and_nothing_else():
    g = Graph()
    w = g.constant(np.zeros((4, 4), np.float32))
    w_flat = g.add_tensor((16,), "float32", alias_of=w)
    cache = g.add_tensor((2, 8), "float32")
    cache_view = g.add_tensor((16,), "float32", alias_of=cache)
    x = g.add_tensor((4, 4), "float32")
    g.state = {cache}
    assert [g.is_resident(t) for t in (w, w_flat, cache, cache_view, x)] == [True, True, True, True, False]


def test_uses_counts_reads_by_base_tensor_with_graph_outputs_as_readers():
    g = Graph()
    x = g.add_tensor((2, 4), "float32")
    x_flat = g.add_tensor((8,), "float32", alias_of=x)
    r = g.add_node("RELU", [x], (2, 4), "float32", "relu")
    s = g.add_node("ADD", [x_flat, r], (8,), "float32", "add")  # x read again, through its alias
    g.outputs = [s, r]
    # x: RELU + ADD (via x_flat) = 2; r: ADD + output = 2; s: output = 1; the alias itself never appears
    assert g.uses() == {x: 2, r: 2, s: 1}


def test_every_compound_kind_has_its_tiling_and_the_rest_are_opcodes():
    """tile's table names a tiling for every NodeKind but the products (tiled with what the whole graph
    decided); a kind outside the enum must be an opcode's name, run as one instruction."""
    from lpx_tvm.codegen.graph import PRODUCTS, Graph, NodeKind
    from lpx_tvm.codegen.tile import _Tiler
    from lpx_tvm.runtime_sim import Opcode, load_config

    tiler = _Tiler(Graph(), load_config("tiny"))
    assert set(tiler.by_kind) | PRODUCTS == set(NodeKind)
    # (a compound kind is written in lower case: it can never be read as an opcode's name)
    assert not {kind.value for kind in NodeKind} & set(Opcode.__members__)
    assert NodeKind.MATMUL == "matmul" and f"{NodeKind.QCONV2D}" == "qconv2d"
