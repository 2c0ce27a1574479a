"""A compiled model as a shared library, its large constants kept out of TVM's serialiser.

TVM packs an executable's constants (our programs, mostly weights, and the host's
weights) into the library through two whole copies in memory: a model of 2 GB
needed 8 GB to export. Here every constant of :data:`STORED_MIN_BYTES` or more is
written once, from where it lies, into a section of the library of its own, and
the executable is built again with each such constant replaced by a call,
``lpx.runtime.stored``, that views it in the loaded library (:mod:`.runtime`):
the executable TVM packs is small, and a reloaded library maps its weights from
the file instead of copying them.

The section begins with a header (:data:`MAGIC`, the export's id, the data's length)
under the symbol ``__lpx_stored_<id>``; the id is random, so two libraries loaded in
one process never share one.
"""

from __future__ import annotations

import os
import secrets
import struct
import tempfile

import numpy as np
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .runtime import STORED, STORED_HEADER, STORED_MAGIC
from .runtime_sim.errors import LpxUserError

STORED_MIN_BYTES = 1 << 20  # (smaller constants stay in the executable: a call each time costs more than they do)
_ALIGN = 64


class _Stored:
    """The large constants of one export: where each lies in the section, written once however often used."""

    def __init__(self):
        self.id = secrets.token_hex(8)
        self.arrays = []
        self.offsets = {}  # (address, bytes, dtype, shape) -> offset in the section's data
        self.nbytes = 0

    def offset(self, array: np.ndarray) -> int:
        key = (array.ctypes.data, array.nbytes, array.dtype.str, array.shape)
        if key not in self.offsets:
            self.offsets[key] = self.nbytes
            self.arrays.append(array)
            self.nbytes += -(-array.nbytes // _ALIGN) * _ALIGN
        return self.offsets[key]

    def write(self, path: str) -> None:
        """The section's bytes: the header, then each array at its offset (written from where it lies)."""
        with open(path, "wb") as out:
            out.write(struct.pack(STORED_HEADER, STORED_MAGIC, self.id.encode(), self.nbytes).ljust(_ALIGN, b"\0"))
            for array in self.arrays:
                out.write(memoryview(np.ascontiguousarray(array)).cast("B"))
                out.write(b"\0" * (-array.nbytes % _ALIGN))


@mutator
class _StoreLargeConstants(PyExprMutator):
    def __init__(self, mod, stored: _Stored):
        super().__init__(mod)
        self.stored = stored

    def visit_generic_const_(self, const):
        array = np.from_dlpack(const.value) if isinstance(const.value, tvm.runtime.Tensor) else None
        if array is None or array.nbytes < STORED_MIN_BYTES:
            return const
        shape = ",".join(map(str, array.shape))
        return relax.op.call_pure_packed(STORED, self.stored.id, self.stored.offset(array), array.dtype.str, shape,
                                         ty_args=const.ty)


def write_library(lowered: tvm.IRModule, path) -> None:
    """Build ``lowered`` (the module a compile built, its programs in it) with its large constants stored beside
    the executable in the library, and write the library to ``path`` (``tvm.runtime.load_module`` reloads it)."""
    stored = _Stored()
    rewriter = _StoreLargeConstants(lowered, stored)
    for gvar, func in lowered.functions.items():
        if isinstance(func, relax.Function):
            rewriter.builder_.update_func(gvar, rewriter.visit_expr(func))
    module = rewriter.builder_.get()
    executable = tvm.compile(module, target="lpx", relax_pipeline=relax.pipeline.default_build_pipeline())
    with tempfile.TemporaryDirectory() as workspace:
        section = os.path.join(workspace, "lpx_stored.bin")
        stored.write(section)
        packer = _Packer(stored.id, section)
        executable.export_library(str(path), fpack_imports=packer, workspace_dir=workspace)


class _Packer:
    """TVM's ``fpack_imports``: the serialised executable (small now) and the stored constants, each named
    from an assembler source by ``.incbin``, which the C compiler links in (TVM would build an LLVM constant
    of the same bytes)."""

    def __init__(self, stored_id: str, section: str):
        self.stored_id, self.section = stored_id, section

    def __call__(self, mod, is_system_lib: bool, prefix: str, workspace: str) -> str:
        from tvm.runtime import _ffi_api

        if is_system_lib:  # (lpx_tvm exports a shared library only; a system library's symbol is prefixed)
            raise LpxUserError("lpx_tvm exports shared libraries, not system libraries")
        blob = _ffi_api.ModulePackImportsToTensor(mod)
        data = os.path.join(workspace, f"{prefix}devc.bin")
        np.from_dlpack(blob).tofile(data)
        del blob
        symbol = f"__lpx_stored_{self.stored_id}"
        source = os.path.join(workspace, f"{prefix}devc.S")
        with open(source, "w") as out:
            out.write('\t.section .lrodata,"a"\n'
                      f'\t.globl __tvm_ffi__library_bin\n\t.type __tvm_ffi__library_bin, @object\n'
                      f'\t.p2align 6\n__tvm_ffi__library_bin:\n\t.incbin "{data}"\n'
                      f'\t.globl {symbol}\n\t.type {symbol}, @object\n'
                      f'\t.p2align 6\n{symbol}:\n\t.incbin "{self.section}"\n'
                      '\t.section .note.GNU-stack,"",@progbits\n')
        return source
