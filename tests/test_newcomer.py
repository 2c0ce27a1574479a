"""A newcomer's frictions, one test each: the zoo as files, errors that name the fix, quiet TVM, CLI polish."""

import csv
import logging
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import cnn_model, make_model, tensor_info
from lpx_tvm.app.cli import build_parser, main
from lpx_tvm.runtime import total_offloaded_calls


def test_version_is_the_installed_one(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"lpx-tvm {version('lpx-tvm')}"


@pytest.mark.parametrize("argv, expected", [(["zoo"], False), (["--debug", "zoo"], True), (["zoo", "--debug"], True),
                                            (["run", "m.onnx", "--debug"], True)])
def test_debug_is_accepted_before_or_after_the_subcommand(argv, expected):
    assert build_parser().parse_args(argv).debug is expected


def test_zoo_help_lists_the_models_and_the_presets(capsys):
    with pytest.raises(SystemExit):
        main(["zoo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "squeezenet" in text and "ppocr_rec" in text and "tsp" in text and "tiny" in text


def test_a_config_path_that_does_not_exist_says_so_once(capsys):
    assert main(["zoo", "--models", "squeezenet", "--config", "nothere.json"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nothere.json" in err and "no such file" in err


def test_zoo_save_into_a_new_directory_writes_one_file_a_model(tmp_path, capsys):
    """The README's `lpx-tvm zoo --save models --models ...`: was one file named `models`, overwritten."""
    target = tmp_path / "models"
    assert main(["zoo", "--save", str(target), "--models", "squeezenet", "shufflenet"]) == 0
    assert sorted(p.name for p in target.iterdir()) == ["shufflenet.onnx", "squeezenet.onnx"]
    assert main(["zoo", "--save", str(tmp_path / "one.onnx"), "--models", "squeezenet", "shufflenet"]) == 1
    assert "a .onnx file holds one model" in capsys.readouterr().err


@pytest.mark.slow
def test_saved_zoo_model_has_seeded_weights_static_inputs_and_runs_on_lpx(tmp_path, capsys):
    from lpx_tvm.app.tools.zoo import constant_weights, save

    path = save("squeezenet", tmp_path)
    assert path == tmp_path / "squeezenet.onnx"
    model = onnx.load(str(path))
    assert not constant_weights(model)
    dims = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    assert dims == [1, 3, 224, 224]
    conv_weight = numpy_helper.to_array(next(i for i in model.graph.initializer if i.dims[0] == 64 and len(i.dims) == 4))
    assert conv_weight.std() > 0.01
    calls = total_offloaded_calls()
    assert main(["run", str(path)]) == 0
    out = capsys.readouterr().out
    assert "100.00% of" in out and "cosine 1" in out  # every FLOP on lpx, and ORT agrees
    assert total_offloaded_calls() > calls
    assert ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).get_inputs()[0].shape == dims


def test_run_warns_when_every_weight_is_one_constant(tmp_path):
    shape = numpy_helper.from_array(np.array([8, 3, 3, 3], np.int64), "wshape")
    nodes = [helper.make_node("ConstantOfShape", ["wshape"], ["w"],
                              value=helper.make_tensor("v", TensorProto.FLOAT, [1], [0.1])),
             helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])]
    path = tmp_path / "constant.onnx"
    onnx.save(make_model(nodes, [tensor_info("x", [1, 3, 8, 8])], [tensor_info("y", [1, 8, 8, 8])], [shape]),
              str(path))
    with pytest.warns(UserWarning, match="every weight is one constant value.*zoo --save"):
        assert main(["run", str(path), "--config", "tiny"]) == 0


def _dynamic_reshape_model(tmp_path):
    """x[N, 6] ─► Reshape to Shape(x)[0] × 2 × 3 (a shape computed at run time) ─► Relu."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
             helper.make_node("Concat", ["n", "tail"], ["target"], axis=0),
             helper.make_node("Reshape", ["x", "target"], ["r"]),
             helper.make_node("Relu", ["r"], ["y"])]
    inits = [numpy_helper.from_array(np.array([0], np.int64), "zero"),
             numpy_helper.from_array(np.array([2, 3], np.int64), "tail")]
    path = tmp_path / "dynamic.onnx"
    onnx.save(make_model(nodes, [tensor_info("x", ["N", 6])], [tensor_info("y", ["N", 2, 3])], inits), str(path))
    return path


def test_a_dynamic_input_without_a_shape_names_it_and_the_flag_to_add(tmp_path, capsys):
    path = _dynamic_reshape_model(tmp_path)
    assert main(["run", str(path), "--config", "tiny"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "input 'x' has symbolic dims ['N']" in err and "--input-shape x=N,6" in err
    assert main(["run", str(path), "--config", "tiny", "--input-shape", "x=4,6"]) == 0


def test_importer_failure_is_one_line_and_tvm_prints_nothing(tmp_path, capfd):
    path = tmp_path / "cnn.onnx"
    onnx.save(cnn_model(), str(path))
    assert main(["run", str(path), "--config", "tiny", "--input-shape", "x=1,4,32,32"]) == 1
    out, err = capfd.readouterr()
    assert err.count("\n") == 1 and "TVM's ONNX importer failed" in err and "channel" in err
    for noise in ("Metadata omitted", "BlockBuilder", "Error converting operator", "Traceback"):
        assert noise not in out + err


def test_a_wrong_rank_says_so(tmp_path, capsys):
    path = tmp_path / "cnn.onnx"
    onnx.save(cnn_model(), str(path))
    assert main(["compile", str(path), "--config", "tiny", "--input-shape", "x=1,3,32", "-o", "m.so"]) == 1
    assert "--input-shape x=1,3,32 has 3 dims, but input 'x' has 4" in capsys.readouterr().err


def test_native_output_is_kept_from_the_user_unless_debugging(capfd):
    import sys

    from lpx_tvm.diagnostics import native_output_to_log

    logger = logging.getLogger("lpx_tvm")
    for level, shown in ((logging.WARNING, False), (logging.DEBUG, True)):
        logger.setLevel(level)
        try:
            with native_output_to_log("native"):
                os.write(2, b"[12:00:00] Warning: Fast mode segfaults\n")
                print("lpx's own line", file=sys.stderr)  # Python's stderr still reaches the user
        finally:
            logger.setLevel(logging.NOTSET)
        err = capfd.readouterr().err
        assert ("Fast mode segfaults" in err) is shown
        assert "lpx's own line" in err


def test_compile_emits_the_program_and_disasm_names_the_attributes(tmp_path, capsys):
    from lpx_tvm.runtime_sim import decode

    path = tmp_path / "cnn.onnx"
    onnx.save(cnn_model(), str(path))
    program = tmp_path / "cnn.bin"
    assert main(["compile", str(path), "--config", "tiny", "--emit-program", str(program)]) == 0
    assert decode(program.read_bytes()).inputs[0].shape == (1, 3, 32, 32)
    capsys.readouterr()
    assert main(["disasm", str(program)]) == 0
    text = capsys.readouterr().out
    assert "MATMUL" in text and "buffer=" in text and "index=" in text


@pytest.mark.slow
def test_zoo_csv_follows_the_table_and_a_summary_line_counts(tmp_path, capsys):
    from lpx_tvm.app.tools.zoo import COLUMNS

    table = tmp_path / "zoo.csv"
    assert main(["zoo", "--models", "squeezenet", "--skip-llvm", "--csv", str(table)]) == 0
    out = capsys.readouterr().out
    assert "1/1 ok; peak memory" in out and "peak MB" in out
    header = next(csv.reader(table.open()))
    assert header[:len(COLUMNS)] == [key for key, _ in COLUMNS]


def test_a_compiled_model_is_called_with_the_onnx_input_names(rng):
    from conftest import weights

    nodes = [helper.make_node("MatMul", ["past_key_values.0.key", "w"], ["y"])]
    model = make_model(nodes, [tensor_info("past_key_values.0.key", [4, 16])], [tensor_info("y", [4, 8])],
                       [weights(rng, "w", (16, 8))])
    import lpx_tvm

    compiled = lpx_tvm.compile(model, config="tiny")
    assert [name for name, _, _ in compiled.input_signature] == ["past_key_values.0.key"]
    x = rng.standard_normal((4, 16)).astype(np.float32)
    calls = total_offloaded_calls()
    (y,) = compiled(**{"past_key_values.0.key": x})
    assert total_offloaded_calls() == calls + 1
    np.testing.assert_allclose(y, x @ numpy_helper.to_array(model.graph.initializer[0]), rtol=1e-5, atol=1e-5)


def test_run_takes_its_inputs_from_an_npz_and_seeds_what_it_leaves_out(tmp_path, capsys):
    """z = x + y: x from the file, y seeded (a standard normal, seed 1, as ``seeded_inputs`` draws it); the
    printed mean is the mean of x + y, and ONNX Runtime on the same feeds agrees."""
    from conftest import add_model

    path = tmp_path / "add.onnx"
    onnx.save(add_model(4, 8), path)
    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    np.savez(tmp_path / "x.npz", x=x)
    assert main(["run", str(path), "--inputs", str(tmp_path / "x.npz")]) == 0
    out = capsys.readouterr().out
    rng = np.random.default_rng(1)
    rng.standard_normal((4, 8))  # x's draw, replaced by the file's
    y = rng.standard_normal((4, 8)).astype(np.float32)
    assert f"mean {float((x + y).mean()):.6g}" in out and "cosine 1" in out


@pytest.mark.parametrize("arrays, message", [
    ({"w": np.zeros((4, 8), np.float32)}, "the model has no input 'w' (its inputs: x, y)"),
    ({"x": np.zeros((4, 9), np.float32)}, "'x' is float32[4, 9], the model takes float32[4, 8]"),
    ({"x": np.zeros((4, 8), np.float64)}, "'x' is float64[4, 8], the model takes float32[4, 8]"),
])
def test_inputs_that_do_not_fit_the_model_are_named(tmp_path, capsys, arrays, message):
    from conftest import add_model

    path = tmp_path / "add.onnx"
    onnx.save(add_model(4, 8), path)
    np.savez(tmp_path / "in.npz", **arrays)
    assert main(["run", str(path), "--inputs", str(tmp_path / "in.npz")]) == 1
    assert message in capsys.readouterr().err


def test_quantize_writes_a_qdq_model_that_runs_int8_on_lpx(tmp_path, capsys):
    """``lpx-tvm quantize`` is ONNX Runtime's static quantiser on seeded inputs: its model runs with
    --dtype int8, both Gemms as int8 MATMULs on the planes, within one output step of ORT on the QDQ model."""
    from conftest import mlp_model, ort_run
    from lpx_tvm.app.tools.zoo import output_step
    from lpx_tvm.runtime_sim import DType, Opcode, decode

    import lpx_tvm

    onnx.save(mlp_model(), tmp_path / "mlp.onnx")
    assert main(["quantize", str(tmp_path / "mlp.onnx"), "-o", str(tmp_path / "mlp8.onnx"), "--seeded", "2"]) == 0
    assert "calibrated on 2 seeded input(s)" in capsys.readouterr().out
    qdq = onnx.load(tmp_path / "mlp8.onnx")
    compiled = lpx_tvm.compile(qdq, config="tiny", dtype="int8")
    products = [i for blob in compiled.programs.values() for i in decode(blob).instructions
                if i.opcode == Opcode.MATMUL]
    assert products and {i.srcs[0].dtype for i in products} <= {DType.I8, DType.U8}
    x = np.random.default_rng(7).standard_normal((4, 64)).astype(np.float32)
    calls = total_offloaded_calls()
    (out,) = compiled(x)
    assert total_offloaded_calls() - calls == 1  # Gemm, Relu, Gemm and their Q/DQ: one program, run once
    steps = np.rint(np.abs(out - ort_run(qdq, {"x": x})[0]) / output_step(qdq))
    assert steps.max() <= 1


def test_int8_on_a_float_model_quantises_it_on_seeded_inputs_and_says_so(tmp_path, capsys):
    """``run --dtype int8`` on an fp32 file: quantised first (a note says how, and how to calibrate better),
    then run int8 and compared with ONNX Runtime on the same QDQ model: the output's cosine is printed."""
    from conftest import mlp_model

    onnx.save(mlp_model(), tmp_path / "mlp.onnx")
    calls = total_offloaded_calls()
    assert main(["run", str(tmp_path / "mlp.onnx"), "--dtype", "int8", "--config", "tiny"]) == 0
    assert total_offloaded_calls() - calls == 1  # the whole QDQ model is one lpx program, run once
    captured = capsys.readouterr()
    assert "is a float model: quantised with ONNX Runtime's static quantiser on 4 seeded inputs" in captured.err
    cosine = float(captured.out.rsplit("cosine ", 1)[1].split()[0])
    assert cosine >= 0.999


def test_an_unpinned_model_that_would_run_wholly_on_the_host_is_an_error_naming_its_dims(rng):
    """x [batch, 64] @ w: with batch symbolic nothing can be offloaded, and compiling it anyway gave a model that
    ran on the host behind a warning. Now the error names the dim and the fix; pinned, it runs on lpx."""
    import lpx_tvm
    from conftest import run_on_lpx, weights

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 10])
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["y"])], [x], [y], [weights(rng, "w", (64, 10))])
    with pytest.warns(UserWarning, match="symbolic dims"), pytest.raises(
            lpx_tvm.FrontendError, match=r"nothing can run on lpx until the shapes are pinned: input 'x' has "
                                         r"symbolic dims \['batch'\] \(add --input-shape x=batch,64"):
        lpx_tvm.compile(model, config="tiny")
    compiled = lpx_tvm.compile(model, config="tiny", input_shapes={"x": [4, 64]})
    run_on_lpx(compiled, [np.ones((4, 64), np.float32)], programs=1)
