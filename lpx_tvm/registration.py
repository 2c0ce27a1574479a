"""Register lpx with TVM the moment TVM is imported, so the simulator stays importable without TVM.

``import lpx_tvm`` must make ``tvm.compile(mod, target="lpx")`` work, yet
``import lpx_tvm.runtime_sim`` (which runs this package's ``__init__``) must not
load TVM. So ``__init__`` calls :func:`register_when_tvm_loads`: if TVM is
already imported it registers now; otherwise a one-shot import hook registers
right after ``import tvm`` finishes, whoever imports it.

What is registered: the target tag ``lpx``, the relax pipelines ``"lpx"`` and
``"default"`` (TVM's default, with lpx offload first when the target has the
``lpx`` key), the BYOC codegen ``relax.ext.lpx`` and the runtime function
``lpx.runtime.execute``; and the simulator's product of few rows by an fp16 tile becomes a kernel TVM
compiles (:mod:`.kernels.host`). The pipelines and the codegen hook import
:mod:`lpx_tvm.pipeline` only when called, so nothing here imports a module of
ours that imports TVM at its top (which could be the very module whose
``import tvm`` fired the hook).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

_STATE = {"registered": False}


def register_with_tvm() -> None:
    """Register the target tag, pipelines, codegen hook and runtime function (idempotent)."""
    if _STATE["registered"]:
        return
    _STATE["registered"] = True
    import tvm
    import tvm_ffi
    from tvm.relax import pipeline as relax_pipeline

    tvm.target.register_tag("lpx", {"kind": "llvm", "keys": ["lpx", "cpu"]}, override=True)

    def lpx(**kwargs):
        from .pipeline import lpx_pipeline
        return lpx_pipeline(**kwargs)

    def default(**kwargs):
        from .pipeline import default_pipeline
        return default_pipeline(**kwargs)

    def relax_ext_lpx(functions, options, constant_names):
        from .pipeline import relax_ext_lpx
        return relax_ext_lpx(functions, options, constant_names)

    relax_pipeline.PIPELINE_MAP["lpx"] = lpx
    relax_pipeline.PIPELINE_MAP["default"] = default
    tvm_ffi.register_global_func("relax.ext.lpx", relax_ext_lpx, override=True)
    from . import runtime  # noqa: F401  registers lpx.runtime.execute (numpy and tvm_ffi only)
    _install_host_kernels()  # the simulator's hot loops by kernels TVM compiles for this CPU


def _install_host_kernels() -> None:
    """Make :func:`.kernels.host.half_product` the simulator's product of few rows and an fp16 tile,
    :func:`.kernels.host.depthwise_sums` its depthwise convolution, :func:`.kernels.fused.kernel` the builder
    of its fused elementwise runs, and :mod:`.kernels.window` its IM2COL and max pooling. (Here, not in
    kernels.host: the fused and window kernels build on its helpers, so it cannot import them.)"""
    from .kernels import fused as fused_kernels, host as host_kernels, window as window_kernels
    from .runtime_sim import fusion, semantics

    semantics.use_half_product(host_kernels.half_product)
    semantics.use_depthwise_sums(host_kernels.depthwise_sums)
    fusion.use_elementwise_kernels(fused_kernels.kernel)
    semantics.use_window_kernels(window_kernels.im2col, window_kernels.max_pool)


class _RegisterAfterTVM(importlib.abc.MetaPathFinder):
    """Finds ``tvm`` with the other finders, and wraps its loader to register once it has run."""

    def find_spec(self, fullname, path, target=None):
        # a lookup alone (importlib.util.find_spec, as packages probe for optional ones) imports nothing: the
        # hook stays until TVM really runs
        if fullname != "tvm" or getattr(self, "_looking", False):
            return None
        self._looking = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._looking = False
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            register_with_tvm()
        spec.loader.exec_module = exec_then_register
        return spec


def register_when_tvm_loads() -> None:
    """Register now if TVM is imported, else right after it is."""
    if "tvm" in sys.modules:
        register_with_tvm()
    elif not any(isinstance(f, _RegisterAfterTVM) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterTVM())
