"""Tiling (``codegen/tile.py``) on the tiny preset, worked by hand: 2 matrix planes of 32 × 32, 4 vector
queues, vector work in row bands of about 64 KiB (at most 16), host transfers in bands of about 16 KiB, and
streamed weight blocks of at most SRAM / 16 = 256 KiB."""

import numpy as np
import pytest

from lpx_tvm.codegen.graph import Graph
from lpx_tvm.codegen.tile import BAND_BYTES, HOST_BAND_BYTES, row_bands, stream_tile_bytes, tile, window_rows
from lpx_tvm.codegen.views import Operand, stream
from lpx_tvm.runtime_sim import Opcode, load_config

TINY = load_config("tiny")
F32 = np.dtype(np.float32)
NO_ACT = dict(act=Opcode.NOP, act_args=(0.0, 0.0))


def _opcodes(ops):
    return [op.opcode.name for op in ops]


def test_the_band_sizes_are_what_these_hand_counts_assume():
    assert (BAND_BYTES, HOST_BAND_BYTES, stream_tile_bytes(TINY)) == (65536, 16384, 262144)
    assert (TINY.unit_count("VXM"), TINY.mxm_planes, TINY.mxm_rows, TINY.mxm_cols) == (4, 2, 32, 32)


def test_row_bands_cut_rows_into_bands_of_about_the_band_bytes_and_never_more_than_16():
    # 96 rows of 98304 bytes / 65536 → 2 bands of 48 rows
    assert row_bands(96, 98304, 65536) == [(0, 48), (48, 96)]
    # 10 MB wants 153 bands: capped at 16, so ⌈100 / 16⌉ = 7 rows a band, which needs only 15 (14 · 7 = 98)
    bands = row_bands(100, 10_000_000, 65536)
    assert (len(bands), bands[0], bands[-1]) == (15, (0, 7), (98, 100))
    assert row_bands(3, 10_000_000, 65536) == [(0, 1), (1, 2), (2, 3)]  # no more bands than rows
    assert row_bands(96, 1000, 65536) == [(0, 96)]


def test_window_rows_are_a_bands_input_rows_with_its_halo_and_padding():
    # 3x3, stride 1, pad 1, 32 rows. Output rows 0..8 read rows -1..8: clipped to 0..9, one row of top padding
    assert window_rows(0, 8, 32, 3, 1, 1, 1) == (0, 9, 1, 0)
    assert window_rows(8, 16, 32, 3, 1, 1, 1) == (7, 17, 0, 0)
    assert window_rows(24, 32, 32, 3, 1, 1, 1) == (23, 32, 0, 1)  # reads up to row 32: one row of bottom pad
    # stride 2: output rows 0..8 read rows -1 .. 7·2 - 1 + 2 = 15
    assert window_rows(0, 8, 32, 3, 2, 1, 1) == (0, 16, 1, 0)


def test_an_elementwise_op_on_a_big_tensor_runs_in_row_bands_between_banded_loads_and_stores():
    """x + y on [96, 256] fp32 (98304 bytes each). Loads and the store: 98304 / 16384 = 6 bands of 16 rows
    (16 · 256 · 4 = 16384 bytes apart); the ADD: 98304 / 65536 → 2 bands of 48 rows (49152 bytes apart)."""
    g = Graph()
    x, y = g.add_tensor((96, 256), "float32"), g.add_tensor((96, 256), "float32")
    z = g.add_node("ADD", [x, y], (96, 256), "float32", "f/add_1")
    g.inputs, g.outputs = [x, y], [z]
    ops = tile(g, TINY)
    assert _opcodes(ops) == ["LOAD"] * 12 + ["ADD"] * 2 + ["STORE"] * 6
    loads = [(op.attrs, op.dsts) for op in ops[:6]]
    assert loads == [({"index": 0, "offset": 16384 * b}, [Operand(x, (16, 256), 16384 * b)]) for b in range(6)]
    assert [op.attrs["index"] for op in ops[6:12]] == [1] * 6
    adds = ops[12:14]
    assert [(op.srcs, op.dsts, op.attrs) for op in adds] == [
        ([Operand(x, (48, 256), off), Operand(y, (48, 256), off)], [Operand(z, (48, 256), off)], {})
        for off in (0, 49152)]
    assert [(op.srcs, op.attrs["offset"]) for op in ops[14:]] == [([Operand(z, (16, 256), 16384 * b)], 16384 * b)
                                                                  for b in range(6)]


def test_a_bias_vector_is_read_whole_by_every_band():
    g = Graph()
    x, b = g.add_tensor((96, 256), "float32"), g.constant(np.ones(256, np.float32))
    z = g.add_node("ADD", [x, b], (96, 256), "float32", "f/add_1")
    g.inputs, g.outputs = [x], [z]
    adds = [op for op in tile(g, TINY) if op.opcode == Opcode.ADD]
    assert [op.srcs for op in adds] == [[Operand(x, (48, 256), 0), Operand(b, (256,))],
                                        [Operand(x, (48, 256), 49152), Operand(b, (256,))]]


def test_a_vector_chain_streams_each_result_into_the_next_op_and_holds_at_most_two_ops_on_tiny():
    """erf(x) · x on [2, 32]: the ERF writes a stream the MUL reads (no SRAM between them). A chain takes the
    vector queues the planes' epilogues leave: 4 - 2 = 2 ops on tiny, so relu ─► neg ─► exp chains the first
    two and the EXP reads the NEG's result from SRAM."""
    g = Graph()
    x = g.add_tensor((2, 32), "float32")
    e = g.add_node("ERF", [x], (2, 32), "float32", "f/erf_1")
    y = g.add_node("MUL", [e, x], (2, 32), "float32", "f/multiply_2")
    g.inputs, g.outputs = [x], [y]
    ops = tile(g, TINY)
    assert _opcodes(ops) == ["LOAD", "ERF", "MUL", "STORE"]
    chained = stream(1, (2, 32), F32)
    assert (ops[1].srcs, ops[1].dsts) == ([Operand(x, (2, 32))], [chained])
    assert (ops[2].srcs, ops[2].dsts) == ([chained, Operand(x, (2, 32))], [Operand(y, (2, 32))])
    assert ops[0].attrs == {"index": 0}  # 256 bytes: one transfer, no offset

    g = Graph()
    x = g.add_tensor((2, 32), "float32")
    r = g.add_node("RELU", [x], (2, 32), "float32", "f/relu_1")
    n = g.add_node("NEG", [r], (2, 32), "float32", "f/negative_2")
    out = g.add_node("EXP", [n], (2, 32), "float32", "f/exp_3")
    g.inputs, g.outputs = [x], [out]
    ops = tile(g, TINY)
    assert [(op.opcode.name, op.dsts) for op in ops[1:4]] == [("RELU", [stream(1, (2, 32), F32)]),
                                                              ("NEG", [Operand(n, (2, 32))]),
                                                              ("EXP", [Operand(out, (2, 32))])]


def _conv(g, x_shape, w_shape, out_shape, padding, groups=1):
    x = g.add_tensor(x_shape, "float32")
    w = g.constant(np.ones(w_shape, np.float32))
    out = g.add_node("conv2d", [x, w], out_shape, "float32", "f/conv2d_1", strides=[1, 1], padding=padding,
                     dilation=[1, 1], groups=groups, **NO_ACT)
    g.inputs, g.outputs = [x], [out]
    return x, w, out


def test_a_3x3_convolution_is_an_im2col_then_a_product_of_two_column_tiles():
    """x [1, 3, 8, 8], w [4, 3, 3, 3], pad 1: im2col gives [1, 1, 27, 64] columns in one band (6912 bytes).
    The product [4, 27] @ [27, 64] keeps the columns stationary (B): 64 / 32 = 2 column tiles, K 27 ≤ 32 in one
    tile; an install is ⌈27 · 32 · 4 / 64⌉ = 54 cycles and 4 rows · 12 passes = 48: one chunk, max(54, 48) = 54
    a plane, 54 + 54 + 8 = 116 (A stationary: at best 7 + 384 + 8). One job a plane."""
    g = Graph()
    x, w, out = _conv(g, (1, 3, 8, 8), (4, 3, 3, 3), (1, 4, 8, 8), [1, 1, 1, 1])
    ops = tile(g, TINY)
    assert _opcodes(ops) == ["LOAD", "IM2COL", "INSTALL", "MATMUL", "EPILOGUE", "INSTALL", "MATMUL", "EPILOGUE",
                             "STORE"]
    im2col = ops[1]
    cols = im2col.dsts[0].tensor
    assert (g.tensors[cols].shape, im2col.srcs, im2col.dsts) == ((1, 1, 27, 64), [Operand(x, (1, 3, 8, 8))],
                                                                 [Operand(cols, (1, 1, 27, 64))])
    assert im2col.attrs == {"kernel": (3, 3), "stride": (1, 1), "pad": (1, 1, 1, 1), "dilation": (1, 1),
                            "groups": 1, "pad_value": 0}
    # the columns are installed, 27 rows × 32 positions each (row stride 64); the weights [4, 27] stream
    assert [(op.srcs, op.unit_index) for op in ops if op.opcode == Opcode.INSTALL] == [
        ([Operand(cols, (27, 32), 0, (64, 1))], 0), ([Operand(cols, (27, 32), 128, (64, 1))], 1)]
    assert [op.srcs for op in ops if op.opcode == Opcode.MATMUL] == [[Operand(w, (4, 27))]] * 2
    # each epilogue writes its 32 positions of all 4 channels: [4, 32] at 0 and 32 · 4 bytes, row stride 64
    assert [op.dsts for op in ops if op.opcode == Opcode.EPILOGUE] == [[Operand(out, (4, 32), 0, (64, 1))],
                                                                       [Operand(out, (4, 32), 128, (64, 1))]]


def test_a_1x1_stride_1_convolution_reads_its_input_as_the_matrix_and_a_depthwise_one_is_one_dwconv():
    """1x1: x [1, 8, 4, 4] is already the [8, 16] matrix; w [4, 8] @ it keeps x stationary (one column tile,
    install 8 · 16 · 4 / 64 = 8 cycles). 1 chunk of 4 channels takes 48 cycles (8 + 48 + 8 = 64); 2 chunks of
    2 channels, one a plane, 24 (8 + 24 + 8 = 40), which 4 chunks only tie; A stationary is at best 2 + 96 + 8.
    So two jobs, each installing all of x and streaming 2 of w's rows (the second 2 · 8 · 4 = 64 bytes in)."""
    g = Graph()
    x, w, out = _conv(g, (1, 8, 4, 4), (4, 8, 1, 1), (1, 4, 4, 4), [0, 0, 0, 0])
    ops = tile(g, TINY)
    assert _opcodes(ops) == ["LOAD"] + ["INSTALL", "MATMUL", "EPILOGUE"] * 2 + ["STORE"]  # no IM2COL
    assert [op.srcs for op in ops if op.opcode == Opcode.INSTALL] == [[Operand(x, (8, 16))]] * 2
    assert [op.srcs for op in ops if op.opcode == Opcode.MATMUL] == [[Operand(w, (2, 8), 0)], [Operand(w, (2, 8), 64)]]

    g = Graph()
    x, w, out = _conv(g, (1, 4, 8, 8), (4, 1, 3, 3), (1, 4, 8, 8), [1, 1, 1, 1], groups=4)
    ops = tile(g, TINY)
    assert _opcodes(ops) == ["LOAD", "DWCONV", "STORE"]
    assert (ops[1].srcs, ops[1].dsts) == ([Operand(x, (1, 4, 8, 8)), Operand(w, (4, 3, 3))],
                                          [Operand(out, (1, 4, 8, 8))])
    assert ops[1].attrs == {"kernel": (3, 3), "stride": (1, 1), "pad": (1, 1, 1, 1), "dilation": (1, 1),
                            "act": Opcode.NOP, "act_args": (0.0, 0.0)}


@pytest.mark.parametrize("in_shape, out_shape, strides", [((1, 8), (4, 8), (0, 1)), ((4, 1), (4, 8), (1, 0)),
                                                          ((8,), (2, 4, 8), (0, 0, 1))])
def test_a_broadcast_is_one_copy_reading_the_repeated_axes_with_stride_0(in_shape, out_shape, strides):
    g = Graph()
    x = g.add_tensor(in_shape, "float32")
    out = g.add_node("broadcast", [x], out_shape, "float32", "f/broadcast_to_1")
    g.inputs, g.outputs = [x], [out]
    (copy,) = [op for op in tile(g, TINY) if op.opcode == Opcode.COPY]
    assert (copy.srcs, copy.dsts) == ([Operand(x, out_shape, 0, strides)], [Operand(out, out_shape)])


def test_a_softmax_over_a_products_columns_runs_chained_from_its_epilogues():
    """[4, 8] @ [8, 16] then a softmax over the 16 columns (≤ the array's 32): B stationary, one column tile;
    an install is 8 · 16 · 4 / 64 = 8 cycles; 2 chunks of 2 rows (24 cycles, one a plane: 8 + 24 + 8 = 40)
    beat 1 chunk of 4 (48: 64). Each job's EPILOGUE streams into a SOFTMAX of its 2 rows."""
    g = Graph()
    x = g.add_tensor((4, 8), "float32")
    mm = g.add_node("matmul", [x, g.constant(np.ones((8, 16), np.float32))], (4, 16), "float32", "f/matmul_1",
                    **NO_ACT)
    sm = g.add_node("SOFTMAX", [mm], (4, 16), "float32", "f/softmax_2", axis=1)
    g.inputs, g.outputs = [x], [sm]
    ops = tile(g, TINY)
    assert _opcodes(ops) == ["LOAD"] + ["INSTALL", "MATMUL", "EPILOGUE", "SOFTMAX"] * 2 + ["STORE"]
    softmaxes = [op for op in ops if op.opcode == Opcode.SOFTMAX]
    epilogues = [op for op in ops if op.opcode == Opcode.EPILOGUE]
    assert [(op.srcs, op.dsts, op.attrs) for op in softmaxes] == [
        (e.dsts, [Operand(sm, (2, 16), off)], {"axis": 1}) for e, off in zip(epilogues, (0, 128))]
    assert [e.dsts[0].stream is not None for e in epilogues] == [True, True]  # streams, not the product's tensor
    assert [op.unit_index for op in ops if op.opcode == Opcode.MATMUL] == [0, 1]


def test_a_weight_over_the_resident_budget_streams_in_column_blocks_into_a_ring_of_buffers(rng):
    """x [4, 512] @ w [512, 256] fp32 (512 KiB) with no resident budget: a block may take 256 KiB, 128 columns
    of 512 · 4 bytes, a whole number of 32-column array tiles: 2 blocks, STREAMed into the first two of 3 ring
    buffers. Each block is [4, 512] @ [512, 128]: 128 / 32 = 4 column tiles × 512 / 32 = 16 K tiles = 64
    INSTALLs and MATMULs, and 4 EPILOGUEs."""
    g = Graph()
    x = g.add_tensor((4, 512), "float32")
    weight = rng.standard_normal((512, 256)).astype(np.float32)
    y = g.add_node("matmul", [x, g.constant(weight)], (4, 256), "float32", "f/matmul_1", **NO_ACT)
    g.inputs, g.outputs = [x], [y]
    ops = tile(g, TINY, resident_budget=0)
    streams = [op for op in ops if op.opcode == Opcode.STREAM]
    assert [op.attrs for op in streams] == [{"index": 0}, {"index": 1}]
    slots = [op.dsts[0].tensor for op in streams]
    assert [op.dsts for op in streams] == [[Operand(slot, (512, 128))] for slot in slots]
    assert len(set(slots)) == 2
    assert [g.tensors[s].shape for s in slots] == [(512, 128)] * 2
    counts = {name: _opcodes(ops).count(name) for name in ("INSTALL", "MATMUL", "EPILOGUE")}
    assert counts == {"INSTALL": 128, "MATMUL": 128, "EPILOGUE": 8}
    assert [b.shape for b in g.streamed] == [(512, 128), (512, 128)]
    np.testing.assert_array_equal(np.concatenate(g.streamed, axis=1), weight)
