"""Emission (``codegen/emit.py``): ``resolve`` turns tile ops into instructions whose operands are SRAM
addresses (a tensor's address plus the view's byte offset, its base's dtype, the view's strides) or stream
numbers, with a layer-name table; ``emit`` assembles the Program: constants where alloc placed them, the host
signature, the schedule. Addresses here are chosen by hand, so every expected address is exact."""

import numpy as np

from lpx_tvm.codegen import Target, compile_graph
from lpx_tvm.codegen.emit import emit, resolve
from lpx_tvm.codegen.graph import Graph
from lpx_tvm.codegen.tile import TileOp
from lpx_tvm.codegen.views import stream, view, whole
from lpx_tvm.runtime_sim import DType, Instruction, Opcode, Simulator, Space, TensorRef, load_config
from lpx_tvm.runtime_sim.isa import HostTensor

TINY = load_config("tiny")


def _erf_mul_graph():
    """x [2, 32] fp32 ─► ERF ─► (stream) ─► MUL by x ─► y, and a constant w [32] beside them."""
    g = Graph()
    x = g.add_tensor((2, 32), "float32")
    w = g.constant(np.arange(32, dtype=np.float32))
    e = g.add_node("ERF", [x], (2, 32), "float32", "f/erf_1")
    y = g.add_node("MUL", [e, x], (2, 32), "float32", "f/multiply_2")
    g.inputs, g.outputs = [x], [y]
    return g, x, w, y


def test_resolve_adds_each_views_byte_offset_to_its_tensors_address_and_keeps_its_strides():
    g = Graph()
    a = g.add_tensor((4, 6), "float16")
    a_flat = g.add_tensor((24,), "float16", alias_of=a)
    out = g.add_tensor((2, 3), "float16")
    block = view(g, a, ranges=[(1, 3), (2, 5)])  # (1 · 6 + 2) · 2 = 16 bytes in, row stride 6
    ops = [TileOp(Opcode.COPY, [block], [whole(g, out)], {}, "f/copy_1"),
           TileOp(Opcode.COPY, [view(g, a_flat, ranges=[(4, 10)])], [view(g, out, (6,))], {}, "f/copy_2")]
    (first, second), layers, fixed = resolve(g, ops, {a: 0x1000, out: 0x2000})
    assert first.srcs == (TensorRef(0x1000 + 16, (2, 3), DType.F16, (6, 1)),)
    assert first.dsts == (TensorRef(0x2000, (2, 3), DType.F16),)
    # an alias resolves to its base's address: element 4 of the flat view is byte 8
    assert second.srcs == (TensorRef(0x1000 + 8, (6,), DType.F16),)
    assert (layers, fixed, [first.layer, second.layer]) == (("f/copy_1", "f/copy_2"), set(), [0, 1])


def test_resolve_names_a_chained_operand_by_its_chain_as_a_stream():
    g, x, w, y = _erf_mul_graph()
    chain = stream(5, (2, 32), np.float32)
    ops = [TileOp(Opcode.ERF, [whole(g, x)], [chain], {}, "f/erf_1"),
           TileOp(Opcode.MUL, [chain, whole(g, x)], [whole(g, y)], {}, "f/multiply_2")]
    (erf, mul), _, _ = resolve(g, ops, {x: 0, y: 256})
    on_stream = TensorRef(5, (2, 32), DType.F32, None, Space.STREAM)
    assert (erf.dsts, mul.srcs) == ((on_stream,), (on_stream, TensorRef(0, (2, 32), DType.F32)))
    assert mul.dsts == (TensorRef(256, (2, 32), DType.F32),)


def test_resolve_keeps_the_tilers_planes_and_shares_one_layer_name_among_its_instructions():
    """A MATMUL's plane is the tiler's (unit index fixed); everything else is the scheduler's to choose (0 for
    now). Instructions of one layer share its index; the table is in first-seen order."""
    g = Graph()
    a, b = g.add_tensor((4, 32), "float32"), g.constant(np.ones((32, 32), np.float32))
    ops = [TileOp(Opcode.LOAD, [], [whole(g, a)], {"index": 0}, "load"),
           TileOp(Opcode.INSTALL, [whole(g, b)], [], {"buffer": 1}, "f/matmul_1", 1),
           TileOp(Opcode.MATMUL, [whole(g, a)], [stream(1, (4, 32), np.float32)], {"buffer": 1}, "f/matmul_1", 1),
           TileOp(Opcode.EPILOGUE, [stream(1, (4, 32), np.float32)], [whole(g, a)], {}, "f/matmul_1")]
    instructions, layers, fixed = resolve(g, ops, {a: 0, b: 512})
    assert layers == ("load", "f/matmul_1")
    assert [(i.opcode, i.unit_index, i.layer, i.cycle) for i in instructions] == [
        (Opcode.LOAD, 0, 0, 0), (Opcode.INSTALL, 1, 1, 0), (Opcode.MATMUL, 1, 1, 0), (Opcode.EPILOGUE, 0, 1, 0)]
    assert fixed == {1, 2}
    # attributes come out complete: the op table's defaults filled in
    assert dict(instructions[2].attrs) == {"buffer": 1, "zp_a": 0, "zp_b": 0}


def test_emit_places_the_constants_where_alloc_put_them_and_only_the_constants():
    g, x, w, y = _erf_mul_graph()
    program = emit(g, {x: 0, w: 0x400, y: 0x100, "high_water": 0x480}, [], ("f",), 0, TINY)
    (const,) = program.constants  # x and y are activations; "high_water" is no tensor
    assert const.ref == TensorRef(0x400, (32,), DType.F32)
    assert const.data is g.tensors[w].data  # the weight itself: encode writes its bytes


def test_emit_writes_the_host_signature_the_makespan_and_the_chip():
    g, x, w, y = _erf_mul_graph()
    g.host_dtype = {x: np.dtype(np.float16)}  # the host passes x as fp16
    ins = Instruction(Opcode.NOP, 0, 0, attrs={"cycles": 3})
    program = emit(g, {x: 0, w: 0x400, y: 0x100, "high_water": 0x480}, [ins], ("f",), 42, TINY)
    assert (program.inputs, program.outputs) == ((HostTensor((2, 32), DType.F16),), (HostTensor((2, 32), DType.F32),))
    assert (program.instructions, program.layer_names, program.predicted_cycles) == ((ins,), ("f",), 42)
    assert (program.config_name, program.config_digest) == ("tiny", TINY.digest)
    assert (program.state, program.host_converted, program.widened_outputs, program.streamed) == ((), (), (), ())


def test_emit_records_resident_state_and_the_hosts_conversions_by_position():
    """Input 1 is a KV cache resident at 0x800; input 0 is quantised on the host (scale 0.5, zero point 3);
    output 0 is widened from int8 (0.25, -1)."""
    g = Graph()
    q = g.add_tensor((2, 32), "int8")
    cache = g.add_tensor((4, 32), "float32")
    out = g.add_tensor((2, 32), "int8")
    g.inputs, g.outputs, g.state = [q, cache], [out], {cache}
    g.host_converted, g.widened = {q: (0.5, 3)}, {out: (0.25, -1)}
    program = emit(g, {q: 0, cache: 0x800, out: 0x100, "high_water": 0xA00}, [], ("f",), 0, TINY)
    assert program.state == ((1, TensorRef(0x800, (4, 32), DType.F32)),)
    assert (program.host_converted, program.widened_outputs) == (((0, 0.5, 3),), ((0, 0.25, -1),))
    assert program.inputs == (HostTensor((2, 32), DType.I8), HostTensor((4, 32), DType.F32))


def test_a_tiny_graph_compiles_to_load_erf_mul_store_with_the_operands_linked(rng):
    """Through every stage from fuse on: LOAD x, ERF into a stream, MUL of that stream by x, STORE; each reads
    what the one before wrote, and the simulator's result is numpy's."""
    from math import erf

    g, x, w, y = _erf_mul_graph()
    program = compile_graph(g, Target.parse(config="tiny"))
    load, erf_ins, mul, store = program.instructions
    assert [i.opcode for i in program.instructions] == [Opcode.LOAD, Opcode.ERF, Opcode.MUL, Opcode.STORE]
    assert erf_ins.srcs == load.dsts
    assert erf_ins.dsts[0].space == Space.STREAM
    assert mul.srcs == (erf_ins.dsts[0], load.dsts[0])
    assert store.srcs == mul.dsts
    assert (dict(load.attrs), dict(store.attrs)) == ({"index": 0, "offset": 0}, {"index": 0, "offset": 0})
    assert program.constants == ()  # w is read by nothing, so alloc placed nothing for it
    data = rng.standard_normal((2, 32)).astype(np.float32)
    sim = Simulator(program)
    (out,) = sim.run([data])
    expected = np.vectorize(erf)(data.astype(np.float64)) * data
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


def test_a_matmul_compiles_with_its_weight_and_folded_bias_as_the_programs_constants(rng):
    """relu(x [4, 32] @ w [32, 32] + b): one array tile (K = N = 32), so LOAD, INSTALL, MATMUL, EPILOGUE, STORE.
    The INSTALL reads w where its constant lies, the EPILOGUE reads the folded bias as a [1, 32] row."""
    g = Graph()
    x = g.add_tensor((4, 32), "float32")
    w, b = rng.standard_normal((32, 32)).astype(np.float32), rng.standard_normal(32).astype(np.float32)
    mm = g.add_node("matmul", [x, g.constant(w)], (4, 32), "float32", "f/matmul_1", act=Opcode.NOP,
                    act_args=(0.0, 0.0))
    added = g.add_node("ADD", [mm, g.constant(b)], (4, 32), "float32", "f/add_2")
    g.inputs, g.outputs = [x], [g.add_node("RELU", [added], (4, 32), "float32", "f/relu_3")]
    program = compile_graph(g, Target.parse(config="tiny"))
    assert [i.opcode for i in program.instructions] == [Opcode.LOAD, Opcode.INSTALL, Opcode.MATMUL,
                                                        Opcode.EPILOGUE, Opcode.STORE]
    consts = {c.ref.shape: c for c in program.constants}
    assert sorted(consts) == [(32,), (32, 32)]
    np.testing.assert_array_equal(consts[(32, 32)].data, w)
    np.testing.assert_array_equal(consts[(32,)].data.reshape(-1), b)
    _, install, matmul, epilogue, _ = program.instructions
    assert install.srcs == (consts[(32, 32)].ref,)
    assert epilogue.srcs[1] == TensorRef(consts[(32,)].ref.addr, (1, 32), DType.F32)
    assert (dict(epilogue.attrs)["act"], program.layer_names) == (
        Opcode.RELU, ("load input 0 [4, 32]", "f/matmul_1+add_2+relu_3", "store output 0 [4, 32]"))
    data = rng.standard_normal((4, 32)).astype(np.float32)
    (out,) = Simulator(program).run([data])
    np.testing.assert_allclose(out, np.maximum(data @ w + b, 0), rtol=1e-5, atol=1e-5)


def test_attention_scores_read_the_keys_transposed_in_place(rng):
    """q [2, 5, 40] @ transpose(k [2, 70, 40], last two axes): the keys' TRANSPOSE is read by that product alone,
    so the planes install K^T's tiles from k itself and no TRANSPOSE instruction is made. On tiny (32 × 32
    arrays): K = 40 is 2 row tiles, N = 70 is 3 column tiles, 2 heads: 12 INSTALLs. A TRANSPOSE that another op
    also reads stays."""
    g = Graph()
    q, k = g.add_tensor((2, 5, 40), "float32"), g.add_tensor((2, 70, 40), "float32")
    kt = g.add_node("TRANSPOSE", [k], (2, 40, 70), "float32", "f/transpose_1", perm=(0, 2, 1))
    scores = g.add_node("matmul", [q, kt], (2, 5, 70), "float32", "f/matmul_2", act=Opcode.NOP, act_args=(0.0, 0.0))
    g.inputs, g.outputs = [q, k], [scores]
    program = compile_graph(g, Target.parse(config="tiny"))
    opcodes = [i.opcode for i in program.instructions]
    assert Opcode.TRANSPOSE not in opcodes and opcodes.count(Opcode.INSTALL) == 2 * 2 * 3
    qd, kd = rng.standard_normal((2, 5, 40)).astype(np.float32), rng.standard_normal((2, 70, 40)).astype(np.float32)
    (out,) = Simulator(program).run([qd, kd])
    np.testing.assert_allclose(out, qd @ kd.transpose(0, 2, 1), rtol=1e-5, atol=1e-5)
    g.outputs = [scores, kt]  # the transpose is an output too: it is made
    program = compile_graph(g, Target.parse(config="tiny"))
    assert [i.opcode for i in program.instructions].count(Opcode.TRANSPOSE) == 1
    out, made = Simulator(program).run([qd, kd])
    np.testing.assert_allclose(out, qd @ kd.transpose(0, 2, 1), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(made, kd.transpose(0, 2, 1))
