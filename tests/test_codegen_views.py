"""Operands of tile ops (``codegen/views.py``): a view of a graph tensor is a shape, a byte offset into its
base and element strides (None when dense); worked by hand as exact tuples."""

import numpy as np

from lpx_tvm.codegen.graph import Graph
from lpx_tvm.codegen.views import Operand, dense_strides, stream, transposed, view, whole


def _graph(shape, dtype="float32"):
    g = Graph()
    return g, g.add_tensor(shape, dtype)


def _elements(op: Operand, base: np.ndarray) -> np.ndarray:
    """The elements an operand names in ``base`` (a flat array of the tensor), via numpy's own strides."""
    item = base.itemsize
    strides = op.strides or dense_strides(op.shape)
    return np.lib.stride_tricks.as_strided(base[op.offset // item:], op.shape, [s * item for s in strides])


def test_dense_strides_are_row_major_element_strides():
    assert dense_strides((2, 3, 4)) == (12, 4, 1)
    assert dense_strides((5,)) == (1,)
    assert dense_strides(()) == ()


def test_an_index_drops_leading_axes_and_moves_the_offset_by_whole_planes():
    g, t = _graph((2, 3, 4))
    # plane 1 of [2, 3, 4] fp32 starts 1 · 12 elements · 4 bytes = 48 bytes in; the rest is dense
    assert view(g, t, index=(1,)) == Operand(t, (3, 4), 48, None)
    # plane 1, row 2: (1 · 12 + 2 · 4) · 4 = 80 bytes
    assert view(g, t, index=(1, 2)) == Operand(t, (4,), 80, None)


def test_a_slice_of_rows_is_dense_and_a_slice_of_columns_keeps_the_row_stride():
    g, t = _graph((4, 6))
    # rows 1..3 of [4, 6]: offset 1 · 6 · 4 = 24 bytes, and rows of 6 follow each other: dense
    assert view(g, t, ranges=[(1, 3)]) == Operand(t, (2, 6), 24, None)
    # rows 1..3, columns 2..5: offset (1 · 6 + 2) · 4 = 32 bytes; a row of 3 is 6 elements from the next
    cols = view(g, t, ranges=[(1, 3), (2, 5)])
    assert cols == Operand(t, (2, 3), 32, (6, 1))
    data = np.arange(24, dtype=np.float32)
    np.testing.assert_array_equal(_elements(cols, data), data.reshape(4, 6)[1:3, 2:5])


def test_the_offset_counts_the_base_tensors_item_size():
    g, t = _graph((4, 6), "float16")
    # (1 · 6 + 2) elements of 2 bytes = 16 bytes
    assert view(g, t, ranges=[(1, 3), (2, 5)]).offset == 16
    g, t = _graph((4, 6), "int8")
    assert view(g, t, ranges=[(1, 3), (2, 5)]).offset == 8


def test_a_reshaped_view_indexes_and_slices_the_new_shape():
    """How tile reads a batched product's block: [6, 8] seen as [2, 3, 8], matrix 1, rows 1..3, columns 4..8."""
    g, t = _graph((6, 8))
    op = view(g, t, (2, 3, 8), (1,), [(1, 3), (4, 8)])
    # offset (1 · 24 + 1 · 8 + 4) · 4 = 144 bytes; rows 8 elements apart
    assert op == Operand(t, (2, 4), 144, (8, 1))
    data = np.arange(48, dtype=np.float32)
    np.testing.assert_array_equal(_elements(op, data), data.reshape(2, 3, 8)[1, 1:3, 4:8])


def test_a_permuted_view_permutes_shape_and_strides():
    g, t = _graph((2, 3, 4))
    op = view(g, t, perm=(2, 0, 1))
    assert op == Operand(t, (4, 2, 3), 0, (1, 12, 4))
    data = np.arange(24, dtype=np.float32)
    np.testing.assert_array_equal(_elements(op, data), data.reshape(2, 3, 4).transpose(2, 0, 1))


def test_transposed_swaps_a_2d_view_and_twice_is_dense_again():
    g, t = _graph((4, 6))
    block = view(g, t, ranges=[(1, 3), (2, 5)])  # [2, 3] at 32 bytes, strides (6, 1)
    assert transposed(block) == Operand(t, (3, 2), 32, (1, 6))
    dense = whole(g, t)
    assert transposed(dense) == Operand(t, (6, 4), 0, (1, 6))
    assert transposed(transposed(dense)) == Operand(t, (4, 6), 0, None)
    data = np.arange(24, dtype=np.float32)
    np.testing.assert_array_equal(_elements(transposed(block), data), data.reshape(4, 6)[1:3, 2:5].T)


def test_a_stream_names_its_chain_and_dtype_and_stays_a_stream_when_transposed():
    s = stream(7, [2, 32], "float32")
    assert s == Operand(None, (2, 32), 0, None, 7, np.dtype(np.float32))
    assert s.size == 64
    assert transposed(s) == Operand(None, (32, 2), 0, (1, 32), 7, np.dtype(np.float32))


def test_whole_is_all_of_a_tensor_seen_with_an_optional_reshape():
    g, t = _graph((2, 3, 4))
    assert whole(g, t) == Operand(t, (2, 3, 4))
    assert whole(g, t, (6, 4)) == Operand(t, (6, 4), 0, None)
    assert whole(g, t, (6, 4)).size == 24
