"""lpx-tvm profile: per-layer table, JSON report and trace; SRAM capacity fallback."""

import json

import numpy as np
import onnx
import pytest
from onnx import helper

import lpx_tvm
from lpx_tvm.app.cli import main
from lpx_tvm.patterns import CapacityWarning
from lpx_tvm.runtime_sim import Opcode, decode
from conftest import assert_close, cnn_model, make_model, mlp_model, ort_run, tensor_info, weights


def test_profile_writes_report_and_trace(tmp_path, capsys):
    path = tmp_path / "cnn.onnx"
    onnx.save(cnn_model(), path)
    report, trace = tmp_path / "report.json", tmp_path / "trace.json"
    assert main(["profile", str(path), "--config", "tiny", "--json", str(report), "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "conv2d" in out and "% MAC peak" in out and "µs" in out and "ui.perfetto.dev" in out
    data = json.loads(report.read_text())
    # the matrix units' figures, worked from the program's instructions and the tiny preset: a MATMUL takes
    # 12 cycles an fp32 row, an INSTALL its tile's bytes over 2 streams of 32 bytes; useful-MAC utilisation is
    # the MACs over the fp32 peak, 2 planes of 32 × 32 MACs every 12 cycles
    (sim,) = lpx_tvm.compile(cnn_model(), config="tiny").simulators.values()
    matmuls = [i for i in sim.program.instructions if i.opcode == Opcode.MATMUL]
    installs = [i for i in sim.program.instructions if i.opcode == Opcode.INSTALL]
    assert {i.srcs[0].dtype.name for i in matmuls + installs} == {"F32"}
    rows = sum(int(np.prod(i.srcs[0].shape[:-1])) for i in matmuls)
    busy = rows * 12 + sum(-(-i.srcs[0].nbytes // (2 * 32)) for i in installs)
    macs = sum(int(np.prod(i.srcs[0].shape)) * i.dsts[0].shape[-1] for i in matmuls)
    cycles = data["simulated_cycles"]
    assert data["units"]["MXM"]["busy_cycles"] == busy
    assert data["units"]["MXM"]["utilisation"] == pytest.approx(busy / (2 * cycles), rel=1e-12)
    assert data["mac_utilisation"] == pytest.approx(macs / (2 * 32 * 32 / 12 * cycles), rel=1e-12)
    assert macs == 16 * 27 * 32 * 32 + 16 * 10  # the convolution's, and the classifier's
    assert data["microseconds"] == pytest.approx(cycles / 100, rel=1e-12)  # 100 MHz
    layers = data["layers"]
    assert [r["cycles"] for r in layers] == sorted((r["cycles"] for r in layers), reverse=True)
    # the 3x3 convolution: 16 output channels × 3·3·3 taps × 32·32 positions (its bias, batch norm and ReLU fused)
    (conv,) = [r for r in layers if r["ops"].startswith("conv2d")]
    assert conv["macs"] == 16 * 27 * 32 * 32
    assert all("/" not in r["ops"] for r in layers)  # short names, no function hash
    # each layer is named by the ONNX tensor it computes, as compare names it (its output: the ReLU's for the
    # convolution with its bias, batch norm and ReLU), or by the tensor a host transfer moves
    from lpx_tvm.app.tools.compare import watched_tensors

    assert conv["layer"] == "r" and conv["relax_name"].endswith("conv2d_1+add_2@c+batch_norm_3+batch_norm_3+relu_4@r")
    named = {r["layer"] for r in layers} - {"load input 0 [1, 3, 32, 32]", "store output 0 [1, 10]"}
    assert named == {"r", "p", "g", "y"} and named - {"y"} <= set(watched_tensors(cnn_model()))
    # spans overlap; the exclusive shares and the idle cycles add up to the program exactly
    (program,) = data["programs"].values()
    assert sum(r["exclusive_cycles"] for r in layers) + program["idle_cycles"] == pytest.approx(
        data["simulated_cycles"], rel=1e-12)
    assert all(r["end"] - r["start"] == r["cycles"] for r in layers)
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["tid"] for e in events if e["ph"] == "X"} and all(
        {"ph", "ts", "dur", "pid", "tid"} <= set(e) for e in events if e["ph"] == "X")


@pytest.mark.slow
def test_layer_too_big_for_sram_falls_back_with_a_warning(rng):
    # Relu of a [300, 2048] fp32 tensor: 2.5 MB in + 2.5 MB out, more than the tiny chip's 4 MiB
    small = weights(rng, "v", (2048, 16), 0.1)
    model = make_model([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("MatMul", ["r", "v"], ["y"])],
                       [tensor_info("x", [300, 2048])], [tensor_info("y", [300, 16])], [small])
    with pytest.warns(CapacityWarning, match="nn.relu with output \\[300, 2048\\] needs .* bytes of SRAM"):
        compiled = lpx_tvm.compile(model, config="tiny")
    assert compiled.report.host_ops == {"relax.nn.relu": 1}
    assert compiled.report.lpx_functions == 1
    x = rng.standard_normal((300, 2048)).astype(np.float32)
    assert_close(compiled(x)[0], ort_run(model, {"x": x})[0], 1e-4)


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.slow
def test_weight_bigger_than_sram_streams_from_host(rng, rows):
    # a 768x1440 fp32 weight (4.2 MiB) is more than the tiny chip's 4 MiB of SRAM: it streams
    big = weights(rng, "w", (768, 1440), 0.02)
    bias = weights(rng, "b", (1440,), 0.1)
    small = weights(rng, "v", (1440, 16), 0.1)
    model = make_model([helper.make_node("Gemm", ["x", "w", "b"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
                        helper.make_node("MatMul", ["r", "v"], ["y"])],
                       [tensor_info("x", [rows, 768])], [tensor_info("y", [rows, 16])], [big, bias, small])
    compiled = lpx_tvm.compile(model, config="tiny")
    assert compiled.report.lpx_functions == 1 and not compiled.report.host_ops, compiled.report.summary()
    (blob,) = compiled.programs.values()
    program = decode(blob)
    streams = [i for i in program.instructions if i.opcode == Opcode.STREAM]
    assert len(streams) >= 2 and sum(w.host.nbytes for w in program.streamed) == 768 * 1440 * 4
    x = rng.standard_normal((rows, 768)).astype(np.float32)
    assert_close(compiled(x)[0], ort_run(model, {"x": x})[0], 1e-4)
    stats = next(iter(compiled.simulators.values())).stats
    assert stats.host_bytes >= 768 * 1440 * 4  # every call pays for the weight on the host link


@pytest.mark.slow
def test_the_profile_names_each_streamed_weight_and_what_forced_it(rng):
    """The 768x1440 fp32 weight (4,423,680 bytes) cannot stay beside the rest in the tiny chip's 4 MiB: the
    profile lists its layer with those bytes, and the SRAM it is weighed against."""
    from lpx_tvm.app.tools.profile import profile, table

    model = make_model([helper.make_node("Gemm", ["x", "w", "b"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
                        helper.make_node("MatMul", ["r", "v"], ["y"])],
                       [tensor_info("x", [1, 768])], [tensor_info("y", [1, 16])],
                       [weights(rng, "w", (768, 1440), 0.02), weights(rng, "b", (1440,), 0.1),
                        weights(rng, "v", (1440, 16), 0.1)])
    report = profile(lpx_tvm.compile(model, config="tiny"))
    (row,) = report["streamed"]
    assert row["bytes"] == 768 * 1440 * 4 and row["layer"].startswith("matmul")
    assert "streamed 4423680 B exceed the 4194304 B of SRAM" in row["why"]
    assert f"  {row['layer']}: 4423680 B" in str(table(report))


def test_exclusive_cycles_split_each_cycle_among_the_layers_busy_in_it():
    """a busy over [0, 10), b over [5, 15), c over [20, 24): 0–5 is a's, 5–10 half each, 10–15 b's, 15–20
    nobody's, 20–24 c's."""
    from types import SimpleNamespace as NS

    from lpx_tvm.app.tools.profile import exclusive_cycles

    program = NS(layer_names=("a", "b", "c"), instructions=[NS(cycle=0, layer=0), NS(cycle=5, layer=1),
                                                             NS(cycle=20, layer=2)])
    costs = [NS(finish=10), NS(finish=10), NS(finish=4)]
    shares, idle = exclusive_cycles(program, costs)
    assert shares == {"a": 7.5, "b": 7.5, "c": 4.0}
    assert idle == 5


def test_the_timeline_draws_a_row_per_track_of_the_trace(tmp_path, capsys):
    """``profile --timeline``: a row for each track the trace has (counted here from the trace itself), in a
    figure 0.28 inches a row plus 1.6 tall at 130 dots an inch."""
    pytest.importorskip("matplotlib", reason="needs the optional dependency matplotlib (lpx-tvm[plot])")
    path = tmp_path / "cnn.onnx"
    onnx.save(cnn_model(), path)
    trace, picture = tmp_path / "trace.json", tmp_path / "timeline.png"
    assert main(["profile", str(path), "--config", "tiny", "--trace", str(trace), "--timeline", str(picture)]) == 0
    tracks = {(e["pid"], e["tid"]) for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"}
    png = picture.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    height = int.from_bytes(png[20:24], "big")  # the IHDR chunk: width, then height
    assert height == round((0.28 * len(tracks) + 1.6) * 130)


def test_under_tensor_parallelism_each_row_names_its_program_and_chip():
    """Both chips of tiny-2 run the MLP's shards: every layer appears once per chip, told apart by a program
    column (the function's number and the chip), but the output, which chip 0 alone stores; a one-program
    profile has no such column."""
    from lpx_tvm.app.tools.profile import profile, table

    report = profile(lpx_tvm.compile(mlp_model(), system="tiny-2", parallel="tensor"))
    text = str(table(report, top=0))
    assert text.startswith("| program    | layer")
    body = [line.split("|")[1:4] for line in text.splitlines()[2:] if line.startswith("| lpx")]
    by_layer = {}
    for program, layer, ops in body:
        by_layer.setdefault((layer.strip(), ops.strip()), []).append(program.strip())
    assert by_layer.pop(("store output 0 [4, 10]", "")) == ["lpx0@chip0"]
    assert by_layer and all(sorted(chips) == ["lpx0@chip0", "lpx0@chip1"] for chips in by_layer.values())
    assert not str(table(profile(lpx_tvm.compile(mlp_model(), config="tiny")))).startswith("| program")


def test_the_roofline_draws_one_series_per_bound_and_every_ceiling(tmp_path, monkeypatch):
    """The roofline of the CNN's profile: a 7 × 4.5 inch figure at 120 dots an inch (840 × 540 pixels), a scatter
    series for each bound its layers have (counted here from the profile itself), and the four ceilings a
    point can meet: the matrix peak, the vector ALUs' peak, the SRAM bandwidth and the host link."""
    pytest.importorskip("matplotlib", reason="needs the optional dependency matplotlib (lpx-tvm[plot])")
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    from lpx_tvm.app.tools import plots
    from lpx_tvm.app.tools.profile import profile

    report = profile(lpx_tvm.compile(cnn_model(), config="tiny"))
    drawn = {}
    real_save = plots._save

    def keep(plt, fig, ax, path, *labels):
        drawn["labels"] = ax.get_legend_handles_labels()[1]
        return real_save(plt, fig, ax, path, *labels)

    monkeypatch.setattr(plots, "_save", keep)
    png = plots.roofline(report, tmp_path / "roofline.png").read_bytes()
    assert (int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")) == (840, 540)
    bounds = {r["bound"] for r in report["layers"] if r["flops"] and r["bytes"]}
    assert drawn["labels"] == [f"{b}-bound layers" for b in sorted(bounds)] + [
        "matrix peak", "vector ALUs' peak", "SRAM bandwidth × intensity", "host link × intensity"]
    pyplot.close("all")
