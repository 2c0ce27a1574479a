"""Perfetto trace files keep the trace-event format's rule: on a track, slices never overlap unless one lies
wholly inside the other. Checked exactly, on whole nanoseconds, for one chip, several programs and a system."""

import json

import numpy as np
import pytest

import lpx_tvm
from conftest import host_op_between_model
from lpx_tvm.runtime_sim.trace import write_trace


def _slices(path):
    events = json.loads(path.read_text())["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    processes = [e["args"]["name"] for e in events if e.get("name") == "process_name"]
    tracks = {}
    for e in events:
        if e["ph"] == "X":
            begin = round(e["ts"] * 1000)
            tracks.setdefault((e["pid"], e["tid"]), []).append((begin, begin + round(e["dur"] * 1000), e))
    return tracks, names, processes


def _assert_nested(tracks):
    for key, spans in tracks.items():
        open_ends = []
        for begin, end, _ in sorted(spans, key=lambda s: (s[0], -s[1])):
            while open_ends and open_ends[-1] <= begin:
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1], f"track {key}: [{begin}, {end}) overlaps a slice " \
                f"ending at {open_ends[-1]} without nesting in it"
            open_ends.append(end)


@pytest.mark.slow
def test_a_chips_trace_nests_exactly_with_the_install_port_on_its_own_track(tmp_path):
    """squeezenet on tsp (900 MHz, 1.11 ns a cycle): slices meeting at a cycle were written as µs floats an
    ulp apart, the earlier ending after the later began; whole nanoseconds meet exactly."""
    from lpx_tvm.app.tools.zoo import ZOO

    compiled = lpx_tvm.compile(ZOO["squeezenet"].load(), config="tsp")
    write_trace(tmp_path / "t.json", list(compiled.simulators.items()))
    tracks, names, _ = _slices(tmp_path / "t.json")
    _assert_nested(tracks)
    by_name = {names[k]: spans for k, spans in tracks.items()}
    # a plane installs its next tile while its array computes: two tracks, both busy
    assert {s[2]["name"] for s in by_name["MXM0 install"]} == {"INSTALL"}
    assert {s[2]["name"] for s in by_name["MXM0"]} == {"MATMUL"}


def test_programs_follow_one_another_and_are_named_by_their_place(tmp_path):
    """sin between two products: two lpx programs and the sin on the host between them."""
    compiled = lpx_tvm.compile(host_op_between_model(), config="tiny")
    assert compiled.report.lpx_functions == 2
    write_trace(tmp_path / "t.json", list(compiled.simulators.items()))
    tracks, _, processes = _slices(tmp_path / "t.json")
    _assert_nested(tracks)
    assert [p.split(" (")[0] for p in processes] == ["program 1 of 2", "program 2 of 2"]
    (first, second) = [sim.stats.cycles for sim in compiled.simulators.values()]
    starts = {}
    for (pid, _), spans in tracks.items():
        starts[pid] = min(starts.get(pid, 10**18), min(b for b, _, _ in spans))
        if pid == 0:
            assert max(e for _, e, _ in spans) <= round(first * 1e9 / 100e6)  # tiny runs at 100 MHz
    assert starts[1] >= round(first * 1e9 / 100e6)


def test_a_system_trace_nests_on_every_chip_and_link(tmp_path):
    from conftest import mlp_model

    compiled = lpx_tvm.compile(mlp_model(), system="tiny-2", parallel="pipeline", chips=2)
    compiled(np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32))
    write_trace(tmp_path / "t.json", list(compiled.simulators.items()))
    tracks, names, processes = _slices(tmp_path / "t.json")
    _assert_nested(tracks)
    assert [p.rsplit(", ", 1)[-1] for p in processes] == ["chip 0", "chip 1", "tiny-2 links"]
    assert "chip 0 ─► chip 1 (port 0)" in names.values()
