"""One exception root, and a CLI that tells a user's mistake from a bug in lpx-tvm (issue 52).

Every exception class of the package derives from ``LpxError`` through ``LpxUserError`` or
``LpxInternalError``; the CLI prints the first as ``lpx-tvm <command>: error: ...`` and anything else as an
internal error with a hint to rerun with ``--debug``, which prints the traceback.
"""

import importlib
import inspect
import pkgutil
import types

import onnx
import pytest

import lpx_tvm
import lpx_tvm.codegen
import lpx_tvm.runtime_sim
from lpx_tvm import LpxError, LpxInternalError, LpxUserError
from lpx_tvm.app import cli
from lpx_tvm.app.tools import zoo
from lpx_tvm.app.cli import main
from conftest import mlp_model



def package_modules() -> list:
    """Every module of the package, imported: lpx_tvm (with app), codegen and runtime_sim, walked recursively.

    codegen and runtime_sim live in folders of their own (pyproject's package-dir), so walking
    ``lpx_tvm.__path__`` alone would never reach them.
    """
    names = set()
    for package in (lpx_tvm, lpx_tvm.codegen, lpx_tvm.runtime_sim):
        names.add(package.__name__)
        names.update(info.name for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."))
    # importing __main__ would run the CLI on pytest's own arguments
    return [importlib.import_module(name) for name in sorted(names) if not name.endswith(".__main__")]


def defined_exceptions(module) -> list:
    """The exception classes ``module`` defines (not those it imports); warnings are not errors."""
    return [obj for obj in vars(module).values()
            if inspect.isclass(obj) and issubclass(obj, BaseException) and not issubclass(obj, Warning)
            and obj.__module__ == module.__name__]


def unrooted(modules) -> set:
    """Names of the exception classes in ``modules`` that reach neither LpxUserError nor
    LpxInternalError (the root itself aside: an error is one or the other, never only an LpxError)."""
    return {cls.__qualname__ for module in modules for cls in defined_exceptions(module)
            if cls is not LpxError and not issubclass(cls, (LpxUserError, LpxInternalError))}


@pytest.fixture(scope="module")
def modules():
    return package_modules()


def test_the_walk_reaches_every_folder_and_the_classes_in_them(modules):
    """(A walk that missed a folder would let the next test pass on nothing.)"""
    names = {m.__name__ for m in modules}
    for expected in ("lpx_tvm.runtime_sim.rules", "lpx_tvm.codegen.alloc", "lpx_tvm.codegen.parallel.base",
                     "lpx_tvm.frontend", "lpx_tvm.app.cli", "lpx_tvm.app.tools.sweep", "lpx_tvm.app.plan.model"):
        assert expected in names
    found = {cls.__name__ for m in modules for cls in defined_exceptions(m)}
    assert {"ProgramFormatError", "ScheduleError", "NetworkError", "CallError", "ConfigError", "LinkError",
            "LoweringError", "CapacityError", "FrontendError", "RecurrentError", "SpecError", "MissingExtraError",
            "PlanError", "SystemCompileError", "CollectiveError", "LpxError", "LpxUserError", "LpxInternalError"} <= found


def test_every_exception_class_of_the_package_derives_from_lpx_error(modules):
    left = unrooted(modules)
    assert left == set(), f"exception classes outside LpxError: {sorted(left)}"


def test_the_check_catches_an_exception_class_on_a_bare_builtin():
    """The walk's check, on a module holding what the issue forbids: it must name the class."""
    module = types.ModuleType("lpx_tvm.fake")
    exec("class FooError(ValueError):\n    pass\n"
         "class BarError(LpxUserError):\n    pass\n", {"__name__": "lpx_tvm.fake", "LpxUserError": LpxUserError},
         vars(module))
    assert unrooted([module]) == {"FooError"}


def test_the_roots_keep_the_builtins_callers_catch():
    """``except ValueError`` and ``except RuntimeError`` written before the root still catch what they did."""
    assert issubclass(LpxUserError, (LpxError, ValueError)) and not issubclass(LpxUserError, RuntimeError)
    assert issubclass(LpxInternalError, (LpxError, RuntimeError)) and not issubclass(LpxInternalError, ValueError)
    from lpx_tvm.app.models.trained import MissingExtraError
    from lpx_tvm.codegen.stages import LinkError
    from lpx_tvm.runtime_sim import ScheduleError

    assert issubclass(MissingExtraError, (LpxUserError, RuntimeError))
    assert issubclass(LinkError, (LpxInternalError, ValueError))
    assert issubclass(ScheduleError, LpxUserError)


def test_the_roots_are_one_class_from_either_door():
    assert lpx_tvm.LpxError is lpx_tvm.runtime_sim.LpxError is LpxError
    assert lpx_tvm.LpxUserError is lpx_tvm.runtime_sim.LpxUserError
    assert lpx_tvm.LpxInternalError is lpx_tvm.runtime_sim.LpxInternalError


def test_a_bad_argument_to_the_library_is_a_user_error():
    with pytest.raises(LpxUserError, match="activations must be 'int8' or 'uint8'"):
        lpx_tvm.quantize(mlp_model(), [{}], activations="int4")
    with pytest.raises(LpxUserError, match="unknown zoo models"):
        zoo.check_names(["nonesuch"])


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.endswith("\n") and err.count("\n") == 1, err
    return err.rstrip("\n")


def test_a_missing_model_is_one_user_error_line(tmp_path, capsys):
    missing = tmp_path / "missing.onnx"
    assert main(["run", str(missing)]) == 1
    assert one_line(capsys) == f"lpx-tvm run: error: FrontendError: {missing}: no such file"


def test_an_unknown_system_is_one_user_error_line(tmp_path, capsys):
    onnx.save(mlp_model(), str(tmp_path / "mlp.onnx"))
    assert main(["run", str(tmp_path / "mlp.onnx"), "--system", "nonesuch"]) == 1
    line = one_line(capsys)
    assert line.startswith("lpx-tvm run: error: ConfigError: unknown system 'nonesuch'; presets: ")
    assert "tsp-node" in line and "internal" not in line and "--debug" not in line


def test_a_bare_user_error_prints_its_message_without_the_class(capsys):
    """(``LpxUserError:`` says nothing a user can act on; a named subclass says which stage refused.)"""
    assert main(["zoo", "--models", "nonesuch"]) == 1
    assert one_line(capsys).startswith("lpx-tvm zoo: error: unknown zoo models ['nonesuch']; choose from ")


def test_a_file_the_system_cannot_read_is_the_users(tmp_path, capsys):
    missing = tmp_path / "missing.bin"
    assert main(["disasm", str(missing)]) == 1
    line = one_line(capsys)
    assert line.startswith("lpx-tvm disasm: error: FileNotFoundError: ") and str(missing) in line


def broken(exc):
    def check_names(names):
        raise exc
    return check_names


@pytest.mark.parametrize("exc", [LpxInternalError("the schedule lost a transfer"),
                                 RuntimeError("the schedule lost a transfer"),
                                 ValueError("the schedule lost a transfer")])
def test_anything_but_a_user_error_is_one_internal_error_line_with_the_debug_hint(exc, monkeypatch, capsys):
    monkeypatch.setattr(zoo, "check_names", broken(exc))
    assert main(["zoo", "--models", "squeezenet"]) == 1
    assert one_line(capsys) == (
        f"lpx-tvm zoo: internal error: {type(exc).__name__}: the schedule lost a transfer (a bug in lpx-tvm, not in "
        "your input; rerun with --debug for the traceback, and report it with that)")


@pytest.mark.parametrize("argv", [["--debug", "zoo", "--models", "squeezenet"],
                                  ["zoo", "--models", "squeezenet", "--debug"]])
def test_debug_prints_the_traceback_after_the_line(argv, monkeypatch, capsys):
    monkeypatch.setattr(zoo, "check_names", broken(LpxInternalError("the schedule lost a transfer")))
    assert main(argv) == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("lpx-tvm zoo: internal error: LpxInternalError: the schedule lost a transfer")
    assert lines[1] == "Traceback (most recent call last):"
    assert any("in check_names" in line for line in lines)  # down to the frame that raised
    assert lines[-1] == "lpx_tvm.runtime_sim.errors.LpxInternalError: the schedule lost a transfer"


def test_debug_shows_a_user_errors_traceback_too(tmp_path, capsys):
    assert main(["--debug", "run", str(tmp_path / "missing.onnx")]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("lpx-tvm run: error: FrontendError: ") and "Traceback" in lines[1]


def test_the_error_line_is_chosen_by_class():
    assert cli.is_user_error(LpxUserError("x")) and cli.is_user_error(PermissionError("x"))
    assert not cli.is_user_error(LpxInternalError("x")) and not cli.is_user_error(KeyError("x"))
    assert cli.error_line("plan", LpxUserError("first\nsecond")) == "lpx-tvm plan: error: first"


def test_debug_lasts_one_command(tmp_path):
    """After ``--debug`` the lpx_tvm logger is back at its level and the root logger has no handler more, so a
    later command in the same process keeps TVM's native output from the user again."""
    import logging

    logger, root = logging.getLogger("lpx_tvm"), logging.getLogger()
    level, handlers = logger.level, list(root.handlers)
    assert main(["--debug", "run", str(tmp_path / "missing.onnx")]) == 1
    assert (logger.level, root.handlers) == (level, handlers)
