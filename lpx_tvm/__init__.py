"""lpx-tvm: an inference compiler flow on Apache TVM (Relax) for the LPX processor.

Importing this package registers lpx with TVM (the ``lpx.*`` patterns when they
are first used, the codegen ``relax.ext.lpx``, the relax pipeline ``"lpx"``, the
target tag ``"lpx"`` and the runtime function ``lpx.runtime.execute``) as soon as
TVM is imported, so ``import lpx_tvm.runtime_sim`` alone loads neither TVM nor
onnx. The TVM face (``compile``, ``from_onnx``, ``partition_for_lpx``, ...) is
imported on first use.
"""

from __future__ import annotations

import importlib

from .registration import register_when_tvm_loads

_API = {
    "compile": "compiler", "CompiledModel": "compiler", "compile_programs": "compiler",
    "from_onnx": "frontend", "FrontendError": "frontend",
    "partition_for_lpx": "patterns", "pattern_table": "patterns",
    "lpx_pipeline": "pipeline", "NothingOffloadedWarning": "pipeline",
    "quantize": "quantization", "from_pytorch": "pytorch",
    "LpxError": "runtime_sim.errors", "LpxUserError": "runtime_sim.errors", "LpxInternalError": "runtime_sim.errors",
}
_SUBMODULES = ("codegen", "compiler", "frontend", "patterns", "pipeline", "pytorch", "quantization", "report",
               "runtime", "runtime_sim")

__all__ = sorted(_API) + ["runtime"]


def __getattr__(name: str):
    if name in _API:
        return getattr(importlib.import_module(f".{_API[name]}", __name__), name)
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'lpx_tvm' has no attribute {name!r}")


register_when_tvm_loads()
