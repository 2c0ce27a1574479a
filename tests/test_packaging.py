"""The simulator stands alone; the library never imports the application on top of it."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_runtime_sim_imports_neither_tvm_nor_onnx():
    code = ("import sys, lpx_tvm.runtime_sim as r; r.Simulator; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tvm', 'tvm_ffi', 'onnx', 'onnxruntime')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout


@pytest.mark.slow
def test_importing_lpx_tvm_registers_with_tvm_when_tvm_is_imported():
    code = ("import sys, lpx_tvm; assert 'tvm' not in sys.modules; import tvm, tvm_ffi; "
            "print(list(tvm.target.Target('lpx').keys), tvm_ffi.get_global_func('lpx.runtime.execute') is not None, "
            "tvm_ffi.get_global_func('relax.ext.lpx') is not None)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "['lpx', 'cpu'] True True", done.stdout


_PACKAGES = {"lpx_tvm": ("lpx_tvm",), "codegen": ("lpx_tvm", "codegen"), "runtime_sim": ("lpx_tvm", "runtime_sim")}


def _imports(path: Path) -> set:
    """Every module ``path`` imports, relative imports made absolute (``...runtime_sim`` in codegen/parallel is
    ``lpx_tvm.runtime_sim``)."""
    folder = path.relative_to(ROOT).parts
    package = _PACKAGES[folder[0]] + folder[1:-1]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                names.add(".".join(base + ((node.module,) if node.module else ())))
            else:
                names.add(node.module)
    return names


def _files(folder: str):
    """Every Python file of a folder, its subfolders' too."""
    return sorted((ROOT / folder).rglob("*.py"))


def test_the_layering_walks_every_folder():
    assert ROOT / "codegen" / "parallel" / "collectives.py" in _files("codegen")
    assert "lpx_tvm.runtime_sim.system" in _imports(ROOT / "codegen" / "parallel" / "collectives.py")


def test_runtime_sim_imports_only_numpy_ml_dtypes_and_the_standard_library():
    allowed = {"numpy", "ml_dtypes"} | set(sys.stdlib_module_names)
    for path in _files("runtime_sim"):
        for name in _imports(path):
            assert name.startswith("lpx_tvm.runtime_sim") or name.split(".")[0] in allowed, f"{path.name} imports {name}"


def test_the_library_never_imports_the_application():
    for folder in ("lpx_tvm", "codegen", "runtime_sim"):
        for path in _files(folder):
            if "app" in path.relative_to(ROOT).parts:
                continue
            for name in _imports(path):
                assert not name.startswith("lpx_tvm.app"), f"{path} imports {name}"


def test_codegen_does_not_import_the_tvm_face():
    for path in _files("codegen"):
        for name in _imports(path):
            assert not name.startswith("lpx_tvm.") or name.split(".")[1] in ("codegen", "runtime_sim"), \
                f"{path} imports {name}"


def test_every_package_folder_is_installed():
    """pyproject lists its packages by name (codegen/ and runtime_sim/ are mapped under lpx_tvm): a folder with an
    __init__.py that is not listed is missing from a wheel (codegen/parallel was)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for folder, prefix in (("lpx_tvm", ("lpx_tvm",)), ("codegen", ("lpx_tvm", "codegen")),
                           ("runtime_sim", ("lpx_tvm", "runtime_sim"))):
        for init in (ROOT / folder).rglob("__init__.py"):
            found.add(".".join(prefix + init.parent.relative_to(ROOT / folder).parts))
    assert found == listed
