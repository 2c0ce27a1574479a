"""The simulator stands alone; the library never imports the application on top of it."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_runtime_sim_imports_neither_tvm_nor_onnx():
    code = ("import sys, lpx_tvm.runtime_sim as r; r.Simulator; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tvm', 'tvm_ffi', 'onnx', 'onnxruntime')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout


def test_importing_lpx_tvm_registers_with_tvm_when_tvm_is_imported():
    code = ("import sys, lpx_tvm; assert 'tvm' not in sys.modules; import tvm, tvm_ffi; "
            "print(list(tvm.target.Target('lpx').keys), tvm_ffi.get_global_func('lpx.runtime.execute') is not None, "
            "tvm_ffi.get_global_func('relax.ext.lpx') is not None)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "['lpx', 'cpu'] True True", done.stdout


def _imports(path: Path) -> set:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add(("." * node.level) + (node.module or ""))
    return names


def test_runtime_sim_imports_only_numpy_ml_dtypes_and_the_standard_library():
    allowed = {"numpy", "ml_dtypes"} | set(sys.stdlib_module_names)
    for path in (ROOT / "runtime_sim").glob("*.py"):
        for name in _imports(path):
            assert name.startswith(".") or name.split(".")[0] in allowed, f"{path.name} imports {name}"


def test_the_library_never_imports_the_application():
    for folder in ("lpx_tvm", "codegen", "runtime_sim"):
        for path in (ROOT / folder).glob("*.py"):
            for name in _imports(path):
                assert ".app" not in name and not name.startswith("lpx_tvm.app"), f"{path} imports {name}"


def test_codegen_does_not_import_the_tvm_face():
    for path in (ROOT / "codegen").glob("*.py"):
        for name in _imports(path):
            assert not name.startswith("lpx_tvm") and not (name.startswith("..") and name[2:].split(".")[0] in
                                                            ("patterns", "pipeline", "compiler", "frontend")), name
