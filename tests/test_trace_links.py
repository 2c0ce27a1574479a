"""The chip-to-chip link events of the Perfetto trace (``runtime_sim/trace.py``'s ``link_events``): a track per
link direction a transfer uses, a slice per transfer on each hop of its route, from its SEND's issue cycle (one
hop latency later on each further hop) for its bytes ÷ the link rate, in whole nanoseconds written as µs.

Figures by hand from the presets:

- tiny (runtime_sim/configs/tiny.json): 100 MHz, so a cycle is 10 ns; a link moves 1 GB/s each way = 10 bytes
  a cycle; a hop (the C2C latency) takes 8 cycles.
- tsp (runtime_sim/configs/tsp.json): 900 MHz, a cycle is 10/9 ns; a link moves 15 GB/s = 16⅔ bytes a cycle;
  a hop takes 216 cycles.
- tiny-2: one link, chip 0 port 0 ─ chip 1 port 0. tiny-4: a ring 0 ─ 1 ─ 2 ─ 3 ─ 0; chip 0's port 0 goes to
  chip 1, chip 1's port 1 to chip 2 (and chip 2's port 0 back to chip 1). tsp-node: 8 chips, each pair joined;
  chip 0's port 0 goes to chip 1 and chip 1's port 0 to chip 0.

A trace slice's nanoseconds are read back as ``round(µs × 1000)``.
"""

import json
from math import ceil

import numpy as np

import lpx_tvm
from conftest import mlp_model
from lpx_tvm.runtime_sim import DType, load_config
from lpx_tvm.runtime_sim.system import load_system
from lpx_tvm.runtime_sim.system_sim import SystemSimulator
from lpx_tvm.runtime_sim.trace import write_trace
from programs import Layout, ins, program, system_program

TINY = load_config("tiny")
TSP = load_config("tsp")
F32 = DType.F32


def _chip_program(code, chip=TINY, predicted=0):
    """A chip program of SENDs and RECVs, in issue order: ``("SEND", array, peer, port, tag, cycle)`` sends a
    constant; ``("RECV", shape, peer, port, tag, cycle)`` receives fp32 ``shape`` into SRAM."""
    layout, instructions = Layout(), []
    for op, value, peer, port, tag, cycle in code:
        if op == "SEND":
            instructions.append(ins("SEND", [layout.const(value)], [], cycle=cycle, unit_index=port, peer=peer,
                                    tag=tag))
        else:
            instructions.append(ins("RECV", [], [layout.take(value, F32)], cycle=cycle, unit_index=port, peer=peer,
                                    tag=tag))
    return program(instructions, layout, predicted=predicted, chip=chip)


def _trace(tmp_path, runs):
    """Write the trace of ``runs`` ([(name, simulator)]) and read it back: the processes by pid, the thread
    names by (pid, tid), and the slices by (pid, tid) as (begin ns, end ns, event)."""
    path = tmp_path / "trace.json"
    write_trace(path, runs)
    events = json.loads(path.read_text())["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    slices = {}
    for e in events:
        if e["ph"] == "X":
            begin = round(e["ts"] * 1000)
            slices.setdefault((e["pid"], e["tid"]), []).append((begin, begin + round(e["dur"] * 1000), e))
    return processes, threads, slices


def _link_tracks(processes, threads, slices, pid):
    """The link process ``pid``'s tracks: thread name ─► its slices as (begin ns, end ns, name, args), by
    begin."""
    assert processes[pid].endswith("links"), processes
    return {threads[key]: sorted((b, e, ev["name"], ev["args"]) for b, e, ev in spans)
            for key, spans in slices.items() if key[0] == pid}


def _assert_back_to_back(tracks):
    """On every link track a slice ends no later than the next one begins (a link direction carries one
    transfer at a time, so nothing nests either): compared exactly, in whole nanoseconds."""
    for name, spans in tracks.items():
        for (b0, e0, *_), (b1, e1, *_) in zip(spans, spans[1:]):
            assert e0 <= b1, f"{name}: [{b0}, {e0}) overlaps [{b1}, {e1})"


def _two_way_tiny_2():
    """tiny-2, by hand. Chip 0 SENDs a (4×32 fp32 = 512 bytes, ⌈51.2⌉ = 52 cycles) at cycle 0 and b (2×32 fp32
    = 256 bytes, ⌈25.6⌉ = 26 cycles) at cycle 52, as a's last byte leaves; chip 1 SENDs c (3×7 fp32 = 84 bytes,
    ⌈8.4⌉ = 9 cycles) back at cycle 5. Each RECV issues one hop (8 cycles) after its SEND: a at 8, b at 60, c at
    13. Each chip's last result: chip 0's SEND b reaches its peer at 52 + 26 + 8 = 86; chip 1's RECV b lands at
    60 + 26 = 86."""
    rng = np.random.default_rng(5)
    a, b, c = (rng.standard_normal(s).astype(np.float32) for s in [(4, 32), (2, 32), (3, 7)])
    chip0 = _chip_program([("SEND", a, 1, 0, 1, 0), ("RECV", (3, 7), 1, 0, 3, 13), ("SEND", b, 1, 0, 2, 52)],
                          predicted=86)
    chip1 = _chip_program([("SEND", c, 0, 0, 3, 5), ("RECV", (4, 32), 0, 0, 1, 8), ("RECV", (2, 32), 0, 0, 2, 60)],
                          predicted=86)
    return SystemSimulator(system_program("tiny-2", {0: chip0, 1: chip1}))


def test_each_send_is_a_slice_from_its_issue_cycle_for_its_bytes_over_the_link_rate(tmp_path):
    """The tiny-2 run of ``_two_way_tiny_2`` uses both directions of its one link: exactly two link tracks. At
    10 ns a cycle: a from 0 ns for 52 cycles (to 520 ns), b from cycle 52 = 520 ns to cycle 78 = 780 ns (it
    begins exactly where a ends), c from cycle 5 = 50 ns for 9 cycles (to 140 ns). Each slice's args carry the
    bytes worked above (512, 256, 84), the SEND's tag, its chip and its index in that chip's program (a: 0,
    b: 2, after chip 0's RECV; c: 0)."""
    sim = _two_way_tiny_2()
    processes, threads, slices = _trace(tmp_path, [("two-way", sim)])
    assert processes == {0: "two-way, chip 0", 1: "two-way, chip 1", 2: "tiny-2 links"}
    tracks = _link_tracks(processes, threads, slices, 2)
    assert tracks == {
        "chip 0 ─► chip 1 (port 0)": [
            (0, 520, "0─►1", {"tag": 1, "bytes": 512, "from_chip": 0, "instruction": 0}),
            (520, 780, "0─►1", {"tag": 2, "bytes": 256, "from_chip": 0, "instruction": 2})],
        "chip 1 ─► chip 0 (port 0)": [
            (50, 140, "1─►0", {"tag": 3, "bytes": 84, "from_chip": 1, "instruction": 0})],
    }
    _assert_back_to_back(tracks)


def test_link_slices_are_written_in_microseconds_with_the_links_category(tmp_path):
    """The format's unit is the µs: a's slice of ``_two_way_tiny_2`` is written ts 0.0, dur 0.52 (520 ns); b's
    ts 0.52, dur 0.26; c's ts 0.05, dur 0.09 (the nanoseconds of the test above ÷ 1000). Every link slice is a
    complete event (``ph`` X) of category ``link``."""
    _, _, slices = _trace(tmp_path, [("two-way", _two_way_tiny_2())])
    written = sorted((ev["ts"], ev["dur"], ev["ph"], ev["cat"]) for key, spans in slices.items() if key[0] == 2
                     for _, _, ev in spans)
    expected = [(0.0, 0.52), (0.05, 0.09), (0.52, 0.26)]
    assert [(ph, cat) for _, _, ph, cat in written] == [("X", "link")] * 3
    np.testing.assert_allclose([(ts, dur) for ts, dur, _, _ in written], expected, rtol=0, atol=1e-12)


def test_a_two_hop_transfer_is_a_slice_on_each_link_one_hop_later_on_the_second(tmp_path):
    """tiny-4, by hand: chip 0 SENDs x (4×32 fp32 = 512 bytes, 52 cycles) to chip 2 at cycle 4. Its route is
    0 ─► 1 (chip 0's port 0) then 1 ─► 2 (chip 1's port 1), so chip 2's RECV (on its port 0) issues two hops
    later, at 4 + 2 × 8 = 20, and lands at 72; chip 0's SEND reaches the next chip at 4 + 52 + 8 = 64. Chip 1
    forwards and runs no program. The trace has a track for each hop: 0 ─► 1 from cycle 4 = 40 ns for 520 ns
    (to 560 ns), 1 ─► 2 a hop later, from cycle 12 = 120 ns to 640 ns; both slices are the one SEND, named for
    its two ends, 512 bytes."""
    ring = load_system("tiny-4")
    assert ring.route(0, 2) == ((0, 0, 1, 0), (1, 1, 2, 0))  # the route worked out above
    x = np.arange(128, dtype=np.float32).reshape(4, 32)
    chip0 = _chip_program([("SEND", x, 2, 0, 9, 4)], predicted=64)
    chip2 = _chip_program([("RECV", (4, 32), 0, 0, 9, 20)], predicted=72)
    sim = SystemSimulator(system_program("tiny-4", {0: chip0, 2: chip2}))
    processes, threads, slices = _trace(tmp_path, [("relay", sim)])
    assert processes == {0: "relay, chip 0", 1: "relay, chip 2", 2: "tiny-4 links"}
    tracks = _link_tracks(processes, threads, slices, 2)
    args = {"tag": 9, "bytes": 512, "from_chip": 0, "instruction": 0}
    assert tracks == {"chip 0 ─► chip 1 (port 0)": [(40, 560, "0─►2", args)],
                      "chip 1 ─► chip 2 (port 1)": [(120, 640, "0─►2", args)]}


def test_slices_meeting_at_a_cycle_meet_at_the_same_nanosecond_at_900_mhz(tmp_path):
    """tsp-node (900 MHz: 10/9 ns a cycle; 15e9 / 9e8 = 16⅔ bytes a cycle; a hop 216 cycles), by hand: chip 0
    SENDs a (4×80 fp32 = 1280 bytes, ⌈76.8⌉ = 77 cycles) at cycle 0 and b (2×80 fp32 = 640 bytes, ⌈38.4⌉ = 39
    cycles) at cycle 77, as a's last byte leaves; chip 1 RECVs them at 216 and 293, the last landing at 332,
    when b (sent until 116) also reaches it (116 + 216). a ends at cycle 77 = round(85.6) = 86 ns, exactly
    where b begins; b ends at cycle 116 = round(128.9) = 129 ns (43 ns long)."""
    rng = np.random.default_rng(6)
    a, b = rng.standard_normal((4, 80)).astype(np.float32), rng.standard_normal((2, 80)).astype(np.float32)
    assert ceil(a.nbytes / TSP.c2c_bytes_per_cycle) == 77 and ceil(b.nbytes / TSP.c2c_bytes_per_cycle) == 39
    chip0 = _chip_program([("SEND", a, 1, 0, 1, 0), ("SEND", b, 1, 0, 2, 77)], chip=TSP, predicted=332)
    chip1 = _chip_program([("RECV", (4, 80), 0, 0, 1, 216), ("RECV", (2, 80), 0, 0, 2, 293)], chip=TSP,
                          predicted=332)
    sim = SystemSimulator(system_program("tsp-node", {0: chip0, 1: chip1}))
    processes, threads, slices = _trace(tmp_path, [("tsp", sim)])
    tracks = _link_tracks(processes, threads, slices, 2)
    assert {name: [(b0, e0, args["bytes"]) for b0, e0, _, args in spans] for name, spans in tracks.items()} == \
        {"chip 0 ─► chip 1 (port 0)": [(0, 86, 1280), (86, 129, 640)]}
    _assert_back_to_back(tracks)


def test_a_second_programs_link_slices_follow_the_first_program(tmp_path):
    """Two system programs in one trace are placed one after another: the first (``_two_way_tiny_2``) takes 86
    cycles = 860 ns, so the second's links process (pid 5: after the first's two chips, its links, and the
    second's two chips) has the same slices as the first's (pid 2), each 860 ns later: a [860, 1380), b [1380,
    1640), c [910, 1000)."""
    processes, threads, slices = _trace(tmp_path, [("first", _two_way_tiny_2()), ("second", _two_way_tiny_2())])
    first, second = (_link_tracks(processes, threads, slices, pid) for pid in (2, 5))
    assert {name: [(b, e) for b, e, _, _ in spans] for name, spans in second.items()} == \
        {"chip 0 ─► chip 1 (port 0)": [(860, 1380), (1380, 1640)], "chip 1 ─► chip 0 (port 0)": [(910, 1000)]}
    assert {name: [(b + 860, e + 860, n, a) for b, e, n, a in spans] for name, spans in first.items()} == second
    assert [processes[pid] for pid in (0, 1, 3, 4)] == ["program 1 of 2 (first), chip 0", "program 1 of 2 (first), "
                                                        "chip 1", "program 2 of 2 (second), chip 0",
                                                        "program 2 of 2 (second), chip 1"]


def test_a_compiled_two_chip_pipeline_draws_its_one_transfer(tmp_path):
    """``mlp_model`` (x [4, 64] ─► Gemm to 32 ─► Relu ─► Gemm to 10) pipelined over tiny-2's two chips: chip 0
    computes the Relu output r, [4, 32] fp32 = 512 bytes, and SENDs it to chip 1 over chip 0's port 0, the one
    transfer. So the trace has one link track, 0 ─► 1, with one slice: 512 bytes, ⌈512 / 10⌉ = 52 cycles = 520
    ns long, beginning at the SEND's issue cycle (read from chip 0's program: the compiler schedules it) × 10
    ns; chip 1's RECV issues one hop (8 cycles) after it."""
    compiled = lpx_tvm.compile(mlp_model(), system="tiny-2", parallel="pipeline", chips=2)
    (sim,) = compiled.simulators.values()
    sends = [(chip, ins.cycle) for chip, s in sim.chips for ins in s.program.instructions if ins.opcode.name == "SEND"]
    recvs = [(chip, ins.cycle) for chip, s in sim.chips for ins in s.program.instructions if ins.opcode.name == "RECV"]
    assert [chip for chip, _ in sends] == [0], sends
    issue = sends[0][1]
    assert recvs == [(1, issue + 8)]
    processes, threads, slices = _trace(tmp_path, list(compiled.simulators.items()))
    tracks = _link_tracks(processes, threads, slices, 2)
    assert {name: [(b, e, n, a["bytes"]) for b, e, n, a in spans] for name, spans in tracks.items()} == \
        {"chip 0 ─► chip 1 (port 0)": [(issue * 10, issue * 10 + 520, "0─►1", 512)]}
