"""The rules a program's parts keep, one place for the decoder (:mod:`.program`) and the whole-program checker
(:mod:`.columns`): an operand's form, an instruction's operands and units on a chip, and the outputs every
program must write. Each names what it found wrong in a :class:`ProgramFormatError`."""

from __future__ import annotations

import numpy as np

from .config import ChipConfig
from .errors import LpxUserError
from .isa import MAX_CYCLE, Group, Instruction, Opcode, Space, TensorRef
from .shapes import check_operands

MAX_DIM = 1 << 31


class ProgramFormatError(LpxUserError):
    """A byte stream is not a valid LPX program for this chip."""



MAX_OPERAND_BYTES = MAX_CYCLE  # a broadcast view's size is not bounded by the SRAM it spans: this bounds it


def _is_count(value) -> bool:
    return isinstance(value, (int, np.integer)) and value >= 0


def ref_form_error(ref: TensorRef) -> str | None:
    """What is wrong with a ref's numbers themselves, if anything (a decoded ref is always well formed)."""
    strides = () if ref.strides is None else ref.strides
    if not (_is_count(ref.addr) and all(_is_count(d) and 1 <= d < MAX_DIM for d in ref.shape)
            and all(_is_count(s) and s < 1 << 32 for s in strides)
            and (ref.strides is None or len(strides) == len(ref.shape))):
        return (f"{ref!r} needs a non-negative integer address, dimensions in [1, 2^31) and, if any, one stride "
                "in [0, 2^32) per dimension")
    if ref.nbytes >= MAX_OPERAND_BYTES:
        return f"{ref} holds {ref.nbytes} bytes, past 2^48"
    return None


def _check_ref(ref: TensorRef, chip: ChipConfig, where: str) -> None:
    error = ref_form_error(ref)
    if error:
        raise ProgramFormatError(f"{where}: {error}")
    if ref.space == Space.STREAM:
        if ref.addr >= chip.stream_capacity or ref.nbytes > chip.sram_bytes:
            raise ProgramFormatError(f"{where}: stream S{ref.addr} carrying {ref.nbytes} bytes does not exist "
                                     f"(the chip has {chip.stream_capacity} streams)")
        return
    if ref.addr % ref.dtype.itemsize or ref.end > chip.sram_bytes:
        raise ProgramFormatError(f"SRAM overflow: {where}: {ref} lies outside SRAM of {chip.sram_bytes} bytes "
                                 f"(or is not aligned to its {ref.dtype.itemsize}-byte elements)")


def _validate_instruction(index: int, ins: Instruction, program, chip: ChipConfig) -> None:
    """The rules an instruction must meet on its own (:meth:`.columns.ProgramColumns.has_instruction_errors`
    checks the same ones, once per kind)."""
    where = f"instruction {index} ({ins.opcode.name})"
    if not _is_count(ins.cycle) or ins.cycle >= MAX_CYCLE:
        raise ProgramFormatError(f"{where}: issue cycle {ins.cycle!r} is not an integer in [0, {MAX_CYCLE})")
    if not _is_count(ins.layer) or ins.layer >= MAX_CYCLE:
        raise ProgramFormatError(f"{where}: layer {ins.layer!r} is not a non-negative integer")
    if not _is_count(ins.unit_index) or ins.unit_index >= chip.unit_count(ins.unit.name):
        raise ProgramFormatError(f"{where}: {ins.unit.name} instance {ins.unit_index} does not exist")
    for ref in ins.srcs + ins.dsts:
        _check_ref(ref, chip, where)
    _validate_operands(ins, program, where)
    _validate_for_chip(ins, chip, where)


def _validate_outputs_covered(program) -> None:
    """Every byte of every host input is loaded, and of every host output stored (slices may split them)."""
    resident = {index for index, _ in program.state}
    for opcode, group, what in ((Opcode.LOAD, program.inputs, "loaded"), (Opcode.STORE, program.outputs, "stored")):
        spans = {i: [] for i in range(len(group)) if opcode != Opcode.LOAD or i not in resident}
        for ins in program.instructions:
            if ins.opcode == opcode:
                ref = ins.dsts[0] if opcode == Opcode.LOAD else ins.srcs[0]
                if ins.attrs["index"] not in spans:
                    raise ProgramFormatError(f"input {ins.attrs['index']} is resident state; nothing LOADs it")
                spans[ins.attrs["index"]].append((ins.attrs["offset"], ins.attrs["offset"] + ref.nbytes))
        for index, parts in spans.items():
            reached = 0
            for lo, hi in sorted(parts):
                if lo > reached:
                    break
                reached = max(reached, hi)
            if reached < group[index].nbytes:
                raise ProgramFormatError(f"{'input' if opcode == Opcode.LOAD else 'output'} {index}: bytes from "
                                         f"{reached} on are never {what}")


def _validate_for_chip(ins: Instruction, chip: ChipConfig, where: str) -> None:
    """What depends on the chip: matrix dtypes and tile sizes, weight buffers, which operands may be streams."""
    if ins.spec.group == Group.HOST and any(r.space == Space.STREAM for r in ins.srcs + ins.dsts):
        raise ProgramFormatError(f"{where}: host transfers move SRAM, not streams")
    if ins.opcode in (Opcode.MATMUL, Opcode.INSTALL):
        ref = ins.srcs[0]
        if ref.dtype.matrix_class not in chip.mxm_passes:
            raise ProgramFormatError(f"{where}: chip {chip.name!r} has no {ref.dtype.short} matrix unit")
        if ins.attrs["buffer"] >= chip.mxm_weight_buffers:
            raise ProgramFormatError(f"{where}: buffer {ins.attrs['buffer']} does not exist "
                                     f"(planes have {chip.mxm_weight_buffers})")
        k = ref.shape[-2] if ins.opcode == Opcode.INSTALL else ref.shape[-1]
        n = ref.shape[-1] if ins.opcode == Opcode.INSTALL else ins.dsts[0].shape[-1]
        if k > chip.mxm_rows or n > chip.mxm_cols:
            raise ProgramFormatError(f"{where}: a {k}x{n} tile does not fit the {chip.mxm_rows}x{chip.mxm_cols} array")


def _validate_operands(ins: Instruction, program, where: str) -> None:
    try:
        for ref in ins.dsts:
            if ref.strides is not None and any(st == 0 and d > 1 for st, d in zip(ref.strides, ref.shape)):
                raise ValueError(f"destination {ref} has an axis of stride 0: it would write one element several "
                                 "times")
        check_operands(ins.opcode, [(r.shape, r.dtype) for r in ins.srcs], [(r.shape, r.dtype) for r in ins.dsts],
                       ins.attrs)
        if ins.spec.group == Group.HOST:
            index = ins.attrs["index"]
            if ins.opcode == Opcode.STORE:
                group, ref = program.outputs, ins.srcs[0]
            else:
                group = program.inputs if ins.opcode == Opcode.LOAD else [w.host for w in program.streamed]
                ref = ins.dsts[0]
            offset = ins.attrs.get("offset", 0)
            if index >= len(group) or group[index].dtype != ref.dtype or offset % ref.dtype.itemsize \
                    or offset + ref.nbytes > group[index].nbytes \
                    or (ins.opcode == Opcode.STREAM and ref.nbytes != group[index].nbytes):
                raise ValueError(f"host tensor {index} does not match {ref} at byte offset {offset}")
    except ValueError as err:
        raise ProgramFormatError(f"{where}: {err}") from None


# opcodes whose float attributes may be infinite (clipping bounds)
