"""A program as columns of numbers, for checking and measuring it whole.

An instruction's timing, its operands' footprints relative to their addresses,
and whether its operands fit its opcode depend only on its *signature*: opcode,
unit instance, attributes and operand shapes, dtypes, strides and spaces.
Instructions of one signature are one *kind*. A compiled model has a few
hundred kinds of thousands of instructions (ResNet-50: 891 kinds of 5,451), so
each kind is worked out once, by the same functions the instruction-by-
instruction walk uses (:func:`.timing.occupancy`, :func:`.program.validate`'s
operand rules), and spread to its instructions as arrays.
"""

from __future__ import annotations

from array import array
from itertools import chain
from operator import attrgetter

import numpy as np

from .config import ChipConfig
from .isa import MAX_CYCLE, Space
from .rules import ProgramFormatError, _validate_for_chip, _validate_operands, ref_form_error
from .timing import occupancy, on_instance

# per operand: is a write, in SRAM, element bytes, bytes, end - addr (past its last byte, where its footprint
# ends too), and its footprint's rows, run and stride (0 for a plain range, as hazards.footprint_key has it)
_WRITE, _IN_SRAM, _ITEM, _NBYTES, _END, _ROWS, _RUN, _STRIDE = range(8)
_HUGE = 1 << 62  # int64 sums of two values below this cannot overflow; no legal value comes near it


def _operand_row(ref) -> tuple:
    """The ``_IN_SRAM`` ... ``_STRIDE`` columns of an operand."""
    _, rows, run, stride = ref.footprint()
    return (ref.space == Space.SRAM, ref.dtype.itemsize, ref.nbytes, ref.end - ref.addr, rows, run,
            stride if rows > 1 else 0)


def _integer_column(values: list) -> tuple:
    """``(column, ok)``: ``values`` as int64, and whether every one is an integer in ``[0, _HUGE)``. Damage
    or a hand-made program can put anything there; the column is then zeros, and validation, going
    instruction by instruction, names the first value that is wrong."""
    try:
        column = np.array(values) if values else np.zeros(0, np.int64)
    except (ValueError, TypeError, OverflowError):  # ragged, or not numbers at all
        return np.zeros(len(values), np.int64), False
    if column.dtype.kind not in "iu" or (len(column) and (column.min() < 0 or column.max() >= _HUGE)):
        return np.zeros(len(values), np.int64), False
    return column.astype(np.int64, copy=False), True


def _all_integers(tuples) -> bool:
    """Whether every value in ``tuples`` is an integer. An instruction is keyed to its kind by equality, so a
    hand-made stride of ``16.0`` would join the kind of its twin ``16`` and pass as it: this catches it, and
    validation, going one by one, names it."""
    try:
        array("q", chain.from_iterable(tuples))  # a C loop that takes only integers (their ranges are checked
    except (TypeError, OverflowError):  # per kind: equal values, equal ranges)
        return False
    return True


def ragged_steps(counts: np.ndarray) -> np.ndarray:
    """``0 .. counts[k] - 1`` for each ``k`` in turn, as one array."""
    return np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)


class ProgramColumns:
    """One program's instructions and operands as arrays (see the module docstring).

    Attributes
    ----------
    kind : int array, per instruction
        Its kind: an index into ``first`` (each kind's first instruction), ``kind_instructions`` (those
        instructions, which stand for their kinds) and ``keys`` (their signatures).
    kind_occupancy, occupancies : lists of Occupancy, per kind and per instruction
        Set by :meth:`time_kinds`; an instruction's is its kind's, shared.
    busy, latency : int arrays, per instruction
        Its kind's occupancy's, set by :meth:`time_kinds`.
    cycle, order, position : int arrays
        Issue cycles; instruction indexes in issue order; each instruction's place in that order.
    owner, operand : arrays, per operand (sources then destinations, instruction by instruction)
        The instruction it belongs to, and its row of its kind's values (the ``_WRITE`` ... ``_STRIDE``
        columns); ``addr`` its address (SRAM byte, or stream number).
    """

    def __init__(self, program, chip: ChipConfig):
        instructions = program.instructions
        ids, first, kinds, operands = {}, [], [], []
        for ins in instructions:
            srcs = ins.srcs
            refs = srcs + ins.dsts
            key = (ins.opcode, ins.unit_index, tuple(ins.attrs.values()), len(srcs),
                   tuple([(r.shape, r.dtype, r.strides, r.space) for r in refs]))
            try:
                sid = ids.get(key)
            except TypeError:  # a hand-made program with a list where a tuple belongs
                raise ProgramFormatError(f"instruction {len(kinds)} ({ins.opcode.name}): its unit instance, and its "
                                         "operands' shapes and strides, must be integers and tuples of "
                                         "integers") from None
            if sid is None:
                sid = ids[key] = len(first)
                first.append(len(kinds))
            kinds.append(sid)
            operands += refs
        self.program, self.chip, self.first, self.keys = program, chip, first, list(ids)
        self.kind_instructions = [instructions[i] for i in first]  # each kind's first, which stands for it
        self.kind = np.array(kinds, np.int64)
        self.kind_occupancy = self.occupancies = self.busy = self.latency = None  # timed once valid (time_kinds)
        by_shape = {}  # an operand's row but for its direction depends on its shape, dtype, strides and space
        self.shaped = []  # an operand of each distinct shape, dtype, strides and space (their rules are its)
        rows = []
        for key, ins in zip(self.keys, self.kind_instructions):
            n_srcs = key[3]
            kind = []
            for j, (shape_key, ref) in enumerate(zip(key[4], ins.srcs + ins.dsts)):
                row = by_shape.get(shape_key)
                if row is None:
                    row = by_shape[shape_key] = _operand_row(ref)
                    self.shaped.append(ref)
                kind.append((int(j >= n_srcs),) + row)
            rows.append(kind)
        self.owner, template = self.spread([len(r) for r in rows])
        operand, operand_ok = _integer_column([v for r in rows for row in r for v in row])
        self.operand = operand.reshape(-1, 8)[template]
        self.addr, addr_ok = _integer_column(list(map(attrgetter("addr"), operands)))
        self.cycle, cycle_ok = _integer_column([ins.cycle for ins in instructions])
        self.layer, layer_ok = _integer_column([ins.layer for ins in instructions])
        _, unit_ok = _integer_column([ins.unit_index for ins in instructions])  # a unit 0.0 is keyed with unit 0
        dims = chain(map(attrgetter("shape"), operands), filter(None, map(attrgetter("strides"), operands)))
        self.malformed = not (operand_ok and addr_ok and cycle_ok and layer_ok and unit_ok and _all_integers(dims))
        self.order = np.lexsort((np.arange(len(instructions)), self.cycle))
        self.position = np.empty(len(instructions), np.int64)
        self.position[self.order] = np.arange(len(instructions))

    def time_kinds(self) -> None:
        """Work out each kind's occupancy (``kind_occupancy``) and give every instruction its kind's
        (``occupancies``). Only for a validated program: the timing rules assume well-formed operands."""
        self.kind_occupancy = []
        elsewhere = {}  # the occupancy of a kind on another instance of its unit differs only in that instance
        for key, ins in zip(self.keys, self.kind_instructions):
            unitless = key[:1] + key[2:]
            other = elsewhere.get(unitless)
            if other is None:
                occ = elsewhere[unitless] = occupancy(ins, self.chip)
            else:
                occ = on_instance(other, key[1])
            self.kind_occupancy.append(occ)
        self.occupancies = [self.kind_occupancy[s] for s in self.kind.tolist()]
        self.busy = np.array([o.busy for o in self.kind_occupancy], np.int64)[self.kind]
        self.latency = np.array([o.latency for o in self.kind_occupancy], np.int64)[self.kind]

    def spread(self, counts) -> tuple:
        """Per-kind lists of ``counts[k]`` items, laid out instruction by instruction.

        Returns ``(owner, item)``: for each item of each instruction, the instruction's index and the item's
        index in the kinds' concatenated lists.
        """
        counts = np.asarray(counts, np.int64)
        offsets = np.cumsum(counts) - counts
        per_instruction = counts[self.kind]
        owner = np.repeat(np.arange(len(self.kind)), per_instruction)
        return owner, np.repeat(offsets[self.kind], per_instruction) + ragged_steps(per_instruction)

    def has_instruction_errors(self) -> bool:
        """Whether any instruction breaks a rule :func:`.program.validate` checks for it alone (issue cycle,
        unit instance, operand bounds, shapes and attributes). ``validate`` then names the first."""
        program, chip = self.program, self.chip
        if self.malformed or (self.cycle >= MAX_CYCLE).any() or (self.layer >= MAX_CYCLE).any() \
                or any(ref_form_error(ref) for ref in self.shaped):
            return True
        operands_seen = set()  # the operand rules do not depend on the unit instance
        for key, ins in zip(self.keys, self.kind_instructions):
            if ins.unit_index >= chip.unit_count(ins.unit.name):  # (an integer: else malformed)
                return True
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
