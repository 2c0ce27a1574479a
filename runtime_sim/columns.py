"""A program as columns of numbers, for checking and measuring it whole.

An instruction's timing, its operands' footprints relative to their addresses,
and whether its operands fit its opcode depend only on its *signature*: opcode,
unit instance, attributes and operand shapes, dtypes, strides and spaces. A
compiled model repeats a few hundred signatures thousands of times (ResNet-50:
891 in 5,451 instructions), so each is worked out once, by the same functions
the instruction-by-instruction walk uses (:func:`.timing.occupancy`,
:func:`.program.validate`'s operand rules), and spread to its instructions as
arrays.
"""

from __future__ import annotations

import numpy as np

from .config import ChipConfig
from .isa import Space
from .program import MAX_CYCLE, ProgramFormatError, _validate_for_chip, _validate_operands
from .timing import occupancy, on_instance

# per operand: is a write, in SRAM, element bytes, bytes, end - addr, footprint rows, run, stride, hi - addr
_WRITE, _IN_SRAM, _ITEM, _NBYTES, _END, _ROWS, _RUN, _STRIDE, _HI = range(9)
_HUGE = 1 << 62  # int64 sums of two such values cannot overflow


def _operand_row(ref) -> tuple:
    """The ``_IN_SRAM`` ... ``_HI`` columns of an operand."""
    _, rows, run, stride = ref.footprint()
    if rows == 1:
        run, stride = (rows - 1) * stride + run, 0  # a plain range, as hazards.footprint_key gives it
    return (ref.space == Space.SRAM, ref.dtype.itemsize, ref.nbytes, ref.end - ref.addr, rows, run, stride,
            (rows - 1) * stride + run)


class ProgramColumns:
    """One program's instructions and operands as arrays (see the module docstring).

    Attributes
    ----------
    signature : int array, per instruction
        Index into ``first``, the first instruction of each distinct signature.
    kind_occupancy, occupancies : lists of Occupancy, per signature and per instruction
        Set by :meth:`time_kinds`; an instruction's is its signature's, shared (a chained consumer's may
        later be replaced by a stretched one).
    cycle, order, position : int arrays
        Issue cycles; instruction indexes in issue order; each instruction's place in that order.
    owner, operand : arrays, per operand (sources then destinations, instruction by instruction)
        The instruction it belongs to, and its row of signature-derived values (the ``_WRITE`` ... ``_HI``
        columns); ``addr`` its address (SRAM byte, or stream number).
    """

    def __init__(self, program, chip: ChipConfig):
        instructions = program.instructions
        ids, first, signature, addrs = {}, [], [], []
        for ins in instructions:
            srcs = ins.srcs
            refs = srcs + ins.dsts
            key = (ins.opcode, ins.unit_index, tuple(ins.attrs.values()), len(srcs),
                   tuple([(r.shape, r.dtype, r.strides, r.space) for r in refs]))
            sid = ids.get(key)
            if sid is None:
                sid = ids[key] = len(first)
                first.append(len(signature))
            signature.append(sid)
            addrs += [r.addr for r in refs]
        self.program, self.chip, self.first, self.keys = program, chip, first, list(ids)
        self.signature = np.array(signature, np.int64)
        self.kind_occupancy = self.occupancies = None  # timed once validated (time_kinds)
        by_shape = {}  # an operand's row but for its direction depends on its shape, dtype, strides and space
        rows = []
        for key, i in zip(self.keys, first):
            n_srcs, ins = key[3], instructions[i]
            kind = []
            for j, (shape_key, ref) in enumerate(zip(key[4], ins.srcs + ins.dsts)):
                row = by_shape.get(shape_key)
                if row is None:
                    row = by_shape[shape_key] = _operand_row(ref)
                kind.append((int(j >= n_srcs),) + row)
            rows.append(kind)
        self.owner, template = self.spread([len(r) for r in rows])
        operand = [v for r in rows for row in r for v in row]
        cycles = [ins.cycle for ins in instructions]
        # no legal value comes near this; one that does (damage, a hand-made program) fails validation
        self.oversized = max(operand + addrs + cycles, default=0) >= _HUGE
        if self.oversized:
            operand, addrs, cycles = ([min(v, _HUGE) for v in values] for values in (operand, addrs, cycles))
        self.operand = np.array(operand, np.int64).reshape(-1, 9)[template]
        self.addr = np.array(addrs, np.int64)
        self.cycle = np.array(cycles, np.int64)
        self.order = np.lexsort((np.arange(len(instructions)), self.cycle))
        self.position = np.empty(len(instructions), np.int64)
        self.position[self.order] = np.arange(len(instructions))

    def time_kinds(self) -> None:
        """Work out each kind's occupancy (``kind_occupancy``) and give every instruction its kind's
        (``occupancies``). Only for a validated program: the timing rules assume well-formed operands."""
        instructions = self.program.instructions
        self.kind_occupancy = []
        elsewhere = {}  # the occupancy of a kind on another instance of its unit differs only in that instance
        for key, i in zip(self.keys, self.first):
            unitless = key[:1] + key[2:]
            other = elsewhere.get(unitless)
            if other is None:
                occ = elsewhere[unitless] = occupancy(instructions[i], self.chip)
            else:
                occ = on_instance(other, key[1])
            self.kind_occupancy.append(occ)
        self.occupancies = [self.kind_occupancy[s] for s in self.signature.tolist()]

    def spread(self, counts) -> tuple:
        """Per-signature lists of ``counts[s]`` items, laid out instruction by instruction.

        Returns ``(owner, item)``: for each item of each instruction, the instruction's index and the item's
        index in the signatures' concatenated lists.
        """
        counts = np.asarray(counts, np.int64)
        offsets = np.cumsum(counts) - counts
        per_instruction = counts[self.signature]
        owner = np.repeat(np.arange(len(self.signature)), per_instruction)
        step = np.arange(len(owner)) - np.repeat(np.cumsum(per_instruction) - per_instruction, per_instruction)
        return owner, np.repeat(offsets[self.signature], per_instruction) + step

    def instruction_errors(self) -> bool:
        """Whether any instruction breaks a rule :func:`.program.validate` checks for it alone (issue cycle,
        unit instance, operand bounds, shapes and attributes). ``validate`` then names the first."""
        program, chip, instructions = self.program, self.chip, self.program.instructions
        if self.oversized or (self.cycle >= MAX_CYCLE).any():
            return True
        operands_seen = set()  # the operand rules do not depend on the unit instance
        for i in self.first:
            ins = instructions[i]
            if ins.unit_index >= chip.unit_count(ins.unit.name):
                return True
            key = self.keys[self.signature[i]]
            key = key[:1] + key[2:]
            if key in operands_seen:
                continue
            operands_seen.add(key)
            try:
                _validate_operands(ins, program, "")
                _validate_for_chip(ins, chip, "")
            except ProgramFormatError:
                return True
        op, addr = self.operand, self.addr
        sram = op[:, _IN_SRAM].astype(bool)
        bad_stream = ~sram & ((addr >= chip.stream_capacity) | (op[:, _NBYTES] > chip.sram_bytes))
        bad_sram = sram & ((addr % op[:, _ITEM] != 0) | (addr + op[:, _END] > chip.sram_bytes))
        return bool((bad_stream | bad_sram).any())
