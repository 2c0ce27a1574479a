"""The simulator's fast path (the tiles of one product in one call) against the tile-by-tile reference.

With integer-valued weights and inputs every fp32 sum here is exact (below 2**24), so the order a product
adds in cannot change a result, and the fast path must be bit-equal to the reference in every float
storage type, not merely close. The zoo's records check every model the same way (``fast_bit_equal``,
``fast_max_diff``); ``scripts/fast_path.py`` sweeps every zoo model and dtype.
"""

from collections import Counter
from contextlib import contextmanager

import numpy as np
import pytest
from onnx import helper, numpy_helper

import lpx_tvm
from lpx_tvm.app.tools.zoo import ZOO, run_model
from lpx_tvm.runtime_sim import Opcode, reference_arithmetic
from conftest import make_model, ort_reference, run_on_lpx, tensor_info


def _ints(rng, name, shape):
    return numpy_helper.from_array(rng.integers(-1, 2, shape).astype(np.float32), name)


def conv_pair(rng):
    """3×3 conv (16 ─► 32 channels, 28×28, padded) + ReLU + 1×1 conv: |sums| ≤ 16·9 + 1 and 32·145 + 1."""
    inits = [_ints(rng, "w", (32, 16, 3, 3)), _ints(rng, "b", (32,)), _ints(rng, "w2", (32, 32, 1, 1)),
             _ints(rng, "b2", (32,))]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Conv", ["r", "w2", "b2"], ["y"])]
    return make_model(nodes, [tensor_info("x", [1, 16, 28, 28])], [tensor_info("y", [1, 32, 28, 28])], inits)


def mlp_pair(rng):
    """[64, 640] @ [640, 640], ReLU, @ [640, 640]: |sums| ≤ 640 and 640·640."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["y"])]
    return make_model(nodes, [tensor_info("x", [64, 640])], [tensor_info("y", [64, 640])],
                      [_ints(rng, "w", (640, 640)), _ints(rng, "w2", (640, 640))])


def _tiles(program) -> int:
    """Distinct tiles the program installs (its SRAM source: the same bytes are the same tile)."""
    return len({(i.srcs[0].addr, i.srcs[0].shape, i.srcs[0].strides)
                for i in program.instructions if i.opcode == Opcode.INSTALL})


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("build, shape", [(conv_pair, (1, 16, 28, 28)), (mlp_pair, (64, 640))],
                         ids=["conv", "mlp"])
def test_fast_path_is_bit_equal_where_sums_are_exact(rng, build, shape, dtype):
    model = build(rng)
    x = rng.integers(-1, 2, shape).astype(np.float32)
    compiled = lpx_tvm.compile(model, config="tsp", dtype=dtype)
    (fast,) = run_on_lpx(compiled, [x], programs=1)
    with reference_arithmetic():
        (reference,) = run_on_lpx(compiled, [x], programs=1)
    np.testing.assert_array_equal(fast, reference)
    # and both are the model: integers below 2**24 are exact in fp32, and below 2**8 in every storage type
    if dtype == "fp32":
        np.testing.assert_array_equal(fast, ort_reference(model, {"x": x})[0])


def _calls(sim) -> Counter:
    """How many of the fast path's calls run each opcode (a merged call runs the opcodes of its steps)."""
    return Counter(op for fn, opcode, *_ in sim._fast for op in getattr(fn, "opcodes", (opcode,)))


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_a_convolution_s_products_run_once_per_tile(rng, dtype):
    """Every MATMUL that multiplies one installed tile by row blocks of one operand runs in one call, with the
    EPILOGUEs its results stream to: as many products as the program has distinct tiles, against four
    MATMULs per tile in the stream."""
    compiled = lpx_tvm.compile(conv_pair(rng), config="tsp", dtype=dtype)
    (sim,) = compiled.simulators.values()
    in_stream, fast = Counter(i.opcode for i in sim.program.instructions), _calls(sim)
    assert in_stream[Opcode.MATMUL] == 4 * _tiles(sim.program)
    assert fast[Opcode.MATMUL] == _tiles(sim.program) == fast[Opcode.EPILOGUE]
    assert fast[Opcode.INSTALL] == 0, "a tile nothing overwrites is read where it lies"
    assert fast[Opcode.IM2COL] < in_stream[Opcode.IM2COL], "the bands of the 3×3 convolution"


@pytest.fixture
def numpy_steps():
    """Every elementwise step by numpy, one call a step, none fused into a kernel
    (:mod:`lpx_tvm.runtime_sim.fusion`): the calls these tests watch."""
    from lpx_tvm.runtime_sim import fusion

    compiler = fusion.use_elementwise_kernels(None)
    yield
    fusion.use_elementwise_kernels(compiler)


@contextmanager
def _recording(opcode, what):
    """``what(outs, ins)`` of every call of ``opcode`` by the simulators built inside, appended as each runs."""
    from lpx_tvm.runtime_sim.semantics import SEMANTICS

    seen, run = [], SEMANTICS[opcode]

    def recording(outs, ins, attrs):
        seen.append(what(outs, ins))
        run(outs, ins, attrs)
    SEMANTICS[opcode] = recording
    try:
        yield seen
    finally:
        SEMANTICS[opcode] = run


def _recording_products():
    """The ``(M, K, N)`` of every MATMUL call."""
    return _recording(Opcode.MATMUL, lambda outs, ins: (int(np.prod(ins[0].shape[:-1])), *ins[1].value.shape))


def _in_place(outs, ins) -> bool:
    """Whether a call reads its first input where it writes its result."""
    return ins[0] is outs[0]


def _product_shapes(compiled, x) -> list:
    """``(M, K, N)`` of every MATMUL call one fast run of ``compiled``'s one program on ``x`` makes."""
    with _recording_products() as shapes:
        (sim,) = compiled.simulators.values()
    sim.run([x])
    return shapes


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16", "int8"])
def test_the_k_chunks_of_a_product_run_as_one_product(rng, dtype):
    """[32, 1280] @ [1280, 320] on a 320-row plane: per row block four K-chunks, the first three adding into a
    partial sum in SRAM and the fourth streaming to the epilogue (nothing reads the partial sum after). In a
    float type all four run as one MATMUL of K = 1280; in int8 the three as one of K = 960 (128 · 128 · 960 <
    2**24, so fp32 sums it exactly; 1280 would not be) and the fourth apart. Every multiply-add is made once;
    the values are the reference's and numpy's."""
    w = rng.integers(-1, 2, (1280, 320)).astype(np.float32)
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["y"])], [tensor_info("x", [32, 1280])],
                       [tensor_info("y", [32, 320])], [numpy_helper.from_array(w, "w")])
    x = rng.integers(-1, 2, (32, 1280)).astype(np.float32)
    if dtype == "int8":
        model = lpx_tvm.quantize(model, [{"x": x}])
    compiled = lpx_tvm.compile(model, config="tsp", dtype=dtype)
    shapes = _product_shapes(compiled, x)
    assert {k for _, k, _ in shapes} == ({960, 320} if dtype == "int8" else {1280})
    assert sum(m * k * n for m, k, n in shapes) == 32 * 1280 * 320
    (fast,) = run_on_lpx(compiled, [x], programs=1)
    with reference_arithmetic():
        (reference,) = run_on_lpx(compiled, [x], programs=1)
    np.testing.assert_array_equal(fast, reference)
    if dtype != "int8":
        np.testing.assert_array_equal(fast, x @ w)


def test_an_integer_partial_sum_past_fp32s_exact_range_is_added_exactly():
    """int32 accumulation is exact: a partial sum of 2**24 + 1 plus a chunk's 1 + 1 is 2**24 + 3, which no fp32
    holds (it would round to 2**24 + 4)."""
    from lpx_tvm.runtime_sim.semantics import SEMANTICS, WeightBuffer

    tile = WeightBuffer()
    tile.value = np.ones((2, 1), np.int8)
    out = np.zeros((1, 1), np.int32)
    partial = np.full((1, 1), 2 ** 24 + 1, np.int32)
    SEMANTICS[Opcode.MATMUL]([out], [np.ones((1, 2), np.int8), tile, partial], {"zp_a": 0, "zp_b": 0})
    assert out[0, 0] == 2 ** 24 + 3


@pytest.mark.parametrize("name, dtype", [("squeezenet", "int8"), ("bert_encoder", "int8"), ("shufflenet", "fp32")])
@pytest.mark.slow
def test_zoo_records_carry_the_fast_path_check(name, dtype, monkeypatch):
    """The zoo runs every model twice, fast and tile by tile: int8 must be bit-equal. The record is not taken
    on trust: the test runs the model the zoo compiled again itself, on the fast path and tile by tile
    (``reference_arithmetic``), compares the two, and the record must say what the test found."""
    from lpx_tvm.app.tools import zoo

    seen = []
    checked = zoo.fast_against_reference

    def spy(compiled, args, outputs):
        seen.append((compiled, args, outputs))
        return checked(compiled, args, outputs)

    monkeypatch.setattr(zoo, "fast_against_reference", spy)
    record = run_model(ZOO[name], config="tsp", llvm=False, repeat=1, dtype=dtype)
    ((compiled, args, outputs),) = seen
    fast = compiled(*args)
    with reference_arithmetic():
        tiled = compiled(*args)
    assert len(fast) == len(tiled) == len(outputs) >= 1
    for f, given in zip(fast, outputs, strict=True):
        np.testing.assert_array_equal(f, given)  # the zoo compared the fast path's own outputs
    pairs = [(np.asarray(f, np.float64), np.asarray(t, np.float64)) for f, t in zip(fast, tiled, strict=True)]
    worst = max(float(np.abs(f - t).max()) / float(np.abs(t).max()) for f, t in pairs)
    if dtype == "int8":
        for f, t in pairs:
            np.testing.assert_array_equal(f, t)
        assert record["fast_bit_equal"] is True
        assert record["fast_max_diff"] == 0.0
    else:  # fp32: the order a BLAS kernel adds in moves the last bits only
        assert worst <= 1e-4
        assert record["fast_bit_equal"] is all(np.array_equal(f, t) for f, t in pairs)
        assert record["fast_max_diff"] == pytest.approx(0.0 if record["fast_bit_equal"] else worst, rel=1e-9, abs=0)


def _two_row_blocks(rng, copy_reads_first_result: bool):
    """x0 ─► A (16 × 8, two row blocks), x1 ─► B; one installed tile W; top = A[:8] @ W; COPY (top's result, or
    B) ─► A[8:]; bottom = A[8:] @ W. The two products share the tile and their row blocks follow each other."""
    from lpx_tvm.runtime_sim import DType, TensorRef
    from programs import Layout, ins, program

    f32 = DType.F32
    layout = Layout()
    w = layout.const(rng.integers(-2, 3, (8, 8)).astype(np.float32))
    a, b = layout.take((16, 8), f32), layout.take((8, 8), f32)
    top, bottom = TensorRef(a.addr, (8, 8), f32), TensorRef(a.addr + 8 * 8 * 4, (8, 8), f32)
    out0, out1 = layout.take((8, 8), f32), layout.take((8, 8), f32)
    code = [ins("LOAD", [], [a], cycle=0, index=0), ins("LOAD", [], [b], cycle=1, index=1),
            ins("INSTALL", [w], [], cycle=10, buffer=0),
            ins("MATMUL", [top], [out0], cycle=20, buffer=0),
            ins("COPY", [out0 if copy_reads_first_result else b], [bottom], cycle=30),
            ins("MATMUL", [bottom], [out1], cycle=40, buffer=0),
            ins("STORE", [out0], [], cycle=50, index=0), ins("STORE", [out1], [], cycle=51, index=1)]
    prog = program(code, layout, inputs=[((16, 8), f32), ((8, 8), f32)], outputs=[((8, 8), f32)] * 2)
    return prog, np.frombuffer(layout.constants[0].data, np.float32).reshape(8, 8)


@pytest.mark.parametrize("dependent", [False, True], ids=["independent", "copy-reads-the-first-result"])
def test_products_merge_only_past_what_they_share_no_byte_with(rng, dependent):
    """Independent, the first product moves down past the COPY (which touches neither its rows, its tile nor its
    result) and both run as one call. Dependent, the COPY reads the first result and writes the second's rows:
    neither product can move past it, and they run as two. Either way the values are numpy's."""
    from lpx_tvm.runtime_sim import Simulator

    prog, w = _two_row_blocks(rng, dependent)
    x0, x1 = rng.integers(-2, 3, (16, 8)).astype(np.float32), rng.integers(-2, 3, (8, 8)).astype(np.float32)
    sim = Simulator(prog, check_schedule=False)
    top, bottom = sim.run([x0, x1])
    np.testing.assert_array_equal(top, x0[:8] @ w)
    np.testing.assert_array_equal(bottom, (top if dependent else x1) @ w)
    assert _calls(sim)[Opcode.MATMUL] == (2 if dependent else 1)


@pytest.mark.parametrize("columns", [slice(None), slice(7, 327)], ids=["whole rows", "a tile of columns"])
def test_half_floats_are_widened_bit_for_bit_as_numpy_casts_them(columns):
    """Every finite fp16 bit pattern (subnormals, ±0 and the largest among them) comes out as numpy's own
    cast gives it; so do rows holding an inf or a NaN (their block falls back to that cast)."""
    from lpx_tvm.runtime_sim.semantics import widen_half

    finite = np.array([b for b in range(1 << 16) if (b >> 10) & 0x1F != 0x1F], np.uint16)  # 63,488 patterns
    rows = np.resize(finite, (1024, 400)).view(np.float16)[:, columns]
    special = rows.copy()
    special[700, 3] = np.inf
    special[900, 0] = np.nan
    for half in (rows, special):
        np.testing.assert_array_equal(widen_half(half).view(np.uint32), half.astype(np.float32).view(np.uint32))
    assert np.isposinf(widen_half(special)[700, 3]) and np.isnan(widen_half(special)[900, 0])


def test_joined_k_chunks_still_read_what_their_first_chunk_added_to(rng):
    """P = Q + a0 @ W0; P += a1 @ W1; COPY x1 ─► Q; P += a2 @ W2: the first two chunks join (nothing between
    them touches their bytes), but the joined product reads Q, which the COPY then overwrites, so it cannot
    move down to the third: P must be the old Q's sum, as numpy makes it."""
    from lpx_tvm.runtime_sim import DType, Simulator, TensorRef
    from programs import Layout, ins, program

    f32 = DType.F32
    layout = Layout()
    w = rng.integers(-2, 3, (24, 8)).astype(np.float32)
    weights = layout.const(w)
    a, q, p = layout.take((4, 24), f32), layout.take((4, 8), f32), layout.take((4, 8), f32)
    chunks = [TensorRef(a.addr + 8 * k * 4, (4, 8), f32, strides=(24, 1)) for k in range(3)]
    tiles = [TensorRef(weights.addr + 8 * 8 * 4 * k, (8, 8), f32) for k in range(3)]
    code = [ins("LOAD", [], [a], cycle=0, index=0), ins("LOAD", [], [q], cycle=1, index=1)]
    places = [(0, 0), (1, 0), (0, 1)]  # (plane, buffer) of each chunk's tile
    code += [ins("INSTALL", [tile], [], cycle=10 + k, unit_index=u, buffer=b)
             for k, (tile, (u, b)) in enumerate(zip(tiles, places))]
    code += [ins("MATMUL", [chunks[0], q], [p], cycle=20, unit_index=0, buffer=0),
             ins("MATMUL", [chunks[1], p], [p], cycle=30, unit_index=1, buffer=0),
             ins("COPY", [layout.take((4, 8), f32)], [q], cycle=40),
             ins("MATMUL", [chunks[2], p], [p], cycle=50, unit_index=0, buffer=1),
             ins("STORE", [p], [], cycle=60, index=0)]
    prog = program(code, layout, inputs=[((4, 24), f32), ((4, 8), f32)], outputs=[((4, 8), f32)])
    x, old_q = rng.integers(-2, 3, (4, 24)).astype(np.float32), rng.integers(-9, 9, (4, 8)).astype(np.float32)
    sim = Simulator(prog, check_schedule=False)
    (out,) = sim.run([x, old_q])
    np.testing.assert_array_equal(out, old_q + x @ w)
    # the fast path's MATMUL entries here are single products: their operands say their K
    assert sorted(ins_[0].shape[-1] for _, op, _, ins_, _, _ in sim._fast if op == Opcode.MATMUL) == [8, 16]


@pytest.mark.parametrize("partial_read_later", [False, True], ids=["partial-dead", "partial-read-later"])
def test_the_last_k_chunk_joins_where_the_partial_sum_is_dead(rng, partial_read_later):
    """P = a0 @ W0; P += a1 @ W1; S = a2 @ W2 + P ─► EPILOGUE ─► y. Nothing reads P after: all three chunks
    are one product of K = 24 (P is never written, and no one sees it). A COPY of P after: the last chunk
    stays apart (K = 16 and 8), and the copy is the partial sum. The values are numpy's either way."""
    from lpx_tvm.runtime_sim import DType, Simulator, Space, TensorRef
    from programs import Layout, ins, program

    f32 = DType.F32
    layout = Layout()
    w = rng.integers(-2, 3, (24, 8)).astype(np.float32)
    weights = layout.const(w)
    a, p, y, kept = (layout.take(shape, f32) for shape in ((4, 24), (4, 8), (4, 8), (4, 8)))
    chunks = [TensorRef(a.addr + 8 * k * 4, (4, 8), f32, strides=(24, 1)) for k in range(3)]
    tiles = [TensorRef(weights.addr + 8 * 8 * 4 * k, (8, 8), f32) for k in range(3)]
    stream = TensorRef(0, (4, 8), f32, space=Space.STREAM)
    places = [(0, 0), (1, 0), (0, 1)]  # (plane, buffer) of each chunk's tile
    code = [ins("LOAD", [], [a], cycle=0, index=0)]
    code += [ins("INSTALL", [tile], [], cycle=10 + k, unit_index=u, buffer=b)
             for k, (tile, (u, b)) in enumerate(zip(tiles, places))]
    code += [ins("MATMUL", [chunks[0]], [p], cycle=20, unit_index=0, buffer=0),
             ins("MATMUL", [chunks[1], p], [p], cycle=30, unit_index=1, buffer=0),
             ins("MATMUL", [chunks[2], p], [stream], cycle=40, unit_index=0, buffer=1),
             ins("EPILOGUE", [stream], [y], cycle=50, act=Opcode.NOP, act_args=(0.0, 0.0), zp_out=0),
             ins("STORE", [y], [], cycle=60, index=0)]
    outputs = [((4, 8), f32)]
    if partial_read_later:
        code += [ins("COPY", [p], [kept], cycle=70), ins("STORE", [kept], [], cycle=80, index=1)]
        outputs.append(((4, 8), f32))
    prog = program(code, layout, inputs=[((4, 24), f32)], outputs=outputs)
    x = rng.integers(-2, 3, (4, 24)).astype(np.float32)
    with _recording_products() as shapes:
        sim = Simulator(prog, check_schedule=False)
        results = sim.run([x])
    np.testing.assert_array_equal(results[0], x @ w)
    if partial_read_later:
        np.testing.assert_array_equal(results[1], x[:, :16] @ w[:16])
    assert sorted(k for _, k, _ in shapes) == ([8, 16] if partial_read_later else [24])


def _block_rows(columns: int) -> int:
    from lpx_tvm.runtime_sim import semantics

    return semantics._HALF_ROWS_ELEMENTS // columns


@pytest.mark.parametrize("columns", [256, 5000])
def test_a_tile_with_many_subnormals_widens_whole_to_numpys_cast(columns):
    """A prefill's product (many rows) widens the whole tile, about 2% of it subnormal, with zeros and negative
    zeros: the widened tile is numpy's cast, bit for bit, narrow or wide."""
    from lpx_tvm.runtime_sim.semantics import widen_half

    rng = np.random.default_rng(15)
    tile = (rng.standard_normal((2 * _block_rows(256) + 40, columns)) * 0.002).astype(np.float16)
    tile.flat[::101] = np.float16(-0.0)
    tile.flat[1::103] = np.float16(0.0)
    assert ((np.abs(tile.astype(np.float32)) < 2.0 ** -14) & (tile != 0)).mean() > 0.01
    np.testing.assert_array_equal(widen_half(tile).view(np.int32), tile.astype(np.float32).view(np.int32))


def test_merged_entries_share_their_gather_buffers_slot_by_slot():
    """An entry needs its gather and scatter buffers only during its own call: the k-th buffer every entry
    asks for (of one dtype) is one buffer, as large as the largest asked for, never one an entry."""
    from lpx_tvm.runtime_sim.fast_path import _Scratch

    scratch = _Scratch()
    first, second = scratch.user(), scratch.user()
    a0, a1 = first((4, 8), np.float32), first((4, 8), np.float32)
    b0, b1 = second((2, 8), np.float32), second((3, 3), np.float16)
    assert np.shares_memory(a0, b0) and not np.shares_memory(a0, a1)  # slot 0 shared; slots 0 and 1 apart
    assert not np.shares_memory(a1, b1)  # another dtype: another buffer
    assert b0.shape == (2, 8) and b1.dtype == np.float16
    larger = scratch.user()((16, 8), np.float32)  # past slot 0's size: a buffer of its own, entries after share it
    assert not np.shares_memory(larger, a0) and np.shares_memory(scratch.user()((1, 8), np.float32), larger)


def test_a_products_epilogue_works_in_place_where_the_product_is_computed(rng, numpy_steps):
    """Every float product of the conv pair streams only to its EPILOGUE: the fast path computes it where that
    EPILOGUE writes (the activation, channels first, so the product's rows are the output's columns), and
    the EPILOGUE adds its bias there, in place: as many in-place EPILOGUEs as the program has distinct tiles,
    and the values are the reference's."""
    compiled = lpx_tvm.compile(conv_pair(rng), config="tsp")
    (sim,) = compiled.simulators.values()
    x = rng.integers(-1, 2, (1, 16, 28, 28)).astype(np.float32)
    with _recording(Opcode.EPILOGUE, _in_place) as in_place:
        fast = lpx_tvm.runtime_sim.Simulator(sim.program, check_schedule=False).run([x])[0]
    assert in_place == [True] * _tiles(sim.program)
    with reference_arithmetic():
        (reference,) = run_on_lpx(compiled, [x], programs=1)
    np.testing.assert_array_equal(fast, reference)


def test_a_product_is_not_computed_over_the_bias_its_epilogue_reads(rng):
    """y = a @ W + bias, the EPILOGUE writing y over the SRAM row that holds the bias (its last row): the
    product may not be computed where y goes, or the EPILOGUE would add the product's last row, not the
    bias. The values are numpy's."""
    from lpx_tvm.runtime_sim import DType, Simulator, Space, TensorRef
    from programs import Layout, ins, program

    f32 = DType.F32
    layout = Layout()
    w = layout.const(rng.integers(-2, 3, (8, 8)).astype(np.float32))
    a, y = layout.take((8, 8), f32), layout.take((8, 8), f32)
    bias = TensorRef(y.addr + 7 * 8 * 4, (1, 8), f32)
    stream = TensorRef(0, (8, 8), f32, None, Space.STREAM)
    code = [ins("LOAD", [], [a], cycle=0, index=0), ins("LOAD", [], [bias], cycle=1, index=1),
            ins("INSTALL", [w], [], cycle=10, buffer=0), ins("MATMUL", [a], [stream], cycle=20, buffer=0),
            ins("EPILOGUE", [stream, bias], [y], cycle=30), ins("STORE", [y], [], cycle=40, index=0)]
    prog = program(code, layout, inputs=[((8, 8), f32), ((1, 8), f32)], outputs=[((8, 8), f32)])
    x, b = rng.integers(-2, 3, (8, 8)).astype(np.float32), rng.integers(-2, 3, (1, 8)).astype(np.float32)
    (got,) = Simulator(prog, check_schedule=False).run([x, b])
    weights = np.frombuffer(layout.constants[0].data, np.float32).reshape(8, 8)
    np.testing.assert_array_equal(got, x @ weights + b)


def test_a_chain_joins_past_a_later_write_of_a_stream_it_passes_a_result_through(rng):
    """Two bands of y = -(-(x + c)), the second's first step issued between the first band's steps and
    writing the stream the first band's first result went through (dead by then). The chain carries that
    result in a buffer of its own, so the write does not hold it back: each band is one chain, and the two,
    whose rows follow each other, run as one call of three steps. The values are numpy's."""
    from lpx_tvm.runtime_sim import DType, Simulator, Space, TensorRef
    from programs import Layout, ins, program

    f32 = DType.F32
    layout = Layout()
    c = layout.const(rng.integers(-2, 3, (1, 8)).astype(np.float32))  # a row both bands add
    x, y = layout.take((8, 8), f32), layout.take((8, 8), f32)

    def rows(ref, band):
        return TensorRef(ref.addr + band * 4 * 8 * 4, (4, 8), f32)

    def stream(number):
        return TensorRef(number, (4, 8), f32, None, Space.STREAM)
    code = [ins("LOAD", [], [x], cycle=0, index=0),
            ins("ADD", [rows(x, 0), c], [stream(0)], cycle=10), ins("NEG", [stream(0)], [stream(1)], cycle=11),
            ins("ADD", [rows(x, 1), c], [stream(0)], cycle=12),  # band 1 writes stream 0 again
            ins("NEG", [stream(1)], [rows(y, 0)], cycle=13),
            ins("NEG", [stream(0)], [stream(2)], cycle=14), ins("NEG", [stream(2)], [rows(y, 1)], cycle=15),
            ins("STORE", [y], [], cycle=20, index=0)]
    prog = program(code, layout, inputs=[((8, 8), f32)], outputs=[((8, 8), f32)])
    sim = Simulator(prog, check_schedule=False)
    data = rng.integers(-4, 5, (8, 8)).astype(np.float32)
    (got,) = sim.run([data])
    np.testing.assert_array_equal(got, data + np.frombuffer(layout.constants[0].data, np.float32))
    assert (_calls(sim)[Opcode.ADD], _calls(sim)[Opcode.NEG]) == (1, 2)


@pytest.mark.parametrize("other_in_destination", [False, True], ids=["apart", "other-input-in-destination"])
def test_an_elementwise_chain_runs_in_its_last_steps_destination(rng, numpy_steps, other_in_destination):
    """y = (x + c) · z through a stream. Apart, the ADD writes y and the MUL multiplies there, in place. With z
    lying in y (the MUL writes over the operand it reads), the ADD may not write y first, or the MUL would
    read the sum where z was. The values are numpy's either way."""
    from lpx_tvm.runtime_sim import DType, Simulator, Space, TensorRef
    from programs import Layout, ins, program

    f32 = DType.F32
    layout = Layout()
    c = layout.const(rng.integers(-2, 3, (4, 8)).astype(np.float32))
    x, y = layout.take((4, 8), f32), layout.take((4, 8), f32)
    z = y if other_in_destination else layout.take((4, 8), f32)
    stream = TensorRef(0, (4, 8), f32, None, Space.STREAM)
    code = [ins("LOAD", [], [x], cycle=0, index=0), ins("LOAD", [], [z], cycle=1, index=1),
            ins("ADD", [x, c], [stream], cycle=10), ins("MUL", [stream, z], [y], cycle=11),
            ins("STORE", [y], [], cycle=20, index=0)]
    prog = program(code, layout, inputs=[((4, 8), f32)] * 2, outputs=[((4, 8), f32)])
    data, other = (rng.integers(-4, 5, (4, 8)).astype(np.float32) for _ in range(2))
    with _recording(Opcode.MUL, _in_place) as in_place:
        (got,) = Simulator(prog, check_schedule=False).run([data, other])
    np.testing.assert_array_equal(got, (data + np.frombuffer(layout.constants[0].data, np.float32).reshape(4, 8))
                                  * other)
    assert in_place == [not other_in_destination]


def test_an_elementwise_step_writes_over_its_own_input_in_its_chains_destination(rng, numpy_steps):
    """y = relu(x + y), a residual's shape: the ADD reads y and the RELU writes it. numpy reads each element of
    the ADD's operands before it writes that element, so the ADD may write y and the RELU work there, in
    place. The values are numpy's."""
    from lpx_tvm.runtime_sim import DType, Simulator, Space, TensorRef
    from programs import Layout, ins, program

    f32 = DType.F32
    layout = Layout()
    x, y = layout.take((4, 8), f32), layout.take((4, 8), f32)
    stream = TensorRef(0, (4, 8), f32, None, Space.STREAM)
    code = [ins("LOAD", [], [x], cycle=0, index=0), ins("LOAD", [], [y], cycle=1, index=1),
            ins("ADD", [x, y], [stream], cycle=10), ins("RELU", [stream], [y], cycle=11),
            ins("STORE", [y], [], cycle=20, index=0)]
    prog = program(code, layout, inputs=[((4, 8), f32)] * 2, outputs=[((4, 8), f32)])
    data, other = (rng.integers(-4, 5, (4, 8)).astype(np.float32) for _ in range(2))
    with _recording(Opcode.RELU, _in_place) as in_place:
        (got,) = Simulator(prog, check_schedule=False).run([data, other])
    np.testing.assert_array_equal(got, np.maximum(data + other, 0))
    assert in_place == [True]


def test_a_product_joined_to_its_accumulators_producer_still_reads_its_own_tile(rng):
    """y = -(a @ W + (x + c)): the ADD streams into the MATMUL as its partial sum, and the next tile goes into
    the same weight buffer (from the same SRAM, reloaded) between the MATMUL and the NEG, and a product by it
    follows. The joined ADD and MATMUL may not move past that INSTALL: they must still multiply by W. The
    values are numpy's."""
    from lpx_tvm.runtime_sim import DType, Simulator, Space, TensorRef
    from programs import Layout, ins, program

    f32 = DType.F32
    layout = Layout()
    c = layout.const(rng.integers(-2, 3, (4, 8)).astype(np.float32))
    x, a, t, y = (layout.take(shape, f32) for shape in [(4, 8), (4, 8), (8, 8), (4, 8)])

    def stream(number):
        return TensorRef(number, (4, 8), f32, None, Space.STREAM)
    code = [ins("LOAD", [], [x], cycle=0, index=0), ins("LOAD", [], [a], cycle=1, index=1),
            ins("LOAD", [], [t], cycle=2, index=2), ins("INSTALL", [t], [], cycle=10, buffer=0),
            ins("LOAD", [], [t], cycle=11, index=3),  # the next tile's bytes, over W's while it is installed
            ins("ADD", [x, c], [stream(0)], cycle=20),
            ins("MATMUL", [a, stream(0)], [stream(1)], cycle=21, buffer=0),
            ins("INSTALL", [t], [], cycle=22, buffer=0),
            ins("NEG", [stream(1)], [y], cycle=23),
            ins("LOAD", [], [t], cycle=30, index=2), ins("MATMUL", [a], [x], cycle=31, buffer=0),  # the next tile's
            ins("STORE", [y], [], cycle=40, index=0)]
    prog = program(code, layout, inputs=[((4, 8), f32), ((4, 8), f32), ((8, 8), f32), ((8, 8), f32)],
                   outputs=[((4, 8), f32)])
    data, rows, w, other = (rng.integers(-3, 4, shape).astype(np.float32)
                            for shape in [(4, 8), (4, 8), (8, 8), (8, 8)])
    (got,) = Simulator(prog, check_schedule=False).run([data, rows, w, other])
    bias = np.frombuffer(layout.constants[0].data, np.float32).reshape(4, 8)
    np.testing.assert_array_equal(got, -(rows @ w + (data + bias)))
