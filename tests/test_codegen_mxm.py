"""Matrix products on the planes (``codegen/mxm.py``), worked by hand on the tiny preset: 2 planes of 32 × 32
MACs, 12 passes a row in fp32 and 1 in int8, weights installed over 2 streams of 32 lanes (64 bytes a
cycle), MXM latency 8.

``plan`` picks the stationary operand and the chunks of the streamed rows by an estimated makespan;
``PlaneMapper.map`` cuts the product into K tiles (the array's 32 rows) and column tiles (its 32 columns),
spreads the jobs over the planes and emits INSTALL / MATMUL / EPILOGUE per tile."""


import numpy as np
import pytest

from lpx_tvm.codegen.graph import Graph
from lpx_tvm.codegen.mxm import Mapping, PlaneMapper, Product, plan
from lpx_tvm.codegen.views import Operand, stream, view
from lpx_tvm.runtime_sim import load_config

TINY = load_config("tiny")
F32 = np.dtype(np.float32)


def test_the_tiny_preset_is_what_these_hand_counts_assume():
    assert (TINY.mxm_planes, TINY.mxm_rows, TINY.mxm_cols) == (2, 32, 32)
    assert (TINY.mxm_passes["fp32"], TINY.mxm_passes["int8"], TINY.latency_cycles["MXM"]) == (12, 1, 8)
    assert TINY.mxm_install_streams * TINY.lanes == 64


def _symbolic(m, k, n, dtype=F32, **kw):
    """A product whose operand views are readable tuples of their ranges (enough for B stationary)."""
    return Product(m, k, n, a=lambda m0, m1, k0, k1: ("A", m0, m1, k0, k1),
                   b=lambda k0, k1, n0, n1: ("B", k0, k1, n0, n1),
                   out=lambda m0, m1, n0, n1: ("out", m0, m1, n0, n1),
                   extras=lambda m0, m1, n0, n1, t: [("bias", n0, n1, t)], dtype=np.dtype(dtype), **kw)


def _mapper(g=None):
    ops, chains = [], iter(range(1, 100))
    mapper = PlaneMapper(g or Graph(), TINY, lambda op, srcs, dsts, attrs, layer, unit=None:
                         ops.append((op.name, srcs, dsts, attrs, unit)), lambda: next(chains))
    return mapper, ops


def test_a_wide_product_with_few_rows_keeps_b_stationary_in_one_chunk():
    """[4, 64] @ [64, 96] fp32. K tiles: 64 / 32 = 2.
    B stationary: 96 / 32 = 3 column tiles; an install is 32 · 32 · 4 bytes / 64 = 64 cycles; one chunk of
    4 rows takes 4 · 12 = 48 cycles; ⌈3 / 2⌉ = 2 jobs a plane, each max(64, 48) = 64: a K step of 128
    (≥ 48 + 8 for the partial sums); 64 + 2 · 128 + 8 = 328. More chunks only add installs.
    A stationary: 1 column tile (4 rows), install 32 · 4 · 4 / 64 = 8. 2 chunks of 48 rows: one a plane,
    48 · 12 = 576 cycles, but the second K tile waits for the partial sums (576 + 8): 8 + 2 · 584 + 8 = 1184.
    4 chunks of 24 rows: 2 a plane of 288 = 576, the wait hidden behind the other job: 8 + 2 · 576 + 8 = 1168
    (6, 8, 12 and 16 chunks tie at 576 a step, and a tie keeps fewer chunks)."""
    assert plan(_symbolic(4, 64, 96), TINY) == Mapping("B", 1, 328)
    assert plan(_symbolic(4, 64, 96, stationary="A"), TINY) == Mapping("A", 4, 1168)


def test_a_tall_product_with_few_columns_keeps_a_stationary():
    """[96, 64] @ [64, 4]: the transpose of the case above, so A stationary costs what B did there (328),
    and B what A did (1168)."""
    assert plan(_symbolic(96, 64, 4), TINY) == Mapping("A", 1, 328)
    assert plan(_symbolic(96, 64, 4, stationary="B"), TINY) == Mapping("B", 4, 1168)


def test_a_product_wider_than_the_array_splits_into_column_tiles_and_k_tiles_with_partial_sums():
    """[4, 64] @ [64, 96] fp32, B stationary, one chunk of rows 0..4: column tiles 0..32, 32..64, 64..96, and
    K tiles 0..32, 32..64. The three jobs go to the least-loaded plane in turn (ties: the lower plane):
    plane 0, 1, 0, each adding 2 K tiles · max(64 install, 48 rows) = 128 cycles to its plane. A plane runs
    its jobs' first K tile, then their second: the first writes fp32 partial sums to a new [4, 32] tensor, the
    second adds them and streams the sums into the EPILOGUE. Every install names a buffer of its own."""
    g = Graph()
    mapper, ops = _mapper(g)
    mapper.map(_symbolic(4, 64, 96), "mm")
    sums = [Operand(t, (4, 32)) for t in range(3)]  # made in this order: plane 0's two jobs, then plane 1's
    acc = [stream(c, (4, 32), F32) for c in (1, 2, 3)]
    mm = lambda buffer: {"buffer": buffer, "zp_a": 0, "zp_b": 0}
    expected = [
        # plane 0, K tile 0: jobs (columns 0..32) and (64..96)
        ("INSTALL", [("B", 0, 32, 0, 32)], [], {"buffer": 1}, 0),
        ("MATMUL", [("A", 0, 4, 0, 32)], [sums[0]], mm(1), 0),
        ("INSTALL", [("B", 0, 32, 64, 96)], [], {"buffer": 2}, 0),
        ("MATMUL", [("A", 0, 4, 0, 32)], [sums[1]], mm(2), 0),
        # plane 0, K tile 1: add the partial sums, stream into the epilogue
        ("INSTALL", [("B", 32, 64, 0, 32)], [], {"buffer": 3}, 0),
        ("MATMUL", [("A", 0, 4, 32, 64), sums[0]], [acc[0]], mm(3), 0),
        ("EPILOGUE", [acc[0], ("bias", 0, 32, False)], [("out", 0, 4, 0, 32)], {}, None),
        ("INSTALL", [("B", 32, 64, 64, 96)], [], {"buffer": 4}, 0),
        ("MATMUL", [("A", 0, 4, 32, 64), sums[1]], [acc[1]], mm(4), 0),
        ("EPILOGUE", [acc[1], ("bias", 64, 96, False)], [("out", 0, 4, 64, 96)], {}, None),
        # plane 1: the job of columns 32..64
        ("INSTALL", [("B", 0, 32, 32, 64)], [], {"buffer": 5}, 1),
        ("MATMUL", [("A", 0, 4, 0, 32)], [sums[2]], mm(5), 1),
        ("INSTALL", [("B", 32, 64, 32, 64)], [], {"buffer": 6}, 1),
        ("MATMUL", [("A", 0, 4, 32, 64), sums[2]], [acc[2]], mm(6), 1),
        ("EPILOGUE", [acc[2], ("bias", 32, 64, False)], [("out", 0, 4, 32, 64)], {}, None),
    ]
    assert ops == expected
    assert [t.shape for t in g.tensors] == [(4, 32)] * 3
    assert [t.dtype for t in g.tensors] == [F32] * 3
    assert mapper.load == [256, 128]
    assert mapper.tiles == 6


def test_int8_partial_sums_are_int32_and_the_zero_points_reach_every_matmul():
    """[4, 64] @ [64, 32] int8, B stationary: one column tile, two K tiles, one job: a K tile a plane, the
    second plane's product accumulating the first's int32 sums."""
    g = Graph()
    mapper, ops = _mapper(g)
    mapper.map(_symbolic(4, 64, 32, np.int8, zp_a=3, zp_b=-2, epilogue={"zp_out": 5}, stationary="B"), "q")
    assert [(op, unit) for op, _, _, _, unit in ops] == [("INSTALL", 0), ("MATMUL", 0), ("INSTALL", 1),
                                                         ("MATMUL", 1), ("EPILOGUE", None)]
    assert [t.dtype for t in g.tensors] == [np.dtype(np.int32)]
    assert [attrs for op, _, _, attrs, _ in ops if op == "MATMUL"] == [{"buffer": 1, "zp_a": 3, "zp_b": -2},
                                                                     {"buffer": 2, "zp_a": 3, "zp_b": -2}]
    assert ops[-1][3] == {"zp_out": 5}
    assert ops[3][2] == [stream(1, (4, 32), np.int32)]


def test_a_stationary_installs_a_transposed_and_streams_b_transposed_with_the_zero_points_swapped():
    """[64, 32] @ [32, 4] int8 with A stationary: the plane holds Aᵀ (rows 0..32 of A, then 32..64: two column
    tiles of the array, one K tile), streams Bᵀ's 4 rows, and its result is the output's block transposed.
    The streamed operand is now B, so MATMUL's zp_a is B's zero point."""
    g = Graph()
    a = g.add_tensor((64, 32), "int8")
    b = g.add_tensor((32, 4), "int8")
    out = g.add_tensor((64, 4), "int8")
    p = Product(64, 32, 4, a=lambda m0, m1, k0, k1: view(g, a, ranges=[(m0, m1), (k0, k1)]),
                b=lambda k0, k1, n0, n1: view(g, b, ranges=[(k0, k1), (n0, n1)]),
                out=lambda m0, m1, n0, n1: view(g, out, ranges=[(m0, m1), (n0, n1)]),
                extras=lambda m0, m1, n0, n1, t: [("bias", m0, m1, t)], dtype=np.dtype(np.int8), zp_a=3, zp_b=-2,
                stationary="A")
    mapper, ops = _mapper(g)
    mapper.map(p, "conv")
    assert [(op, unit) for op, _, _, _, unit in ops] == [("INSTALL", 0), ("MATMUL", 0), ("EPILOGUE", None),
                                                         ("INSTALL", 1), ("MATMUL", 1), ("EPILOGUE", None)]
    install, matmul, epilogue = ops[3], ops[4], ops[5]  # the second job: A's rows 32..64
    # Aᵀ block: [32 k, 32 rows] at row 32 of A (32 · 32 bytes = 1024), element strides (1, 32)
    assert install[1] == [Operand(a, (32, 32), 1024, (1, 32))]
    # Bᵀ: [4, 32] from B [32, 4], strides (1, 4)
    assert matmul[1] == [Operand(b, (4, 32), 0, (1, 4))]
    assert matmul[3] == {"buffer": 2, "zp_a": -2, "zp_b": 3}
    assert matmul[2] == [stream(2, (4, 32), np.int32)]  # chain 1 was the first job's
    # the epilogue writes out[32..64, 0..4] transposed: [4, 32] at 32 · 4 bytes = 128, strides (1, 4);
    # its bias is per A row and is asked for transposed
    assert epilogue[1] == [stream(2, (4, 32), np.int32), ("bias", 32, 64, True)]
    assert epilogue[2] == [Operand(out, (4, 32), 128, (1, 4))]


def test_jobs_go_chunk_by_chunk_for_a_matmul_and_column_tile_by_column_tile_for_a_convolution():
    """[64, 32] @ [32, 96] fp32, B stationary: 3 column tiles, one K tile, install 64 cycles.
    1 chunk: 768-cycle jobs, ⌈3 / 2⌉ = 2 a plane: 64 + 1536 + 8 = 1608. 2 chunks of 32 rows (384 cycles):
    ⌈6 / 2⌉ = 3 a plane, 64 + 1152 + 8 = 1224; 3 chunks: 5 a plane of 264, 1320 + 72; 4 and 8 tie at 1152 (a
    tie keeps fewer chunks); 6, 12, 16 are worse. So 6 jobs of equal size, handed to planes 0, 1, 0, 1, ...
    in job order. A matmul's (rows_first) order is chunk by chunk: (rows 0..32: columns 0, 32, 64), then
    rows 32..64; a convolution's is column tile by column tile."""
    assert plan(_symbolic(64, 32, 96, stationary="B"), TINY) == Mapping("B", 2, 1224)
    placed = {}
    for rows_first in (True, False):
        mapper, ops = _mapper()
        mapper.map(_symbolic(64, 32, 96, stationary="B", rows_first=rows_first), "mm")
        units = [unit for op, _, _, _, unit in ops if op == "MATMUL"]
        blocks = [dsts[0][1:] for op, _, dsts, _, _ in ops if op == "EPILOGUE"]  # (m0, m1, n0, n1)
        placed[rows_first] = list(zip(units, blocks))
    assert placed[True] == [(0, (0, 32, 0, 32)), (0, (0, 32, 64, 96)), (0, (32, 64, 32, 64)),
                            (1, (0, 32, 32, 64)), (1, (32, 64, 0, 32)), (1, (32, 64, 64, 96))]
    assert placed[False] == [(0, (0, 32, 0, 32)), (0, (0, 32, 32, 64)), (0, (0, 32, 64, 96)),
                             (1, (32, 64, 0, 32)), (1, (32, 64, 32, 64)), (1, (32, 64, 64, 96))]


def test_more_chunks_when_the_streamed_rows_outweigh_the_installs():
    """[64, 32] @ [32, 32] fp32, B stationary: one column tile, one K tile, install 64 cycles.
    1 chunk: 64 · 12 = 768 cycles on one plane: 64 + 768 + 8 = 840.
    2 chunks: 32 · 12 = 384 each, one a plane: 64 + 384 + 8 = 456.
    3 chunks: ⌈64/3⌉ = 22 rows, 264 cycles, 2 a plane: 64 + 528 + 8 = 600; 4: 16 rows, 192, 2 a plane: 456 (a
    tie keeps 2). From 6 on a plane runs at least 3 jobs of at least 64: no better. So 2 chunks, 0..32, 32..64."""
    assert plan(_symbolic(64, 32, 32, stationary="B"), TINY) == Mapping("B", 2, 456)
    mapper, ops = _mapper()
    mapper.map(_symbolic(64, 32, 32, stationary="B"), "mm")
    assert [(srcs[0], unit) for op, srcs, _, _, unit in ops if op == "MATMUL"] == [(("A", 0, 32, 0, 32), 0),
                                                                                 (("A", 32, 64, 0, 32), 1)]


@pytest.mark.parametrize("m, n", [(4, 96), (64, 32), (40, 70), (100, 4)])
def test_the_jobs_cover_every_output_element_once(m, n):
    """Whatever the chunks and tiles (70 = 32 + 32 + 6 columns, 40 rows in uneven chunks), the epilogues'
    output blocks tile [m, n] exactly once (counted with numpy)."""
    mapper, ops = _mapper()
    mapper.map(_symbolic(m, 64, n, stationary="B"), "mm")
    cover = np.zeros((m, n), int)
    for op, _, dsts, _, _ in ops:
        if op == "EPILOGUE":
            _, m0, m1, n0, n1 = dsts[0]
            cover[m0:m1, n0:n1] += 1
    np.testing.assert_array_equal(cover, np.ones((m, n), int))


def test_a_product_of_one_job_spreads_its_k_tiles_over_the_planes_and_adds_their_sums():
    """[1, 160] @ [160, 32] fp32 on tiny (2 planes of 32 × 32): one job, 5 K tiles. Alone it would run 5
    tiles in turn on one plane, the other idle; split, plane 0 runs K tiles 0..1 (rounding 5/2 to 2) and
    plane 1 tiles 2..4; before plane 1's last tile the vector unit adds its sums so far and plane 0's (one
    ADD), and that last product streams the total into the EPILOGUE."""
    g = Graph()
    mapper, ops = _mapper(g)
    mapper.map(_symbolic(1, 160, 32, stationary="B"), "fc")
    assert [(op, unit) for op, _, _, _, unit in ops] == [
        ("INSTALL", 0), ("MATMUL", 0), ("INSTALL", 0), ("MATMUL", 0),
        ("INSTALL", 1), ("MATMUL", 1), ("INSTALL", 1), ("MATMUL", 1),
        ("ADD", None), ("INSTALL", 1), ("MATMUL", 1), ("EPILOGUE", None)]
    assert [k for (op, srcs, _, _, _) in ops if op == "INSTALL" for (_, k, *_rest) in srcs] == [0, 32, 64, 96, 128]
    plane_0_sums, plane_1_sums = (Operand(t, (1, 32)) for t in range(2))
    add = next(op for op in ops if op[0] == "ADD")
    assert add[1] == [plane_1_sums, plane_0_sums] and add[2] == [plane_1_sums]
    last = ops[-2]
    assert last[1][1] == plane_1_sums  # the last tile accumulates onto the total


def test_a_split_product_matches_numpy_on_the_simulator():
    """The same shape end to end: an ONNX MatMul [1, 160] @ [160, 32] in fp32 on tiny, one lpx call, against
    numpy (the sums meet in another order than one plane's, so to fp32 rounding)."""
    import lpx_tvm
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(7)
    w = rng.standard_normal((160, 32)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "fc",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 160])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32])],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    from conftest import run_on_lpx

    compiled = lpx_tvm.compile(model, config="tiny")
    x = rng.standard_normal((1, 160)).astype(np.float32)
    (y,) = run_on_lpx(compiled, [x])
    (sim,) = compiled.simulators.values()
    assert sum(ins.opcode.name == "ADD" for ins in sim.program.instructions) == 1
    np.testing.assert_allclose(y, x @ w, rtol=1e-5, atol=1e-5)
