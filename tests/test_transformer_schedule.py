"""A transformer block's schedule, worked by hand on the tiny preset (32 lanes, 2 planes of 32×32, fp32 in 12
passes, 2 install streams, 8 streams a direction, stream hops 4, latencies MEM 4 / MXM 8 / VXM 4, host link
10 bytes a cycle): products of one input side by side, and a softmax chained from its product."""

from math import ceil

import numpy as np
from onnx import helper

import lpx_tvm
from conftest import make_model, ort_run, run_on_lpx, tensor_info, weights
from lpx_tvm.runtime_sim import Opcode, Simulator, Space, decode, load_config

CHIP = load_config("tiny")
ROWS, WIDTH = 2, 32  # x is [2, 32] fp32: 256 bytes


def _terms():
    """The figures every program below shares, from the preset."""
    load = ceil(ROWS * WIDTH * 4 / CHIP.host_bytes_per_cycle)  # 26 cycles on the host link
    install = ceil(WIDTH * WIDTH * 4 / (CHIP.mxm_install_streams * CHIP.lanes))  # a 32×32 fp32 tile: 64
    matmul = ROWS * CHIP.mxm_passes["fp32"]  # 2 rows, 12 passes each: 24
    return load, install, matmul, CHIP.latency_cycles


def _program(model):
    compiled = lpx_tvm.compile(model, config="tiny")
    (blob,) = compiled.programs.values()
    return compiled, decode(blob)


def test_two_products_of_one_input_run_side_by_side_on_two_planes(rng):
    """x @ W1 + x @ W2: each plane installs one weight (not both, as a split of the 2 rows would) and both
    products start at once when their tiles are in. The epilogues stream at the products' pace; the ADD's
    2 vectors each carry 3 fp32 operands (12 byte streams against 8 a direction: 2 cycles a vector)."""
    model = make_model([helper.make_node("MatMul", ["x", "w1"], ["y1"]),
                        helper.make_node("MatMul", ["x", "w2"], ["y2"]),
                        helper.make_node("Add", ["y1", "y2"], ["y"])],
                       [tensor_info("x", [ROWS, WIDTH])], [tensor_info("y", [ROWS, WIDTH])],
                       [weights(rng, "w1", (WIDTH, WIDTH)), weights(rng, "w2", (WIDTH, WIDTH))])
    compiled, program = _program(model)
    load, install, matmul, latency = _terms()
    ready = install + CHIP.stream_hops  # 68: the tiles, installed while x crosses the link (load + 4 = 30)
    add = ceil(ROWS * WIDTH / CHIP.lanes) * ceil(3 * 4 / CHIP.streams_per_direction)
    expected = ready + latency["MXM"] + matmul + latency["VXM"] + add + latency["VXM"] + load + latency["MEM"]
    assert Simulator(program, timing_only=True).stats.cycles == expected == 142
    installs = [i for i in program.instructions if i.opcode == Opcode.INSTALL]
    products = [i for i in program.instructions if i.opcode == Opcode.MATMUL]
    assert len(installs) == 2 and sorted(i.unit_index for i in products) == [0, 1]
    assert {i.cycle for i in products} == {ready}
    x = rng.standard_normal((ROWS, WIDTH)).astype(np.float32)
    (out,) = run_on_lpx(compiled, [x])
    np.testing.assert_allclose(out, ort_run(model, {"x": x})[0], rtol=1e-5, atol=1e-5)


def test_a_softmax_runs_chained_from_its_product_without_a_round_trip_through_sram(rng):
    """softmax(x @ W): the epilogue hands its rows on in a stream, and the softmax runs on a second vector
    unit at the product's pace, VXM latency behind it. Unchained it would start when the epilogue's result
    is in SRAM (68 + 8 + 24 + 4 = 104) and end 4 + 4 later: 142 cycles, not 138."""
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["s"]),
                        helper.make_node("Softmax", ["s"], ["y"], axis=-1)],
                       [tensor_info("x", [ROWS, WIDTH])], [tensor_info("y", [ROWS, WIDTH])],
                       [weights(rng, "w", (WIDTH, WIDTH))])
    compiled, program = _program(model)
    load, install, matmul, latency = _terms()
    ready = install + CHIP.stream_hops
    expected = ready + latency["MXM"] + latency["VXM"] + matmul + latency["VXM"] + load + latency["MEM"]
    assert Simulator(program, timing_only=True).stats.cycles == expected == 138
    (softmax,) = [i for i in program.instructions if i.opcode == Opcode.SOFTMAX]
    (epilogue,) = [i for i in program.instructions if i.opcode == Opcode.EPILOGUE]
    assert softmax.srcs[0].space == Space.STREAM and epilogue.dsts[0].space == Space.STREAM
    assert softmax.cycle == ready + latency["MXM"] + latency["VXM"] and softmax.unit_index != epilogue.unit_index
    x = rng.standard_normal((ROWS, WIDTH)).astype(np.float32)
    (out,) = run_on_lpx(compiled, [x])
    np.testing.assert_allclose(out, ort_run(model, {"x": x})[0], rtol=1e-5, atol=1e-6)


def test_attention_scores_take_their_scale_in_the_epilogue_and_feed_a_chained_softmax(rng):
    """softmax(q @ kᵀ / 8): a product of two activations has no weight to fold 1/8 into; the epilogue takes
    it as its fp32 scale operand (so no DIV pass over the scores), and the softmax chains from it."""
    model = make_model([helper.make_node("Transpose", ["k"], ["kt"], perm=[1, 0]),
                        helper.make_node("MatMul", ["q", "kt"], ["s"]),
                        helper.make_node("Div", ["s", "d"], ["scaled"]),
                        helper.make_node("Softmax", ["scaled"], ["y"], axis=-1)],
                       [tensor_info("q", [ROWS, WIDTH]), tensor_info("k", [WIDTH, WIDTH])],
                       [tensor_info("y", [ROWS, WIDTH])],
                       [helper.make_tensor("d", 1, [], [8.0])])
    compiled, program = _program(model)
    (epilogue,) = [i for i in program.instructions if i.opcode == Opcode.EPILOGUE]
    assert len(epilogue.srcs) == 3 and not any(i.opcode == Opcode.DIV for i in program.instructions)
    scale = next(c for c in program.constants if c.ref.addr == epilogue.srcs[2].addr)
    np.testing.assert_array_equal(scale.data.view(np.float32), np.full(WIDTH, 0.125, np.float32))
    (softmax,) = [i for i in program.instructions if i.opcode == Opcode.SOFTMAX]
    assert softmax.srcs[0].space == Space.STREAM
    q = rng.standard_normal((ROWS, WIDTH)).astype(np.float32)
    k = rng.standard_normal((WIDTH, WIDTH)).astype(np.float32)
    (out,) = run_on_lpx(compiled, [q, k])
    np.testing.assert_allclose(out, ort_run(model, {"q": q, "k": k})[0], rtol=1e-5, atol=1e-6)
