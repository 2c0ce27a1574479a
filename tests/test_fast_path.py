"""The simulator's fast path (the tiles of one product in one call) against the tile-by-tile reference.

With integer-valued weights and inputs every fp32 sum here is exact (below 2**24), so the order a product
adds in cannot change a result, and the fast path must be bit-equal to the reference in every float
storage type, not merely close. The zoo's records check every model the same way (``fast_bit_equal``,
``fast_max_diff``); ``scripts/fast_path.py`` sweeps every zoo model and dtype.
"""

from collections import Counter

import numpy as np
import pytest
from onnx import helper, numpy_helper

import lpx_tvm
from lpx_tvm.app.zoo import ZOO, run_model
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


@pytest.mark.parametrize("name, dtype", [("squeezenet", "int8"), ("bert_encoder", "int8"), ("shufflenet", "fp32")])
def test_zoo_records_carry_the_fast_path_check(name, dtype):
    """The zoo runs every model twice, fast and tile by tile: int8 must be bit-equal."""
    record = run_model(ZOO[name], config="tsp", llvm=False, repeat=1, dtype=dtype)
    if dtype == "int8":
        assert record["fast_bit_equal"] and record["fast_max_diff"] == 0.0
    else:  # fp32: the order a BLAS kernel adds in moves the last bits only
        assert record["fast_max_diff"] <= 1e-4
