"""The program format: exact round trip, one line per instruction, clear errors on damage."""

import numpy as np
import pytest

import lpx_tvm
from lpx_tvm.runtime_sim import ProgramFormatError, decode, disassemble, encode, load_config
from conftest import assert_close, cnn_model, ort_run
from programs import program


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


@pytest.mark.slow
def test_streamed_weights_round_trip_and_are_checked(rng):
    import dataclasses

    from onnx import helper

    from conftest import make_model, tensor_info, weights
    from lpx_tvm.runtime_sim import Opcode, validate

    # a 4.4 MB weight is more than the tiny chip's 4 MiB of SRAM: it is streamed, not resident
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["y"])], [tensor_info("x", [1, 1088])],
                       [tensor_info("y", [1, 1024])], [weights(rng, "w", (1088, 1024), 0.05)])
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


def _loaded(made):
    from lpx_tvm.runtime_sim import Simulator

    return Simulator(made)


def _wrong_parts():
    """Ways to make a program of the wrong parts: ``name -> (make(copy, made), error, message)``."""
    import dataclasses
    from lpx_tvm.runtime_sim import DType, Instruction, TensorRef
    from lpx_tvm.runtime_sim.isa import HostTensor
    from lpx_tvm.runtime_sim.program import Constant

    def program_with(**parts):
        return lambda copy, made: dataclasses.replace(made, **parts)

    def instruction_with(**parts):
        return lambda copy, made: dataclasses.replace(copy, **parts)
    return {
        "instructions None": (program_with(instructions=None), TypeError,
                              r"Program.instructions must be a tuple of Instruction, got None"),
        "instructions a string": (program_with(instructions="two"), TypeError,
                                  r"Program.instructions must be a tuple of Instruction, got 'two'"),
        "an instruction None": (lambda copy, made: dataclasses.replace(made, instructions=(copy, None)), TypeError,
                                r"Program.instructions must be a tuple of Instruction, got None at 1"),
        "a constant 3": (program_with(constants=[3]), TypeError,
                         r"Program.constants must be a tuple of Constant, got 3 at 0"),
        "state of None": (program_with(state=[(0, None)]), TypeError,
                          r"Program.state must be a tuple of \(input index, TensorRef\), got \(0, None\) at 0"),
        "layer names None": (program_with(layer_names=None), TypeError,
                             r"Program.layer_names must be a tuple of str, got None"),
        "plan a string": (program_with(plan="x"), TypeError, r"Program.plan must be a SramPlan, got 'x'"),
        "digest a string": (program_with(config_digest="ab"), TypeError,
                            r"Program.config_digest must be bytes, got 'ab'"),
        "srcs None": (instruction_with(srcs=None), TypeError, r"COPY: srcs must be a tuple of TensorRef, got None"),
        "dsts of a string": (instruction_with(dsts=["x"]), TypeError,
                             r"COPY: dsts must be a tuple of TensorRef, got \['x'\]"),
        "opcode 999": (lambda copy, made: Instruction(999, 0, 0, copy.srcs, copy.dsts), TypeError,
                       r"Instruction.opcode must be one of Opcode's members, got 999"),
        "dtype a string": (lambda copy, made: TensorRef(4096, (4,), "fp32"), TypeError,
                           r"TensorRef.dtype must be one of DType's members, got 'fp32'"),
        "space 7": (lambda copy, made: TensorRef(4096, (4,), DType.F32, space=7), TypeError,
                    r"TensorRef.space must be one of Space's members, got 7"),
        "host shape a string": (lambda copy, made: HostTensor("ab", DType.F32), TypeError,
                                r"HostTensor.shape must be a tuple of non-negative integers, got 'ab'"),
        "constant data a list": (lambda copy, made: _loaded(dataclasses.replace(
            made, constants=(Constant(made.constants[0].ref, [1, 2]),))), ProgramFormatError,
            r"constant fp32\[4\]@0x0: its data must be an array of its 16 bytes, got a list"),
        "constant data short": (lambda copy, made: _loaded(dataclasses.replace(
            made, constants=(Constant(made.constants[0].ref, np.zeros(3, np.uint8)),))), ProgramFormatError,
            r"constant fp32\[4\]@0x0: its data must be an array of its 16 bytes, got 3 bytes"),
    }


@pytest.mark.parametrize("case", list(_wrong_parts()))
def test_a_hand_made_program_of_the_wrong_parts_is_named_as_it_is_made(case):
    """What the checks and the simulator read as tuples of instructions and operands, enum members and
    arrays of the right size is one, or the program is not made or not loaded (each of these failed deep
    inside the simulator: an AttributeError, a KeyError, a TypeError on ``+``, numpy's ValueError; a space of
    7 was taken for a stream). Lists are taken as tuples, an enum's number as its member."""
    import dataclasses
    from programs import Layout, ins
    from lpx_tvm.runtime_sim import DType, Simulator, Space, TensorRef

    layout = Layout()
    copy = ins("COPY", [layout.const(np.ones(4, np.float32))], [TensorRef(4096, (4,), DType.F32)])
    tiny = load_config("tiny")  # 4 fp32 elements are one vector of 32 lanes: a cycle, then the VXM latency
    made = program([copy], layout, predicted=1 + tiny.latency_cycles["VXM"])
    as_lists = dataclasses.replace(made, instructions=[dataclasses.replace(copy, srcs=list(copy.srcs))])
    assert isinstance(as_lists.instructions, tuple) and as_lists.instructions[0].srcs == copy.srcs
    assert Simulator(as_lists, timing_only=True).stats.cycles == 1 + tiny.latency_cycles["VXM"] == 5
    by_number = TensorRef(4096, (4,), int(DType.F32), space=int(Space.SRAM))
    assert (type(by_number.dtype), type(by_number.space)) == (DType, Space) and by_number == copy.dsts[0]
    make, error, message = _wrong_parts()[case]
    with pytest.raises(error, match=message):
        make(copy, made)


@pytest.mark.parametrize("converted, message", [
    ((0, 0.5, 0), "host-converted input 0 is fp32, not int8/uint8/fp16/bf16"),
    ((3, 0.5, 0), "host-converted input 3 is not an input of the program"),
])
def test_a_host_converted_input_must_be_a_narrow_input_of_the_program(blob, converted, message):
    import dataclasses

    from lpx_tvm.runtime_sim import validate

    with pytest.raises(ProgramFormatError, match=message):
        validate(dataclasses.replace(decode(blob), host_converted=(converted,)))


def test_a_widened_output_must_be_a_narrow_output_of_the_program(blob):
    import dataclasses

    from lpx_tvm.runtime_sim import validate

    with pytest.raises(ProgramFormatError, match="widened output 0 is fp32, not int8/uint8/fp16/bf16"):
        validate(dataclasses.replace(decode(blob), widened_outputs=((0, 1.0, 0),)))


def test_a_derived_chips_program_carries_the_chip_and_runs_with_no_name_to_look_up(rng):
    """A design variant is in no registry: its program carries the chip's parameters, decodes to that chip and
    runs; its name alone does not load."""
    from dataclasses import replace

    from lpx_tvm.runtime_sim import Simulator, derive_config
    from lpx_tvm.runtime_sim.config import ConfigError

    chip = derive_config("tiny", {"sram_bytes": 3 << 20})
    compiled = lpx_tvm.compile(cnn_model(), target=lpx_tvm.codegen.Target.parse(chip))
    (blob,) = compiled.programs.values()
    program = decode(blob)
    assert (program.chip.name, program.chip.digest, program.chip.sram_bytes) == (chip.name, chip.digest, 3 << 20)
    with pytest.raises(ConfigError):
        load_config(chip.name)
    x = rng.standard_normal((1, 3, 32, 32)).astype(np.float32)
    sim = Simulator(program)
    out = np.zeros(program.outputs[0].shape, np.float32)
    sim.run([x], [out])
    assert_close(out, ort_run(cnn_model(), {"x": x})[0], 1e-4)
    # parameters that are not the chip its name and digest say are refused, naming both
    other = replace(program, chip=derive_config("tiny", {"sram_bytes": 2 << 20}))
    with pytest.raises(ProgramFormatError, match=r"chip parameters describe 'tiny\[sram_bytes=2097152\]'"):
        decode(encode(other))


def test_chip_parameters_spelled_otherwise_are_refused_so_a_program_reads_back_as_its_bytes(blob):
    """The same values with other spacing would decode to the same chip but encode to other bytes (found by the
    re-signed damage property test): the format takes its own spelling only."""
    import hashlib
    import struct

    from lpx_tvm.runtime_sim.container import HEADER
    from lpx_tvm.runtime_sim.program import MAGIC, VERSION

    body = bytearray(bytes(blob)[HEADER.size:])
    at = body.index(b'"lanes": ') + len(b'"lanes":')
    body[at] = ord("\t")  # JSON reads a tab as it reads a space
    digest = hashlib.blake2b(bytes(body), digest_size=16, person=struct.pack("<H", VERSION)).digest()
    with pytest.raises(ProgramFormatError, match="chip parameters are not written as the format writes them"):
        decode(HEADER.pack(MAGIC, VERSION, 0, len(body), digest) + bytes(body))

