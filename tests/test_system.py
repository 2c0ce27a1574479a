"""Systems of chips: presets, routes, the network's rules, and transfers worked out by hand from the presets.

tiny: 100 MHz, a link moves 1 GB/s each way = 10 bytes a cycle, a hop takes the C2C latency of 8 cycles; the
host link moves 10 bytes a cycle with a DMA latency of 4.
"""

from math import ceil

import numpy as np
import pytest

from lpx_tvm.runtime_sim import DType, load_config
from lpx_tvm.runtime_sim.system import load_system
from lpx_tvm.runtime_sim.system_sim import (NetworkError, SystemSimulator, decode_system, encode_system)
from programs import Layout, ins, program, system_program

TINY = load_config("tiny")
F32 = DType.F32
RATE = TINY.c2c_bytes_per_s_per_link / TINY.clock_hz  # 10 bytes a cycle
HOP = TINY.latency_cycles["C2C"]  # 8
HOST = TINY.host_bytes_per_s / TINY.clock_hz  # 10 bytes a cycle
MEM = TINY.latency_cycles["MEM"]  # 4


def _sender(x_value, peer, port, tag=1, cycle=0):
    layout = Layout()
    x = layout.const(x_value)
    busy = ceil(x_value.nbytes / RATE)
    return program([ins("SEND", [x], [], cycle=cycle, unit_index=port, peer=peer, tag=tag)], layout,
                   predicted=cycle + busy + HOP)


def _receiver(shape, peer, port, at, tag=1, store=True):
    layout = Layout()
    y = layout.take(shape, F32)
    nbytes = int(np.prod(shape)) * 4
    landed = at + ceil(nbytes / RATE)
    code = [ins("RECV", [], [y], cycle=at, unit_index=port, peer=peer, tag=tag)]
    if store:
        code.append(ins("STORE", [y], [], cycle=landed, index=0))
    return program(code, layout, outputs=[(shape, F32)] if store else [],
                   predicted=landed + (ceil(nbytes / HOST) + MEM if store else 0))


def test_presets_and_routes():
    node = load_system("tsp-node")
    assert node.chips == 8 and len(node.links) == 28 and all(len(node.ports(c)) == 7 for c in range(8))
    rack = load_system("tsp-rack")
    assert rack.chips == 72 and all(len(rack.ports(c)) == 7 + 4 for c in range(72))
    assert len(rack.route(0, 71)) == 3  # local, global, local
    ring = load_system("tiny-4")
    assert [hop[2] for hop in ring.route(0, 2)] == [1, 2]
    assert load_system("tsp-system-264").figures["max_hops"] == 3
    assert load_system("tsp-system-10440").figures["max_hops"] == 5
    with pytest.raises(ValueError, match="whole nodes of 8"):
        load_system("tsp-system-100")
    with pytest.raises(ValueError, match="unknown system 'tsp-pod'"):
        load_system("tsp-pod")


def test_a_transfer_by_hand_and_its_data():
    x = np.arange(128, dtype=np.float32).reshape(4, 32)  # 512 bytes
    transfer = ceil(512 / RATE)  # 52 cycles on the link
    store = ceil(512 / HOST) + MEM
    sysprog = system_program("tiny-2", {0: _sender(x, peer=1, port=0), 1: _receiver((4, 32), peer=0, port=0, at=HOP)},
                             outputs=[(1, 0)])
    sim = SystemSimulator(decode_system(encode_system(sysprog)))
    assert sim.stats.cycles == HOP + transfer + store == 116
    assert sim.stats.links[(0, 0)] == {"bytes": 512, "busy_cycles": transfer, "transfers": 1, "peer": 1}
    np.testing.assert_array_equal(sim.run([])[0], x)


def test_an_all_reduce_by_hand():
    """Two chips each hold a vector of 128 fp32 and end with the sum of both: each SENDs its own at cycle 0,
    RECVs the other's one hop later, and adds."""
    rng = np.random.default_rng(3)
    values = [rng.standard_normal((4, 32)).astype(np.float32) for _ in range(2)]
    transfer = ceil(values[0].nbytes / RATE)  # 52
    received = HOP + transfer  # 60: the other chip's vector is in SRAM
    # ADD reads two 4-byte operands and writes one: 12 bytes a lane, 12 of the 32-byte streams a vector, and a
    # direction has 8: a vector every 2 cycles, 4 vectors (128 elements / 32 lanes) in 8; then the VXM latency
    add_done = received + 4 * ceil(12 / TINY.streams_per_direction) + TINY.latency_cycles["VXM"]
    stored = add_done + ceil(512 / HOST) + MEM
    programs = {}
    for chip in (0, 1):
        layout = Layout()
        own = layout.const(values[chip])
        other, total = layout.take((4, 32), F32), layout.take((4, 32), F32)
        code = [ins("SEND", [own], [], cycle=0, unit_index=0, peer=1 - chip, tag=7),
                ins("RECV", [], [other], cycle=HOP, unit_index=0, peer=1 - chip, tag=7),
                ins("ADD", [own, other], [total], cycle=received),
                ins("STORE", [total], [], cycle=add_done, index=0)]
        programs[chip] = program(code, layout, outputs=[((4, 32), F32)], predicted=stored)
    sim = SystemSimulator(system_program("tiny-2", programs, outputs=[(0, 0), (1, 0)]))
    assert add_done == 72 and sim.stats.cycles == stored == 128
    a, b = sim.run([])
    np.testing.assert_array_equal(a, values[0] + values[1])
    np.testing.assert_array_equal(b, values[1] + values[0])


def _rejected(system, programs, rule):
    with pytest.raises(NetworkError) as err:
        SystemSimulator(system_program(system, programs))
    assert err.value.rule == rule, str(err.value)
    return err.value


X = np.ones((4, 32), np.float32)


def test_unmatched_ends_are_rejected():
    err = _rejected("tiny-2", {0: _sender(X, 1, 0), 1: program([], Layout())}, "unmatched SEND")
    assert err.chip == 0 and "to chip 1" in str(err)
    err = _rejected("tiny-2", {0: program([], Layout()), 1: _receiver((4, 32), 0, 0, HOP, store=False)},
                    "unmatched RECV")
    assert err.chip == 1


@pytest.mark.parametrize("at, rule", [(HOP - 1, "RECV before arrival"), (HOP + 1, "RECV after arrival")])
def test_a_recv_must_take_the_data_as_it_arrives(at, rule):
    err = _rejected("tiny-2", {0: _sender(X, 1, 0), 1: _receiver((4, 32), 0, 0, at, store=False)}, rule)
    assert err.chip == 1 and err.cycle == at and f"arrives at cycle {HOP}" in str(err)


def test_a_send_to_one_chip_received_by_another_is_rejected():
    ring = load_system("tiny-4")
    programs = {0: _sender(X, 1, ring.port_to(0, 1), tag=5), 1: program([], Layout()),
                3: _receiver((4, 32), 0, ring.port_to(3, 0), HOP, tag=5, store=False)}
    err = _rejected("tiny-4", programs, "wrong destination")
    assert "goes to chip 1" in str(err) and "waits on chip 3" in str(err)


def test_a_send_on_the_wrong_port_is_rejected():
    ring = load_system("tiny-4")
    wrong = ring.port_to(0, 3)  # chip 0's link to chip 3, not to chip 1
    programs = {0: _sender(X, 1, wrong), 1: _receiver((4, 32), 0, ring.port_to(1, 0), HOP, store=False)}
    err = _rejected("tiny-4", programs, "wrong link")
    assert f"port {wrong}" in str(err)


def test_two_transfers_on_one_link_direction_are_rejected():
    """0 ─► 2 goes 0 ─► 1 ─► 2; 3 ─► 1 goes 3 ─► 0 ─► 1 one hop later: both need the link 0 ─► 1."""
    ring = load_system("tiny-4")
    assert [h[0] for h in ring.route(3, 1)] == [3, 0]
    programs = {0: _sender(X, 2, ring.port_to(0, 1)), 3: _sender(X, 1, ring.port_to(3, 0)),
                2: _receiver((4, 32), 0, ring.port_to(2, 1), 2 * HOP, store=False),
                1: _receiver((4, 32), 3, ring.port_to(1, 0), 2 * HOP, store=False)}
    err = _rejected("tiny-4", programs, "link conflict")
    assert "from chip 0" in str(err) and "to chip 1" in str(err) and err.cycle == HOP


def test_transfer_sizes_must_agree():
    err = _rejected("tiny-2", {0: _sender(X, 1, 0), 1: _receiver((2, 32), 0, 0, HOP, store=False)},
                    "transfer size")
    assert "256 bytes" in str(err) and "512" in str(err)


def test_a_damaged_system_program_is_rejected():
    from lpx_tvm.runtime_sim import ProgramFormatError

    blob = encode_system(system_program("tiny-2", {0: _sender(X, 1, 0),
                                                   1: _receiver((4, 32), 0, 0, HOP)}, outputs=[(1, 0)]))
    blob[100] ^= 1
    with pytest.raises(ProgramFormatError, match="checksum"):
        decode_system(blob)


def test_a_system_program_s_bytes_are_hashed_once_and_damage_in_a_chip_s_program_is_still_refused(monkeypatch):
    """The system's checksum covers every chip's program: decoding hashes each byte of the body once (the
    pieces of the tree, then the root over their 16-byte digests; not the chips' bytes a second time for their
    own checksums), and a byte changed inside the last chip's program is refused."""
    import hashlib

    from lpx_tvm.runtime_sim import ProgramFormatError, container
    from lpx_tvm.runtime_sim.container import HEADER

    blob = encode_system(system_program("tiny-2", {0: _sender(X, 1, 0),
                                                   1: _receiver((4, 32), 0, 0, HOP)}, outputs=[(1, 0)]))
    hashed, blake2b = [], hashlib.blake2b

    def counting(data, **kw):
        hashed.append(memoryview(data).nbytes)
        return blake2b(data, **kw)
    monkeypatch.setattr(container, "hashlib", type("Counting", (), {"blake2b": staticmethod(counting)}))
    decode_system(blob)
    assert hashed == [blob.nbytes - HEADER.size, 16]  # one piece, then the root
    blob[-1] ^= 1  # the last byte: inside chip 1's program
    with pytest.raises(ProgramFormatError, match="system program checksum"):
        decode_system(blob)


def test_the_system_checksum_is_the_blake2b_of_its_pieces_blake2bs(monkeypatch):
    """With 1,000-byte pieces, a system program's header holds blake2b (16 bytes) of the concatenated blake2bs
    of its body's pieces in turn, the last one short: hashlib's, worked out here."""
    import hashlib

    from lpx_tvm.runtime_sim import container
    from lpx_tvm.runtime_sim.container import HEADER

    monkeypatch.setattr(container, "TREE_PIECE", 1000)
    blob = bytes(encode_system(system_program("tiny-2", {0: _sender(X, 1, 0),
                                                         1: _receiver((4, 32), 0, 0, HOP)}, outputs=[(1, 0)])))
    body = blob[HEADER.size:]
    assert len(body) > 1000 and len(body) % 1000  # several pieces, the last one short
    leaves = b"".join(hashlib.blake2b(body[at:at + 1000], digest_size=16).digest()
                      for at in range(0, len(body), 1000))
    assert blob[HEADER.size - 16:HEADER.size] == hashlib.blake2b(leaves, digest_size=16).digest()
    assert decode_system(blob).chips == (0, 1)


def test_a_system_program_from_bytes_is_validated_once_and_against_its_systems_chip(monkeypatch):
    """Decoding validates every chip's program; its simulator takes those columns instead of validating the
    program again. A chip program made for another chip than the system's is named as such."""
    from dataclasses import replace

    from lpx_tvm.runtime_sim import ProgramFormatError, simulator

    sysprog = system_program("tiny-2", {0: _sender(X, 1, 0), 1: _receiver((4, 32), 0, 0, HOP)}, outputs=[(1, 0)])
    blob = encode_system(sysprog)

    def validated_again(*args, **kwargs):
        raise AssertionError("a decoded chip program was validated a second time")
    with monkeypatch.context() as patch:
        patch.setattr(simulator, "validated_columns", validated_again)
        (out,) = SystemSimulator(blob).run([])
    np.testing.assert_array_equal(out, X)
    foreign = replace(sysprog.programs[1], config_name="tsp")
    with pytest.raises(ProgramFormatError, match="compiled for chip config 'tsp', not for 'tiny'"):
        SystemSimulator(encode_system(replace(sysprog, programs=(sysprog.programs[0], foreign))))


@pytest.mark.parametrize("destinations, why", [
    (((0, 0, 1, 0, 64), (1, 0, 1, 64, 128)), "not \\[0, 64\\) along axis 1"),  # a slice the size of its input
    (((0, 0, 0, 0, 4), (1, 0, 0, 8, 12)), "do not tile"),                 # slices with a gap between them
    (((0, 0), (5, 0)), "not \\(chip, index\\)"),                            # a chip the program does not run
    (((0, 3), (1, 0)), "which has 1"),                                    # an input the chip does not take
    (((0, 0), (1, 0, 0, 4, 8)), "one whole input"),                       # whole on one chip, a slice on another
    (((0, 0, 2, 0, 4), (1, 0, 2, 4, 8)), "split along axis 2"),           # an axis the input does not have
])
def test_an_input_map_that_does_not_fit_its_chips_is_rejected(destinations, why):
    """Each chip loads its slice of a split input (tensor parallel: its heads of a KV cache); the map of who
    gets what must name real chips and inputs, and the slices must tile the input."""
    from dataclasses import replace

    from lpx_tvm.runtime_sim import ProgramFormatError

    def loader(chip):
        layout = Layout()
        x = layout.take((4, 32), F32)
        cycles = ceil(4 * 32 * 4 / HOST) + MEM
        return program([ins("LOAD", [], [x], cycle=0, index=0)], layout, inputs=[((4, 32), F32)], predicted=cycles)

    good = system_program("tiny-2", {0: loader(0), 1: loader(1)}, outputs=[])
    good = replace(good, inputs=(((0, 0, 0, 0, 4), (1, 0, 0, 4, 8)),))  # rows 0-3 to chip 0, 4-7 to chip 1
    assert SystemSimulator(good).inputs[0].shape == (8, 32)
    with pytest.raises(ProgramFormatError, match=why):
        SystemSimulator(replace(good, inputs=(destinations,)))


@pytest.mark.parametrize("parts, why", [
    ({"chips": (0, 1)}, r"1 programs for the chips \(0, 1\) \(one a chip\)"),
    ({"chips": (7,)}, r"its chips \[7\] must be distinct chips of 'tiny-2' \(0..1\)"),
    ({"chips": ("0",)}, r"its chips \['0'\] must be distinct chips of 'tiny-2'"),
    ({"programs": None}, r"its programs must be a tuple of Program, got NoneType"),
    ({"system_digest": bytes(8)}, r"system program was made for another 'tiny-2' \(digests 0000000000000000 vs"),
])
def test_a_hand_made_system_program_must_place_each_program_on_its_own_chip(parts, why):
    """(A chip the system does not have, or more chips than programs, was accepted; programs of None died
    in a TypeError; a program for another system's chips was run on this one.)"""
    from dataclasses import replace

    from lpx_tvm.runtime_sim import ProgramFormatError

    layout = Layout()
    x = layout.take((4, 32), F32)
    loader = program([ins("LOAD", [], [x], cycle=0, index=0)], layout, inputs=[((4, 32), F32)],
                     predicted=ceil(4 * 32 * 4 / HOST) + MEM)
    good = system_program("tiny-2", {1: loader}, inputs=[((1, 0),)])
    assert SystemSimulator(good).stats.cycles == ceil(4 * 32 * 4 / HOST) + MEM
    with pytest.raises(ProgramFormatError, match=why):
        SystemSimulator(replace(good, **parts))


def _stored_by_both(rows: int):
    def storer(chip):
        layout = Layout()
        x = layout.const(np.full((rows, 32), chip, np.float32))
        return program([ins("STORE", [x], [], cycle=0, index=0)], layout, outputs=[((rows, 32), F32)],
                       predicted=ceil(rows * 32 * 4 / HOST) + MEM)
    return storer


def test_an_output_each_chip_stores_a_slice_of_is_put_together():
    from dataclasses import replace

    from lpx_tvm.runtime_sim import ProgramFormatError

    storer = _stored_by_both(4)
    split = system_program("tiny-2", {0: storer(0), 1: storer(1)}, outputs=[((0, 0, 0, 0, 4), (1, 0, 0, 4, 8))])
    (out,) = SystemSimulator(split).run([])
    np.testing.assert_array_equal(out, np.repeat([0.0, 1.0], 4)[:, None] * np.ones((8, 32), np.float32))
    with pytest.raises(ProgramFormatError, match="one whole output"):  # a whole output stored twice
        SystemSimulator(replace(split, outputs=(((0, 0), (1, 0)),)))
    odd = system_program("tiny-2", {0: storer(0), 1: _stored_by_both(2)(1)}, outputs=[((0, 0, 1, 0, 32),
                                                                                     (1, 0, 1, 32, 64))])
    with pytest.raises(ProgramFormatError, match="chip 1's slice"):  # its other axis differs
        SystemSimulator(odd)


def test_a_format_1_system_program_still_loads():
    """Format 1 named one (chip, index) pair per output; format 2 lists where each part of it is stored."""
    import hashlib
    import json
    import struct

    from lpx_tvm.runtime_sim import system_sim

    prog = system_program("tiny-2", {0: _sender(X, 1, 0), 1: _receiver((4, 32), 0, 0, HOP)}, outputs=[(1, 0)])
    assert prog.outputs == (((1, 0),),)
    blob = bytes(memoryview(encode_system(prog)).cast("B"))
    head = system_sim.HEADER.size
    (n,) = struct.unpack_from("<I", blob, head)
    table = json.loads(blob[head + 4:head + 4 + n])
    table["outputs"] = [[1, 0]]
    align, chips, at = table.pop("aligned"), [], head + 4 + n
    for length in table["lengths"]:  # format 1 put the chips' programs one after another, unaligned
        at += -at % align
        chips.append(blob[at:at + length])
        at += length
    text = json.dumps(table).encode()
    body = struct.pack("<I", len(text)) + text + b"".join(chips)
    old = system_sim.HEADER.pack(system_sim.SYSTEM_MAGIC, 1, 0, len(body), hashlib.blake2b(body, digest_size=16).digest())
    assert decode_system(old + body).outputs == (((1, 0),),)
