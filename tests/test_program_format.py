"""The program format: exact round trip, one line per instruction, clear errors on damage."""

import numpy as np
import pytest

import lpx_tvm
from lpx_tvm.runtime_sim import ProgramFormatError, decode, disassemble, encode, load_config
from conftest import cnn_model


@pytest.fixture(scope="module")
def blob():
    compiled = lpx_tvm.compile(cnn_model(), config="tiny")
    (program,) = compiled.programs.values()
    return program


def test_encode_decode_is_exact(blob):
    program = decode(blob)
    assert encode(program) == blob
    again = decode(encode(program))
    assert again.instructions == program.instructions
    assert [c.ref for c in again.constants] == [c.ref for c in program.constants]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(again.constants, program.constants))


def test_disassembler_prints_every_instruction_on_one_line(blob):
    program = decode(blob)
    lines = [line for line in disassemble(program).splitlines() if not line.startswith(";")]
    assert len(lines) == len(program.instructions)
    for line, ins in zip(lines, program.instructions):
        assert ins.opcode.name in line and f"@{ins.cycle}" in line


@pytest.mark.parametrize("cut", [0, 10, 39, 100, -1])
def test_truncated_program_raises_format_error(blob, cut):
    with pytest.raises(ProgramFormatError):
        decode(blob[:cut])


def test_bit_flips_raise_format_error(blob):
    rng = np.random.default_rng(0)
    for position in rng.integers(0, len(blob), 50):
        damaged = bytearray(blob)
        damaged[position] ^= 1 << int(rng.integers(0, 8))
        with pytest.raises(ProgramFormatError):
            decode(bytes(damaged))


def test_program_for_another_chip_is_rejected(blob):
    with pytest.raises(ProgramFormatError, match="compiled for chip config 'tiny'"):
        decode(blob, load_config("tsp"))


def test_not_a_program():
    with pytest.raises(ProgramFormatError, match="bad magic"):
        decode(b"\x7fELF" + bytes(100))


def test_streamed_weights_round_trip_and_are_checked(rng):
    import dataclasses

    from onnx import helper

    from conftest import make_model, tensor_info, weights
    from lpx_tvm.runtime_sim import Opcode, validate

    # a 2.5 MB weight is more than half of the tiny chip's 4 MiB SRAM: it is streamed, not resident
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["y"])], [tensor_info("x", [1, 640])],
                       [tensor_info("y", [1, 1024])], [weights(rng, "w", (640, 1024), 0.05)])
    (blob,) = lpx_tvm.compile(model, config="tiny").programs.values()
    program = decode(blob)
    assert program.streamed and any(i.opcode == Opcode.STREAM for i in program.instructions)
    assert encode(program) == blob
    assert "streamed weights" in disassemble(program).splitlines()[0]
    with pytest.raises(ProgramFormatError, match="STREAM.*host tensor"):
        validate(dataclasses.replace(program, streamed=program.streamed[:-1]))


def test_int8_zero_points_outside_the_int8_range_are_rejected():
    import dataclasses

    from lpx_tvm.runtime_sim import DType, Instruction, Opcode, Program, TensorRef, validate

    chip = load_config("tiny")
    x = TensorRef(0, (4, 8), DType.F32)
    q = TensorRef(256, (4, 8), DType.I8)
    ok = Instruction(Opcode.QUANTIZE, 0, 0, (x,), (q,), {"scale": 0.5, "zero_point": 3})
    program = Program("tiny", chip.digest, (ok,))
    validate(program)
    for zero_point in (10**300, -129, 128):
        broken = Instruction(Opcode.QUANTIZE, 0, 0, (x,), (q,), {"scale": 0.5, "zero_point": zero_point})
        with pytest.raises(ProgramFormatError, match="QUANTIZE zero point"):
            validate(dataclasses.replace(program, instructions=(broken,)))
    with pytest.raises(ValueError, match="QUANTIZE.zero_point must be an integer"):
        Instruction(Opcode.QUANTIZE, 0, 0, (x,), (q,), {"scale": 0.5, "zero_point": 2.5})


@pytest.mark.parametrize("part, value, message", [
    ("instructions", None, r"Program.instructions must be a tuple of Instruction, got None"),
    ("instructions", "two", r"Program.instructions must be a tuple of Instruction, got 'two'"),
    ("one more instruction", None, r"Program.instructions must be a tuple of Instruction, got None at 1"),
    ("constants", [3], r"Program.constants must be a tuple of Constant, got 3 at 0"),
    ("srcs", None, r"COPY: srcs must be a tuple of TensorRef, got None"),
    ("dsts", ["x"], r"COPY: dsts must be a tuple of TensorRef, got \['x'\]"),
])
def test_a_hand_made_program_of_the_wrong_parts_is_named_as_it_is_made(part, value, message):
    """What the checks and the simulator read as tuples of instructions and operands is one, or the program
    is not made (these failed deep inside the simulator, an AttributeError or a TypeError on ``+``). Lists are
    taken as tuples."""
    import dataclasses
    from programs import Layout, ins, program
    from lpx_tvm.runtime_sim import DType, Simulator, TensorRef

    layout = Layout()
    copy = ins("COPY", [layout.const(np.ones(4, np.float32))], [TensorRef(4096, (4,), DType.F32)])
    made = program([copy], layout, predicted=5)
    as_lists = dataclasses.replace(made, instructions=[dataclasses.replace(copy, srcs=list(copy.srcs))])
    assert isinstance(as_lists.instructions, tuple) and as_lists.instructions[0].srcs == copy.srcs
    assert Simulator(as_lists, timing_only=True).stats.cycles == made.predicted_cycles
    with pytest.raises(TypeError, match=message):
        if part in ("srcs", "dsts"):
            dataclasses.replace(copy, **{part: value})
        else:
            dataclasses.replace(made, **({part: value} if part != "one more instruction"
                                         else {"instructions": (copy, value)}))
