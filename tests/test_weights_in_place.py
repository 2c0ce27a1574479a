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
