"""Collectives that fit the topology (codegen/parallel/collectives.py), compiled and worked out by hand.

tiny: 100 MHz, a link moves 1 GB/s each way = 10 bytes a cycle, a hop takes the C2C latency of 8 cycles. A
block of 4 × 32 fp32 is 512 bytes: 52 cycles on one link, 26 on each of two.

- direct (every pair linked): every chip sends its block to every other at once, one hop: 8 + 52 cycles from
  the first SEND to the last byte landed, whatever the chip count;
- ring: T − 1 steps one after another, each a hop and a block: 3 × 60 on 4 chips;
- hierarchical (2 nodes of 4): a step across the nodes, then one within (where a chip forwards the block that
  crossed): 2 × 60;
- two links a pair: the block in two halves side by side, 8 + 26.
"""

from math import ceil

import numpy as np
import pytest

from lpx_tvm.codegen import Target
from lpx_tvm.codegen.graph import Graph, Node
from lpx_tvm.codegen.parallel.base import Mapping, Part
from lpx_tvm.codegen.parallel.collectives import choose
from lpx_tvm.codegen.parallel.runner import compile_mapping
from lpx_tvm.runtime_sim import Opcode, load_config
from lpx_tvm.runtime_sim.system import load_system
from lpx_tvm.runtime_sim.system_sim import SystemSimulator

TINY = load_config("tiny")
RATE = TINY.c2c_bytes_per_s_per_link // TINY.clock_hz  # 10 bytes a cycle
HOP = TINY.latency_cycles["C2C"]  # 8
ROWS, WIDTH = 4, 32  # a block: 4 × 32 fp32 = 512 bytes
BLOCK = ceil(ROWS * WIDTH * 4 / RATE)  # 52 cycles on one link


def _compile(system_name: str, kind: str, ranks: int, width: int = WIDTH):
    """A one-collective model on ``ranks`` chips: each chip's input is its slice of the model's input (an
    all-gather: its block; an all-reduce: a whole tensor of partial sums), and each chip stores its whole
    result as its rows of the model's output. A block is ROWS × ``width`` fp32."""
    system = load_system(system_name)
    group = choose(system, ranks)
    parts = []
    for rank, chip in enumerate(group.chips):
        g = Graph()
        shape_in = (ROWS, width) if kind == "allgather" else (ROWS, width * ranks)
        x = g.add_tensor(shape_in, "float32")
        out = g.add_tensor((ROWS, width * ranks), "float32")
        attrs = {"rank": rank, "ranks": ranks, "tag": 0, "group": group}
        attrs.update({"axis": 1} if kind == "allgather" else {"rotated": False})
        g.nodes = [Node(kind, [x], out, attrs, kind)]
        g.inputs, g.outputs = [x], [out]
        parts.append(Part(chip, g))
    axis = 1 if kind == "allgather" else 0
    size = width if kind == "allgather" else ROWS
    inputs = (tuple((c, 0, axis, r * size, (r + 1) * size) for r, c in enumerate(group.chips)),)
    outputs = (tuple((c, 0, 0, r * ROWS, (r + 1) * ROWS) for r, c in enumerate(group.chips)),)
    mapping = Mapping(kind, parts, inputs, outputs, "", spmd=True)
    return group, SystemSimulator(compile_mapping(kind, mapping, Target.parse(config=system.chip), system))


def _links(sim, opcode):
    """The leader's ``opcode`` instructions as (issue cycle, port, bytes)."""
    prog = sim.sims[0].program
    return [(ins.cycle, ins.unit_index, (ins.srcs or ins.dsts)[0].nbytes) for ins in prog.instructions
            if ins.opcode == opcode]


def _span(sim, rate=RATE) -> int:
    """From the leader's first SEND to its last RECV's last byte landed."""
    sends, recvs = _links(sim, Opcode.SEND), _links(sim, Opcode.RECV)
    return max(c + ceil(b / rate) for c, _, b in recvs) - min(c for c, _, _ in sends)


@pytest.mark.parametrize("system, ranks, algorithm, span", [
    ("tiny-fc-4", 4, "direct", HOP + BLOCK),
    ("tiny-fc-8", 8, "direct", HOP + BLOCK),
    ("tiny-4", 4, "ring", 3 * (HOP + BLOCK)),
    ("tiny-grid-2x4", 8, "hierarchical", 2 * (HOP + BLOCK)),
    ("tiny-fc-4x2", 4, "direct", HOP + ceil(BLOCK / 2)),
])
def test_an_all_gather_by_hand(system, ranks, algorithm, span):
    group, sim = _compile(system, "allgather", ranks)
    assert group.algorithm == algorithm and len(sim.sims) == ranks
    assert list(sim.program.chips) == list(range(ranks))
    assert _span(sim) == span
    x = np.random.default_rng(ranks).standard_normal((ROWS, WIDTH * ranks)).astype(np.float32)
    (out,) = sim.run([x])
    np.testing.assert_array_equal(out, np.tile(x, (ranks, 1)))  # every chip holds every block


def test_a_direct_exchange_uses_every_link_of_the_group_at_once():
    group, sim = _compile("tiny-fc-8", "allgather", 8)
    sends = _links(sim, Opcode.SEND)
    assert len(sends) == 7 and len({c for c, _, _ in sends}) == 1  # 7 peers, one cycle
    assert len(sim.stats.links) == 8 * 7  # every link of the 28, both ways


def test_two_links_carry_halves_side_by_side():
    group, sim = _compile("tiny-fc-4x2", "allgather", 4)
    sends = _links(sim, Opcode.SEND)
    assert sorted(b for _, _, b in sends) == [256] * 6 and len({p for _, p, _ in sends}) == 6


@pytest.mark.parametrize("system, ranks, algorithm, exchange_spans", [
    ("tiny-fc-4", 4, "direct", [HOP + BLOCK] * 2),
    ("tiny-4", 4, "ring", None),
    ("tiny-grid-2x4", 8, "hierarchical", None),
    ("tiny-fc-8", 8, "direct", [HOP + BLOCK] * 2),
])
def test_an_all_reduce_by_hand(system, ranks, algorithm, exchange_spans):
    """Direct: a reduce-scatter of one hop (every chip's block to its owner at once), the T − 1 received blocks
    added into this chip's own, then an all-gather of one hop."""
    group, sim = _compile(system, "allreduce", ranks)
    assert group.algorithm == algorithm
    partials = np.random.default_rng(ranks).standard_normal((ranks * ROWS, WIDTH * ranks)).astype(np.float32)
    (out,) = sim.run([partials])
    total = partials.reshape(ranks, ROWS, WIDTH * ranks).sum(axis=0)
    np.testing.assert_allclose(out, np.tile(total, (ranks, 1)), rtol=1e-5, atol=1e-5)
    if exchange_spans is None:
        return
    prog = sim.sims[0].program
    sends, recvs = _links(sim, Opcode.SEND), _links(sim, Opcode.RECV)
    half = len(sends) // 2
    scatter = max(c + ceil(b / RATE) for c, _, b in recvs[:half]) - min(c for c, _, _ in sends[:half])
    gather = max(c + ceil(b / RATE) for c, _, b in recvs[half:]) - min(c for c, _, _ in sends[half:])
    assert [scatter, gather] == exchange_spans
    assert sum(ins.opcode == Opcode.ADD for ins in prog.instructions) == ranks - 1


def _one_shot(system_name: str, ranks: int, width: int):
    """An all-reduce of one row of ``width`` fp32 on ``ranks`` chips, each chip its row of the model's input."""
    system = load_system(system_name)
    group = choose(system, ranks)
    parts = []
    for rank, chip in enumerate(group.chips):
        g = Graph()
        x, out = g.add_tensor((1, width), "float32"), g.add_tensor((1, width), "float32")
        g.nodes = [Node("allreduce", [x], out, {"rank": rank, "ranks": ranks, "tag": 0, "group": group,
                                                "rotated": False}, "allreduce")]
        g.inputs, g.outputs = [x], [out]
        parts.append(Part(chip, g))
    pieces = tuple((c, 0, 0, r, r + 1) for r, c in enumerate(group.chips))
    mapping = Mapping("allreduce", parts, (pieces,), (pieces,), "", spmd=True)
    return group, SystemSimulator(compile_mapping("allreduce", mapping, Target.parse(config=TINY), system))


@pytest.mark.parametrize("system, ranks", [("tiny-fc-4", 4), ("tiny-fc-8", 8), ("tiny-grid-2x4", 8)])
def test_a_small_all_reduce_goes_whole_in_one_hop_a_level(system, ranks):
    """64 bytes (16 fp32): sent whole to every peer, one hop and 7 cycles on a link (8 + 7 = 15), against a
    reduce-scatter and an all-gather of a T-th each: 2 × (8 + 2) = 20 on 4 chips, 2 × (8 + 1) = 18 on 8. Two
    nodes of 4: half the columns (32 bytes) go within the node and then across, the other half across and then
    within, side by side: the first level's 3 + 1 sends land together, 8 + ceil(32 / 10) = 12 after they
    start. 4 KB goes as two hops."""
    group, sim = _one_shot(system, ranks, 16)
    assert group.one_shot(64) and not group.one_shot(4096)
    sends, recvs = _links(sim, Opcode.SEND), _links(sim, Opcode.RECV)
    direct = group.algorithm == "direct"
    first = ranks - 1 if direct else 3 + 1  # the first level's peers (both halves' on a grid)
    assert len(sends) == (ranks - 1 if direct else 2 * (3 + 1))
    assert {b for _, _, b in sends} == {64 if direct else 32}
    span = max(c + ceil(b / RATE) for c, _, b in recvs[:first]) - min(c for c, _, _ in sends)
    assert span == HOP + (7 if direct else ceil(32 / RATE))
    partials = np.random.default_rng(ranks).standard_normal((ranks, 16)).astype(np.float32)
    (out,) = sim.run([partials])
    np.testing.assert_allclose(out, np.tile(partials.sum(axis=0), (ranks, 1)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("system, chips, links, algorithm", [("tsp-node", 8, 28, "direct"),
                                                            ("lpx-node", 16, 16 * 15 // 2 * 4, "direct")])
@pytest.mark.slow
def test_a_tensor_parallel_mlp_uses_every_link_of_the_node_and_matches_onnx_runtime(system, chips, links,
                                                                                    algorithm):
    """The review's MLP (512 wide, batch 8) on a whole node: its all-gathers and its all-reduce are direct, so
    every link of the node carries traffic both ways (tsp-node: 28 links; lpx-node: 120 pairs × 4 links)."""
    import lpx_tvm
    from conftest import mlp_stack, ort_reference, run_on_lpx

    rng = np.random.default_rng(0)
    model = mlp_stack(rng, [512] * 5, batch=8)
    x = rng.standard_normal((8, 512)).astype(np.float32)
    compiled = lpx_tvm.compile(model, system=system, parallel="tensor", chips=chips)
    (out,) = run_on_lpx(compiled, [x])
    (sim,) = compiled.simulators.values()
    assert list(sim.program.chips) == list(range(chips))
    assert f"({algorithm})" in sim.program.notes
    assert len(sim.stats.links) == 2 * links  # every link, each direction
    np.testing.assert_allclose(out, ort_reference(model, {"x": x})[0], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_tensor_parallel_collective_on_16_chips_of_an_lpx_node_by_hand():
    """lp30 (Hot Chips 2026: 350 ns a hop, 350 cycles at the assumed 1 GHz; 112 Gb/s a link, 14 bytes a cycle),
    16 chips all to all, 4 links a pair. A block of 4 × 320 fp32 is 5,120 bytes, sent to each peer in 4 pieces
    of 1,280 bytes side by side: ceil(1,280 / 14) = 92 cycles. An all-gather is one hop and a piece: 442. An
    all-reduce of 16 such blocks (81,920 bytes) goes as a reduce-scatter and an all-gather, 442 each (whole to
    every peer it would be 350 + ceil(81,920 / 56) = 1,813 against 2 × 442)."""
    lp30 = load_config("lp30")
    hop, rate = lp30.latency_cycles["C2C"], lp30.c2c_bytes_per_s_per_link / lp30.clock_hz
    assert (hop, rate) == (350, 14)
    group, sim = _compile("lpx-node", "allgather", 16, width=320)
    assert group.algorithm == "direct" and group.links == 4
    assert _span(sim, rate) == hop + ceil(1280 / 14) == 442
    group, sim = _compile("lpx-node", "allreduce", 16, width=320)
    assert not group.one_shot(81_920)
    sends, recvs = _links(sim, Opcode.SEND), _links(sim, Opcode.RECV)
    half = len(sends) // 2
    assert half == 15 * 4  # 15 peers, 4 pieces each
    scatter = max(c + ceil(b / rate) for c, _, b in recvs[:half]) - min(c for c, _, _ in sends[:half])
    gather = max(c + ceil(b / rate) for c, _, b in recvs[half:]) - min(c for c, _, _ in sends[half:])
    assert (scatter, gather) == (442, 442)


def _all_to_all(system_name: str, ranks: int):
    """An all-to-all of ROWS × (WIDTH · ranks) fp32 along the columns on ``ranks`` chips: each chip's input is its
    rows of the model's input, each chip's result its rows of the model's output."""
    system = load_system(system_name)
    group = choose(system, ranks)
    parts = []
    for rank, chip in enumerate(group.chips):
        g = Graph()
        x, out = g.add_tensor((ROWS, WIDTH * ranks), "float32"), g.add_tensor((ROWS, WIDTH * ranks), "float32")
        g.nodes = [Node("alltoall", [x], out, {"rank": rank, "ranks": ranks, "tag": 0, "group": group, "axis": 1},
                        "alltoall")]
        g.inputs, g.outputs = [x], [out]
        parts.append(Part(chip, g))
    rows = tuple((c, 0, 0, r * ROWS, (r + 1) * ROWS) for r, c in enumerate(group.chips))
    mapping = Mapping("alltoall", parts, (rows,), (rows,), "", spmd=True)
    return group, SystemSimulator(compile_mapping("alltoall", mapping, Target.parse(config=system.chip), system))


@pytest.mark.parametrize("system, ranks", [("tiny-fc-4", 4), ("tiny-fc-8", 8)])
def test_a_direct_all_to_all_by_hand(system, ranks):
    """Every chip sends each peer the block meant for it at once, one hop: 8 + 52 cycles from the first SEND to
    the last byte landed, whatever the chip count, T − 1 sends of a block (512 bytes) each. Rank r's output block
    j is rank j's input block r."""
    group, sim = _all_to_all(system, ranks)
    assert group.algorithm == "direct"
    data = np.random.default_rng(ranks).standard_normal((ranks * ROWS, WIDTH * ranks)).astype(np.float32)
    (out,) = sim.run([data])
    blocks = data.reshape(ranks, ROWS, ranks, WIDTH)  # [source rank, row, destination block, column]
    expected = blocks.transpose(2, 1, 0, 3).reshape(ranks * ROWS, ranks * WIDTH)
    np.testing.assert_array_equal(out, expected)
    sends = _links(sim, Opcode.SEND)
    assert len(sends) == ranks - 1 and {b for _, _, b in sends} == {ROWS * WIDTH * 4}
    assert _span(sim) == HOP + BLOCK == 60


def test_an_all_to_all_across_a_grid_is_refused_with_its_reason():
    from lpx_tvm.codegen.parallel.collectives import CollectiveError

    group = choose(load_system("tiny-grid-2x4"), 8)
    with pytest.raises(CollectiveError, match="would be hierarchical; only a fully connected group's"):
        group.all_to_all(0)
