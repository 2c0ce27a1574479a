"""The op table is the one definition: everything derives from it and is checked against it."""

from pathlib import Path

import pytest

from lpx_tvm.runtime_sim import OP_TABLE, DType, Opcode, ProgramFormatError, decode, disassemble, encode
from lpx_tvm.runtime_sim.isa import (EPILOGUE_OPS, UNIT_OF, Group, Unit, isa_reference, make_attrs, ops_in, pack_attrs,
                                     unpack_attrs)
from lpx_tvm.runtime_sim.semantics import SEMANTICS
from lpx_tvm.runtime_sim.shapes import RULES
from lpx_tvm.runtime_sim.timing import RULES as TIMING_RULES
from programs import Layout, ins, program

ROOT = Path(__file__).resolve().parents[1]


def test_every_opcode_has_a_row_semantics_an_operand_rule_and_a_timing_rule():
    assert set(OP_TABLE) == set(Opcode) == set(SEMANTICS)
    assert {spec.group for spec in OP_TABLE.values()} <= set(RULES) | {Group.INSTALL} and \
        {spec.group for spec in OP_TABLE.values()} <= set(TIMING_RULES)


def test_group_sets_and_units_derive_from_the_table():
    assert UNIT_OF[Opcode.MATMUL] == UNIT_OF[Opcode.INSTALL] == Unit.MXM
    assert ops_in(Group.WINDOW) == {Opcode.MAXPOOL, Opcode.AVGPOOL}
    assert Opcode.LEAKY_RELU in EPILOGUE_OPS and Opcode.EXP not in EPILOGUE_OPS


@pytest.mark.parametrize("opcode", list(Opcode), ids=lambda o: o.name)
def test_attributes_round_trip_through_the_positional_format(opcode):
    spec = OP_TABLE[opcode]
    given = {a.name: ((1,) * (a.length or 2) if a.kind in ("ints", "floats") else 1) for a in spec.attrs
             if a.required}
    if opcode == Opcode.SLICE:
        given = {"begin": (0, 1), "step": (1, 2)}
    attrs = make_attrs(opcode, given)
    assert unpack_attrs(opcode, pack_attrs(opcode, attrs)) == attrs


def test_bad_attributes_are_named():
    with pytest.raises(ValueError, match="RELU has no attribute 'alpha'"):
        make_attrs(Opcode.RELU, {"alpha": 1.0})
    with pytest.raises(ValueError, match="CLIP needs attribute 'lo'"):
        make_attrs(Opcode.CLIP, {"hi": 1.0})
    with pytest.raises(ValueError, match="MAXPOOL.kernel takes 2 values"):
        make_attrs(Opcode.MAXPOOL, {"kernel": (3,)})
    with pytest.raises(ValueError, match="not an activation"):
        make_attrs(Opcode.EPILOGUE, {"act": int(Opcode.EXP)})


def test_an_instructions_attributes_are_read_only_once_checked():
    """A value set after the check (a float kernel, an unknown name) would reach the simulator unchecked: the
    attributes cannot be changed, only replaced through a new, checked instruction."""
    import dataclasses

    layout = Layout()
    pool = ins("MAXPOOL", [layout.const(__import__("numpy").zeros((1, 1, 4, 4), "float32"))],
               [layout.take((1, 1, 2, 2), DType.F32)], kernel=(2, 2), stride=(2, 2))
    with pytest.raises(TypeError, match="does not support item assignment"):
        pool.attrs["kernel"] = (2.5, 2.0)
    with pytest.raises(ValueError, match="MAXPOOL.kernel must be integers, got \\(2.5, 2.0\\)"):
        dataclasses.replace(pool, attrs={**pool.attrs, "kernel": (2.5, 2.0)})
    kernel = dataclasses.replace(pool, attrs={**pool.attrs, "kernel": (2.0, 2.0)}).attrs["kernel"]
    assert kernel == (2, 2) and all(type(k) is int for k in kernel)  # (2.0 == 2: the type is the point)


def test_disassembler_names_attributes_and_epilogues():
    layout = Layout()
    x = layout.const(__import__("numpy").zeros((1, 2, 6, 6), "float32"))
    y = layout.take((1, 2, 3, 3), DType.F32)
    line = disassemble(program([ins("MAXPOOL", [x], [y], kernel=(3, 3), stride=(2, 2), pad=(1, 1, 1, 1))],
                               layout)).splitlines()[-1]
    assert "kernel=3x3 stride=2x2 pad=1,1,1,1" in line and "MAXPOOL" in line
    acc = layout.take((4, 4), DType.F32)
    out = layout.take((4, 4), DType.F32)
    line = disassemble(program([ins("EPILOGUE", [acc], [out], act=Opcode.LEAKY_RELU, act_args=(0.1, 0.0))],
                               layout)).splitlines()[-1]
    assert "act=LEAKY_RELU alpha=0.1" in line


def test_isa_reference_is_current():
    assert (ROOT / "docs" / "ISA.md").read_text() == isa_reference() + "\n", "run python scripts/isa_doc.py"


def test_an_attribute_count_the_table_does_not_allow_is_a_format_error():
    import hashlib
    import struct

    from lpx_tvm.runtime_sim.container import HEADER as _HEADER
    from lpx_tvm.runtime_sim.program import _INSTR, MAGIC, VERSION

    layout = Layout()
    x = layout.const(__import__("numpy").zeros((2, 2), "float32"))
    y = layout.take((2, 2), DType.F32)
    blob = encode(program([ins("CLIP", [x], [y], lo=0.0, hi=1.0)], layout))
    body = bytearray(blob[_HEADER.size:])
    record = _INSTR.pack(int(Opcode.CLIP), int(Unit.VXM), 0, 1, 1, 2, 0, 0)
    at = bytes(body).index(record)
    body[at:at + _INSTR.size] = _INSTR.pack(int(Opcode.CLIP), int(Unit.VXM), 0, 1, 1, 1, 0, 0)
    end = bytes(body).rindex(b"\x00\x00\x00\x00\x00\x00\xf0?")  # drop CLIP's last attribute (hi = 1.0)
    del body[end:end + 8]
    body = bytes(body)
    signed = _HEADER.pack(MAGIC, VERSION, 0, len(body), hashlib.blake2b(body, digest_size=16,
                                 person=struct.pack("<H", VERSION)).digest()) + body
    with pytest.raises(ProgramFormatError, match="CLIP: attributes end before 'hi'"):
        decode(signed)


def test_int32_partial_sums_add_exactly():
    """The planes' int32 partial sums of one product split over planes meet in an ADD: it adds them as integers.
    Through float32 16,777,217 + 2 would round to 16,777,218."""
    import numpy as np

    out = np.zeros(2, np.int32)
    SEMANTICS[Opcode.ADD]([out], [np.array([16_777_217, -2_000_000_001], np.int32), np.array([2, -3], np.int32)], {})
    np.testing.assert_array_equal(out, [16_777_219, -2_000_000_004])
