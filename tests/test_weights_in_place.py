"""The simulator reads a program's weights where the program holds them: the SRAM image holds only what the
program writes (its untouched pages take no memory), and a weight some operand reads only in part, beside
other bytes, is placed in the image too. Values against numpy."""

import numpy as np

from lpx_tvm.runtime_sim import DType, TensorRef

from programs import Layout, ins, program, run_unchecked

F32 = DType.F32


def _stored(sim, ref):
    return sim._sram[ref.addr:ref.addr + ref.nbytes].view(np.float32)  # the image itself, not a weight's view


def test_weights_are_read_in_place_and_never_copied_into_the_image():
    layout = Layout()
    a = layout.const(np.arange(4, dtype=np.float32))
    b = layout.const(np.full(4, 10.0, np.float32))
    out = layout.take((4,), F32)
    code = [ins("ADD", [a, b], [out]), ins("STORE", [out], [], index=0, offset=0)]
    sim = run_unchecked(program(code, layout, outputs=[((4,), F32)]))
    got = sim.run([])[0]
    np.testing.assert_array_equal(got, np.arange(4) + 10.0)
    assert not _stored(sim, a).any() and not _stored(sim, b).any()  # the weights' range of the image: untouched
    np.testing.assert_array_equal(_stored(sim, out), np.arange(4) + 10.0)


def test_a_weight_read_in_part_beside_other_bytes_is_placed_in_the_image():
    """a (16 bytes at 0) and b (16 bytes at 64; the layout aligns to 64): a COPY of 20 floats from 0 spans a,
    the 48 bytes between them (zeros: nothing wrote them) and b."""
    layout = Layout()
    a = layout.const(np.arange(1, 5, dtype=np.float32))
    b = layout.const(np.full(4, 7.0, np.float32))
    span = TensorRef(0, (20,), F32)
    out = layout.take((20,), F32)
    code = [ins("COPY", [span], [out]), ins("STORE", [out], [], index=0, offset=0)]
    sim = run_unchecked(program(code, layout, outputs=[((20,), F32)]))
    want = np.concatenate([np.arange(1, 5), np.zeros(12), np.full(4, 7.0)]).astype(np.float32)
    np.testing.assert_array_equal(sim.run([])[0], want)
    np.testing.assert_array_equal(_stored(sim, a), np.arange(1, 5))
    np.testing.assert_array_equal(_stored(sim, b), np.full(4, 7.0))


def test_a_weight_whose_bytes_are_not_aligned_to_its_items_is_placed_in_the_image():
    """A format-7 program's weights lie anywhere in its encoding: one starting at an odd address is copied
    into the image (numpy's fast paths need aligned items), and read there."""
    from lpx_tvm.runtime_sim import Constant

    layout = Layout()
    a = layout.const(np.arange(4, dtype=np.float32))
    odd = np.zeros(17, np.uint8)[1:]  # 16 bytes from an odd address
    odd[:] = np.full(4, 2.0, np.float32).view(np.uint8)
    b = layout.take((4,), F32)
    layout.constants.append(Constant(b, odd))
    out = layout.take((4,), F32)
    code = [ins("ADD", [a, b], [out]), ins("STORE", [out], [], index=0, offset=0)]
    sim = run_unchecked(program(code, layout, outputs=[((4,), F32)]))
    np.testing.assert_array_equal(sim.run([])[0], np.arange(4) + 2.0)
    assert not _stored(sim, a).any()
    np.testing.assert_array_equal(_stored(sim, b), np.full(4, 2.0))


def test_format_8_aligns_every_weight_and_a_format_7_program_still_loads(monkeypatch):
    """Encoded, each weight's bytes start at a multiple of 64 from the program's first byte; the same program
    written as format 7 (no padding: ``_ALIGN`` 1) decodes to the same weights and computes the same sum."""
    from lpx_tvm.runtime_sim import Simulator, program as fmt

    layout = Layout()
    a = layout.const(np.arange(3, dtype=np.float32))  # 12 bytes: the next weight's bytes would be unaligned
    b = layout.const(np.full(4, 5.0, np.float32))
    out = layout.take((4,), F32)
    code = [ins("ADD", [TensorRef(a.addr, (3,), F32), TensorRef(b.addr, (3,), F32)], [TensorRef(out.addr, (3,), F32)]),
            ins("STORE", [TensorRef(out.addr, (3,), F32)], [], index=0, offset=0)]
    prog = program(code, layout, outputs=[((3,), F32)])
    blob = fmt.encode_array(prog)
    decoded = fmt.decoded_columns(blob).program  # its weights are views of the blob's bytes
    assert [(c.data.ctypes.data - blob.ctypes.data) % 64 for c in decoded.constants] == [0, 0]
    monkeypatch.setattr(fmt, "VERSION", 7)
    monkeypatch.setattr(fmt, "_ALIGN", 1)
    old = fmt.encode_array(prog)
    monkeypatch.undo()
    assert old.nbytes < blob.nbytes and bytes(old[8:12]) != bytes(blob[8:12])  # the version field differs
    for got in (decoded, fmt.decode(old)):
        assert [bytes(c.data) for c in got.constants] == [bytes(c.data) for c in prog.constants]
        np.testing.assert_array_equal(Simulator(got, check_schedule=False).run([])[0], np.arange(3) + 5.0)


def test_padding_that_is_not_zeros_is_named_even_behind_a_valid_checksum():
    """The bytes before a weight are zeros in format 8: a program whose padding holds anything else (damage
    that a re-signed checksum hides) is refused, not run."""
    import hashlib
    import struct

    import pytest

    from lpx_tvm.runtime_sim import ProgramFormatError, program as fmt
    from lpx_tvm.runtime_sim.container import HEADER

    layout = Layout()
    a = layout.const(np.arange(3, dtype=np.float32))  # 12 bytes: padding before the next weight
    b = layout.const(np.full(3, 5.0, np.float32))
    out = layout.take((3,), F32)
    blob = fmt.encode_array(program([ins("ADD", [a, b], [out])], layout))
    data_b = next(c.data for c in fmt.decoded_columns(blob).program.constants if c.ref == b)
    body = bytearray(blob[HEADER.size:])
    body[data_b.ctypes.data - blob.ctypes.data - HEADER.size - 1] = 7  # the byte just before b's
    body = bytes(body)
    signed = HEADER.pack(fmt.MAGIC, fmt.VERSION, 0, len(body), hashlib.blake2b(body, digest_size=16,
                                 person=struct.pack("<H", fmt.VERSION)).digest()) + body
    with pytest.raises(ProgramFormatError, match="constant padding is not zeros"):
        fmt.decode(signed)
