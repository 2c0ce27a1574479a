"""Bad input gets a clear error naming what was wrong; untrusted programs never run unverified."""

import re
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

import lpx_tvm
from lpx_tvm.app.cli import main
from lpx_tvm.runtime_sim import ProgramFormatError, decode
from conftest import cnn_model, mlp_model, ort_run, assert_close

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def mlp():
    return lpx_tvm.compile(mlp_model(), config="tiny")


def test_malformed_onnx_file_is_named(tmp_path):
    bad = tmp_path / "broken.onnx"
    bad.write_bytes(b"this is not protobuf \x00\xff" * 10)
    with pytest.raises(lpx_tvm.FrontendError, match="broken.onnx"):
        lpx_tvm.from_onnx(bad)
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(mlp_model().SerializeToString()[:50])
    with pytest.raises(lpx_tvm.FrontendError, match="truncated.onnx"):
        lpx_tvm.from_onnx(truncated)


def test_cli_errors_are_one_line_without_traceback(tmp_path, capsys):
    bad = tmp_path / "broken.onnx"
    bad.write_bytes(b"garbage")
    for argv in (["run", str(bad)], ["compile", str(bad), "-o", str(tmp_path / "x.so")],
                 ["profile", str(tmp_path / "missing.onnx")], ["disasm", str(bad)]):
        assert main(argv) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("argv, message", [
    (["profile", "model.onnx", "--top", "-2"], "argument --top: invalid non-negative integer value: '-2'"),
    (["bench", "--repeat", "0"], "argument --repeat: invalid positive integer value: '0'"),
    (["sweep", "spec.toml", "--workers", "-1"], "argument --workers: invalid non-negative integer value: '-1'"),
])
def test_cli_counts_below_their_least_are_named(argv, message, capsys):
    """(--top -2 showed all but the last two layers; the others reached the code that used them.)"""
    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["compile", "m.onnx", "-o", "{missing}/m.so"], "-o/--output {missing}/m.so: the folder {missing} does not exist"),
    (["compile", "m.onnx", "--emit-program", "{missing}/m.bin"],
     "--emit-program {missing}/m.bin: the folder {missing} does not exist"),
    (["plan", "--model", "llama-tiny", "--json", "{missing}/p.json"],
     "--json {missing}/p.json: the folder {missing} does not exist"),
    (["run", "m.onnx", "--parallel", "tensor"], "--parallel needs --system"),
    (["profile", "m.onnx", "--chips", "2"], "--chips needs --system"),
    (["compare", "{model}", "--min-cosine", "5"], "min_cosine must be a cosine, in [-1, 1], got 5.0"),
])
def test_cli_arguments_that_would_fail_after_the_work_are_named_before_it(argv, message, tmp_path, capsys):
    """(A missing output folder failed after the whole compile, --parallel and --chips without --system were
    ignored, and a minimum cosine of 5 had every layer part ways.)"""
    import onnx

    onnx.save(mlp_model(), str(tmp_path / "mlp.onnx"))
    where = {"missing": str(tmp_path / "missing"), "model": str(tmp_path / "mlp.onnx")}
    assert main([a.format(**where) for a in argv]) == 1
    assert message.format(**where) in capsys.readouterr().err


@pytest.mark.parametrize("given, message", [
    ({"parallel": "tensor"}, r"parallel='tensor' needs a system of chips to run on"),
    ({"chips": 2}, r"chips=2 needs a system of chips to run on"),
    ({"state": "x"}, r"state must be a sequence of input names, got 'x'"),
    ({"dump_dir": 5}, r"dump_dir must be a folder's path, got 5"),
])
def test_compile_options_that_would_be_ignored_or_misread_are_named(given, message):
    """(Without a system, parallel and chips were ignored; a state of one name was read letter by letter, and a
    one-letter input name made it resident; a dump folder of 5 died in os.fspath, naming no option.)"""
    with pytest.raises(ValueError, match=message):
        lpx_tvm.compile(mlp_model(), config="tiny", **given)


def test_wrong_inputs_name_expected_and_given(mlp):
    with pytest.raises(ValueError, match=r"expected float32\[4, 64\], got float32\[4, 63\]"):
        mlp(np.zeros((4, 63), np.float32))
    with pytest.raises(ValueError, match=r"expected float32\[4, 64\], got float64\[4, 64\]"):
        mlp(np.zeros((4, 64), np.float64))
    with pytest.raises(ValueError, match="takes 1 inputs"):
        mlp(np.zeros((4, 64), np.float32), np.zeros((4, 64), np.float32))


def test_input_shape_pins_a_dynamic_dimension(rng):
    model = mlp_model()
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    compiled = lpx_tvm.compile(model, config="tiny", input_shapes={"x": [4, 64]})
    x = rng.standard_normal((4, 64)).astype(np.float32)
    assert_close(compiled(x)[0], ort_run(mlp_model(), {"x": x})[0], 1e-4)
    assert compiled.report.lpx_functions == 1


@pytest.mark.parametrize("shapes, message", [
    ({"x": "ab"}, r"--input-shape x: its dims must be positive integers, got 'ab'"),
    ({"x": (4, -64)}, r"--input-shape x: its dims must be positive integers, got \(4, -64\)"),
    ({"x": 5}, r"--input-shape x: its dims must be positive integers, got 5"),
    ([("x", (4, 64))], r"input shapes must be a dict of input name -> dims, got \[\('x', \(4, 64\)\)\]"),
])
def test_bad_input_shapes_are_named(shapes, message):
    """(Each used to die in int() or on .items(), naming neither the option nor the input.)"""
    from lpx_tvm.frontend import FrontendError

    with pytest.raises(FrontendError, match=message):
        lpx_tvm.compile(mlp_model(), config="tiny", input_shapes=shapes)


def test_a_simulator_of_something_not_a_program_is_named():
    from lpx_tvm.runtime_sim import Simulator

    with pytest.raises(TypeError, match="Simulator takes a Program, its ProgramColumns or its encoded bytes, "
                                        "got NoneType"):
        Simulator(None)


def test_dynamic_shapes_offload_the_static_part_and_fall_back_on_the_rest(rng):
    """x[N, 64] ─► Gemm ─► Relu ─► ReduceMean over N ─► [1, 32] ─► Gemm ─► Relu: the tail is static."""
    from onnx import helper

    from conftest import make_model, tensor_info, weights
    from lpx_tvm.runtime import total_offloaded_calls

    inits = [weights(rng, "w1", (32, 64)), weights(rng, "b1", (32,)),
             weights(rng, "w2", (10, 32)), weights(rng, "b2", (10,))]
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], transB=1), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("ReduceMean", ["r"], ["p"], axes=[0], keepdims=1),
             helper.make_node("Gemm", ["p", "w2", "b2"], ["z"], transB=1), helper.make_node("Relu", ["z"], ["y"])]
    model = make_model(nodes, [tensor_info("x", ["N", 64])], [tensor_info("y", [1, 10])], inits)
    compiled = lpx_tvm.compile(model, config="tiny")
    report = compiled.report
    assert compiled.input_signature == [("x", (None, 64), "float32")]
    assert report.lpx_functions == 1
    # on lpx: the second Gemm on the static [1, 32] mean, 2·32·10 = 640, its bias add 10 and ReLU 10
    assert report.flops_offloaded == 640 + 10 + 10
    # on the host: the first Gemm's product, bias add and ReLU on [N, 32] (dynamic), and the mean ([1, 32])
    assert report.host_ops == {"relax.matmul": 1, "relax.add": 1, "relax.nn.relu": 1, "relax.mean": 1}
    assert report.dynamic_host_ops == 3
    assert "dynamic shapes" in report.summary()
    for batch in (3, 7):  # one executable serves every batch size
        x = rng.standard_normal((batch, 64)).astype(np.float32)
        before = total_offloaded_calls()
        assert_close(compiled(x)[0], ort_run(model, {"x": x})[0], 1e-4)
        assert total_offloaded_calls() - before == 1
    with pytest.raises(ValueError, match=r"expected float32\[\?, 64\], got float32\[3, 63\]"):
        compiled(np.zeros((3, 63), np.float32))


@pytest.mark.slow
def test_two_threads_share_one_executable(rng):
    compiled = lpx_tvm.compile(cnn_model(), config="tiny")
    inputs = [rng.standard_normal((1, 3, 32, 32)).astype(np.float32) for _ in range(2)]
    expected = [compiled(x)[0] for x in inputs]
    results, errors = {}, []

    def work(i):
        try:
            for _ in range(20):
                out = compiled(inputs[i])[0]
                assert np.array_equal(out, expected[i])
            results[i] = True
        except Exception as err:  # collected and asserted below
            errors.append(err)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == {0: True, 1: True}


@pytest.fixture(scope="module")
def program_blob(mlp):
    (blob,) = mlp.programs.values()
    return blob


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                    HealthCheck.too_slow])
@given(data=st.data())
@pytest.mark.slow
def test_decoder_only_raises_its_own_error(program_blob, data):
    kind = data.draw(st.sampled_from(["random", "flip", "truncate", "splice"]))
    if kind == "random":
        blob = data.draw(st.binary(max_size=512))
    elif kind == "flip":
        blob = bytearray(program_blob)
        for _ in range(data.draw(st.integers(1, 8))):
            pos = data.draw(st.integers(0, len(blob) - 1))
            blob[pos] ^= 1 << data.draw(st.integers(0, 7))
        blob = bytes(blob)
    elif kind == "truncate":
        blob = program_blob[:data.draw(st.integers(0, len(program_blob) - 1))]
    else:
        blob = program_blob[:40] + data.draw(st.binary(max_size=256))
    assume(blob != program_blob)  # two flips of one bit give the original back
    with pytest.raises(ProgramFormatError):
        decode(blob)


def test_a_program_whose_version_field_is_changed_to_an_older_format_fails_its_checksum(program_blob):
    """An older format's reading of a newer body may parse too (a program without streamed weights has the
    same bytes in 9 as in 10, and 9's constant kinds fall in 8's padding). The checksum covers the version, so
    the older reading is never taken."""
    for older in (10, 9, 8):
        blob = bytearray(program_blob)
        assert blob[8:10] == bytes([11, 0])
        blob[8] = older
        with pytest.raises(ProgramFormatError, match="checksum mismatch"):
            decode(bytes(blob))


def test_no_pickle_or_eval_in_the_project():
    pattern = re.compile(r"\bimport pickle\b|\bpickle\.|\beval\(|\bexec\(|\bcloudpickle\b")
    offenders = []
    for folder in ("lpx_tvm", "codegen", "runtime_sim", "scripts"):
        for path in (ROOT / folder).rglob("*.py"):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, offenders


def test_unknown_op_and_unsupported_opset_are_named():
    from onnx import helper
    from conftest import make_model, tensor_info

    unknown = make_model([helper.make_node("FancyOp", ["x"], ["y"])], [tensor_info("x", [2, 3])],
                         [tensor_info("y", [2, 3])], [])
    with pytest.raises(lpx_tvm.FrontendError, match="FancyOp"):
        lpx_tvm.from_onnx(unknown)
    future = make_model([helper.make_node("Relu", ["x"], ["y"])], [tensor_info("x", [2, 3])],
                        [tensor_info("y", [2, 3])], [])
    future.opset_import[0].version = 99
    with pytest.raises(lpx_tvm.FrontendError, match="unsupported opset 99"):
        lpx_tvm.from_onnx(future)


@pytest.mark.slow
def test_cli_warnings_are_one_line_and_the_format_is_restored(tmp_path, rng):
    import subprocess
    import sys
    import warnings

    from onnx import helper

    from conftest import make_model, tensor_info

    # Relu of 2.5 MB in and out cannot fit the tiny chip's 4 MiB: a CapacityWarning, then the run goes on
    model = make_model([helper.make_node("Relu", ["x"], ["y"])], [tensor_info("x", [300, 2048])],
                       [tensor_info("y", [300, 2048])], [])
    path = tmp_path / "big_relu.onnx"
    path.write_bytes(model.SerializeToString())
    done = subprocess.run([sys.executable, "-m", "lpx_tvm.app", "run", str(path), "--config", "tiny"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "CapacityWarning" in line]
    assert len(lines) == 1 and lines[0].startswith("lpx-tvm: warning: CapacityWarning: lpx: nn.relu"), done.stderr
    assert "Traceback" not in done.stderr
    before = warnings.formatwarning
    assert main(["run", str(path), "--config", "tiny"]) == 0
    assert warnings.formatwarning is before  # the CLI as a library call leaves the process as it found it


@pytest.fixture(scope="module")
def signed_program_blobs():
    from onnx import helper

    from conftest import make_model, tensor_info, weights

    rng = np.random.default_rng(0)
    model = make_model([helper.make_node("Conv", ["x", "w", "b"], ["c"], group=4, pads=[1, 1, 1, 1]),
                        helper.make_node("Relu", ["c"], ["r"]),
                        helper.make_node("Conv", ["r", "p"], ["y"], pads=[1, 1, 1, 1])],
                       [tensor_info("x", [1, 4, 6, 6])], [tensor_info("y", None)],
                       [weights(rng, "w", (4, 1, 3, 3)), weights(rng, "b", (4,)), weights(rng, "p", (8, 4, 3, 3))])
    qdq = lpx_tvm.quantize(model, [{"x": rng.standard_normal((1, 4, 6, 6)).astype(np.float32)}])
    blobs = list(lpx_tvm.compile(qdq, config="tiny", dtype="int8").programs.values())
    return blobs + list(lpx_tvm.compile(cnn_model(), config="tiny", dtype="fp16").programs.values())


def _re_signed(body: bytes) -> bytes:
    """``body`` under a header of the test's own making: the format's magic and version, and the version-keyed
    16-byte blake2b of the body (as the format states it, not by calling the library's sealing)."""
    import hashlib
    import struct

    from lpx_tvm.runtime_sim.container import HEADER as _HEADER
    from lpx_tvm.runtime_sim.program import MAGIC, VERSION

    digest = hashlib.blake2b(body, digest_size=16, person=struct.pack("<H", VERSION)).digest()
    return _HEADER.pack(MAGIC, VERSION, 0, len(body), digest) + body


@pytest.mark.slow
def test_an_undamaged_program_re_signed_by_the_test_decodes_and_runs_as_it_came(signed_program_blobs):
    """The damage test below re-signs damaged bodies; here the re-signing alone: on an undamaged body it gives
    back the compiler's very bytes, which decode and run to the same outputs as the program as compiled (else
    every damaged body would be rejected by its checksum, and nothing behind it tested)."""
    from lpx_tvm.runtime_sim import Simulator
    from lpx_tvm.runtime_sim.container import HEADER as _HEADER

    rng = np.random.default_rng(3)
    for blob in signed_program_blobs:
        signed = _re_signed(bytes(blob[_HEADER.size:]))
        assert signed == bytes(blob)
        sim, again = Simulator(decode(bytes(blob))), Simulator(decode(signed))
        inputs = [(rng.standard_normal(t.shape) * 2).astype(t.dtype.np) for t in sim.inputs]
        for got, want in zip(again.run(inputs), sim.run(inputs), strict=True):
            np.testing.assert_array_equal(got, want)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(data=st.data())
@pytest.mark.slow
def test_re_signed_damage_is_rejected_or_runs(signed_program_blobs, data):
    """Damage behind a valid checksum (a buggy or hostile compiler): the checks after the checksum hold too.
    Rejected damage is named in one line (never by the checksum: the body was re-signed, and the test above
    shows the re-signing is the format's); accepted damage is a program the rules allow, by the rules'
    plain instruction-by-instruction statement as well as the whole-program check, and it reads back as the
    bytes it came from (nothing misread or repaired), and runs."""
    from lpx_tvm.runtime_sim import Simulator
    from lpx_tvm.runtime_sim.check import check_timing
    from lpx_tvm.runtime_sim.container import HEADER as _HEADER
    from lpx_tvm.runtime_sim.program import encode

    blob = data.draw(st.sampled_from(signed_program_blobs))
    body = bytearray(blob[_HEADER.size:])
    for _ in range(data.draw(st.integers(1, 4))):
        body[data.draw(st.integers(0, len(body) - 1))] = data.draw(st.integers(0, 255))
    signed = _re_signed(bytes(body))
    try:
        program = decode(signed)
        sim = Simulator(program)
    except ProgramFormatError as err:
        assert str(err) and "\n" not in str(err)
        assert "checksum" not in str(err)
        return
    walked = check_timing(program, sim.config, sim.resident, sim.sram_size, sim.protected)
    assert walked.makespan == sim.stats.cycles == program.predicted_cycles
    assert bytes(encode(program)) == signed
    outputs = sim.run([np.zeros(t.shape, t.dtype.np) for t in sim.inputs])
    assert [o.shape for o in outputs] == [t.shape for t in sim.outputs]
