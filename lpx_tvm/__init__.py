"""lpx-tvm: an inference compiler flow on Apache TVM (Relax) for the LPX processor.

Importing this package registers the ``lpx.*`` patterns, the codegen
``relax.ext.lpx``, the relax pipeline ``"lpx"``, the target tag ``"lpx"`` and the
runtime function ``lpx.runtime.execute``.
"""

from . import runtime  # registers lpx.runtime.execute
from .patterns import partition_for_lpx, pattern_table
from .pipeline import NothingOffloadedWarning, lpx_pipeline, register as _register
from .frontend import FrontendError, from_onnx
from .compiler import CompiledModel, compile
from .quantize import quantize

_register()

__all__ = ["partition_for_lpx", "pattern_table", "lpx_pipeline", "from_onnx", "compile", "CompiledModel",
           "FrontendError", "NothingOffloadedWarning", "quantize", "runtime"]
