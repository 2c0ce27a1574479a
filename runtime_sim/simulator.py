"""The LPX simulator: verify a program's static schedule once, then run it fast.

Loading a program decodes and validates it, checks its schedule against the
machine (:mod:`.check`: every resource free and every operand arrived at each
stated issue cycle, the header's cycle count the measured one), places the
constants (weights) in an SRAM image as large as the program's high-water mark,
and binds each instruction to numpy views of its operands, its plane's weight
buffers and its streams. The schedule is static, so none of this depends on the
data: each call then only does the arithmetic.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import warnings
from bisect import bisect_right
from collections import defaultdict

import numpy as np

from .check import ScheduleError, Timeline
from .check_batch import checked_timeline, paced_chains
from .columns import _END, _IN_SRAM, ProgramColumns
from .config import ChipConfig
from .errors import LpxUserError
from .isa import DType, HostTensor, Opcode, Space
from .program import Program, aligned_array, decoded_columns, validated_columns
from .fast_path import fast_entries
from .semantics import SEMANTICS, WeightBuffer, host_convert, host_widen
from .stats import RunStats, run_stats

__all__ = ["Simulator", "RunStats", "ScheduleError", "CallError", "OverflowWarning", "reference_arithmetic"]

_REFERENCE = contextvars.ContextVar("lpx_reference_arithmetic", default=False)


@contextlib.contextmanager
def reference_arithmetic():
    """Within this block, every program runs tile by tile, one instruction at a time (the definition the
    fast path is checked against), wherever it is called from: a compiled model's call, ``generate``."""
    token = _REFERENCE.set(True)
    try:
        yield
    finally:
        _REFERENCE.reset(token)


class CallError(LpxUserError):
    """Inputs given to a program do not match its signature."""


class OverflowWarning(UserWarning):
    """A result overflowed a reduced-precision storage type (fp16, bf16) to inf."""


class Simulator:
    """Runs one LPX program: verified once at load, arithmetic only per call.

    Parameters
    ----------
    program : Program, ProgramColumns or bytes-like
        A decoded program, one already validated (as :func:`.program.decoded_columns` gives it), or its encoded
        bytes (decoded and validated here).
    config : ChipConfig or str, optional
        The chip; by default the preset the program names.
    check_schedule : bool
        Verify the static schedule at load (default). Off, the program's cycles
        are still measured with the machine's rules, but nothing is enforced.
    timing_only : bool
        Verify the schedule and measure its cycles, but set up no arithmetic: no
        SRAM image, no weights placed, nothing bound (what a design sweep needs).
        The cycles are the same as a full simulator's; :meth:`run` is refused.
    """

    def __init__(self, program, config: ChipConfig | str | None = None, check_schedule: bool = True, chip=None,
                 timing_only: bool = False):
        if isinstance(program, ProgramColumns) and config in (None, program.chip, program.chip.name):
            columns = program  # validated already, for this chip
        elif isinstance(program, (Program, ProgramColumns)):
            columns = validated_columns(getattr(program, "program", program), config)
        else:
            try:
                memoryview(program)
            except TypeError:
                raise TypeError(f"Simulator takes a Program, its ProgramColumns or its encoded bytes, got "
                                f"{type(program).__name__}") from None
            columns = decoded_columns(program, config)
        program, config = columns.program, columns.chip
        self.program, self.config, self.chip = program, config, chip
        # the caller passes a host-converted input in fp32 (the host narrows it before the link) and takes a
        # widened output in fp32 (the host widens what the chip stored)
        self._converted = {index: (scale, zero_point) for index, scale, zero_point in program.host_converted}
        self._widened = {index: (scale, zero_point) for index, scale, zero_point in program.widened_outputs}
        self._inputs = tuple(HostTensor(sig.shape, DType.F32) if i in self._converted else sig
                             for i, sig in enumerate(program.inputs))
        self._outputs = tuple(HostTensor(sig.shape, DType.F32) if j in self._widened else sig
                              for j, sig in enumerate(program.outputs))
        operand = columns.operand
        in_sram = operand[:, _IN_SRAM].astype(bool)
        # in SRAM from the load on: the constants and the resident state (read, never written by the program)
        self.resident = [c.ref for c in program.constants] + [ref for _, ref in program.state]
        # the plan's resident weights (this program's and its siblings') are never written
        self.protected = [(0, program.plan.activation_base)] if program.plan.activation_base else []
        self.sram_size = int(max([ref.end for ref in self.resident]  # a Python int, whatever the refs hold
                                 + [int((columns.addr + operand[:, _END])[in_sram].max(initial=1))]))
        self.timeline: Timeline = checked_timeline(columns, self.resident, self.sram_size, self.protected) \
            if check_schedule else _measure_unchecked(columns)
        self.order = self.timeline.order
        self.stats = run_stats(columns, self.timeline, self.sram_size)
        self.timing_only = timing_only
        if timing_only:
            return
        self._sram = chip.sram if chip is not None else np.zeros(self.sram_size, np.uint8)
        # the weights are read where the program holds them, not copied into the SRAM image: they are never
        # written, and the image's pages that nothing writes are never touched (so take no memory). A weight
        # some operand reads only in part, beside other bytes, is placed in the image as well
        self._weights = _WeightBytes(program)
        for const in self._weights.placed:
            self._view(const.ref, placing=True)[...] = const.data.view(const.ref.dtype.np).reshape(const.ref.shape)
        self._buffers = defaultdict(WeightBuffer)
        self._streams, self._stream_bytes = {}, {}
        self._stable_installs = _stable_installs(program, self.order)
        self._bound = [self._bind(i) for i in self.order]
        self._fast = fast_entries(self)  # the same arithmetic, a product's tiles in one call where legal
        # the same by the position each runs at, for a system's sessions (a position whose work moved runs nothing)
        self._fast_at = {entry[5]: entry[:5] for entry in self._fast}
        # positions (in issue order) of instructions that store a reduced-precision float
        self._reduced_dsts = {k for k, i in enumerate(self.order) if any(
            r.dtype in (DType.F16, DType.BF16) for r in program.instructions[i].dsts)}
        self._lock = chip.lock if chip is not None else threading.Lock()  # programs of a chip run one at a time

    @property
    def costs(self) -> tuple:
        """Each instruction's occupancy, by instruction index."""
        return self.timeline.occupancies

    def _view(self, ref, placing: bool = False):
        item = ref.dtype.itemsize
        memory, offset = (self._sram, 0) if placing else self._weights.holding(ref, self._sram)
        lo = ref.addr - offset
        if ref.strides is None:
            return memory[lo:lo + ref.nbytes].view(ref.dtype.np).reshape(ref.shape)
        base = memory[lo:ref.end - offset].view(ref.dtype.np)
        return np.lib.stride_tricks.as_strided(base, ref.shape, tuple(s * item for s in ref.strides))

    def state_view(self, index: int) -> np.ndarray:
        """The SRAM of resident input ``index`` (a KV cache), for the runtime to write between calls."""
        for k, ref in self.program.state:
            if k == index:
                return self._view(ref)
        raise KeyError(f"input {index} is not resident state")

    def read(self, ref) -> np.ndarray:
        """A copy of what an SRAM operand holds now (for tests and debugging)."""
        return np.array(self._view(ref))

    def _operand(self, ref, producing: bool):
        if ref.space == Space.SRAM:
            return self._view(ref)
        # a chained result: the producer writes a buffer its consumer reads. A stream carries one chain at a time
        # (the schedule check makes sure), so each stream number needs one buffer, as big as its largest chain
        if producing:
            flat = self._stream_bytes.get(ref.addr)
            if flat is None or flat.size < ref.nbytes:
                flat = self._stream_bytes[ref.addr] = aligned_array(max(ref.nbytes, 1 << 16))
            self._streams[ref.addr] = flat[:ref.nbytes].view(ref.dtype.np).reshape(ref.shape)
        return self._streams[ref.addr]

    def _bind(self, index: int):
        ins = self.program.instructions[index]
        srcs = [self._operand(r, False) for r in ins.srcs]
        dsts = [self._operand(r, True) for r in ins.dsts]
        if ins.opcode == Opcode.STREAM:  # host memory, bound once like everything else
            weight = self.program.streamed[ins.attrs["index"]]
            srcs = [weight.data.view(weight.host.dtype.np).reshape(weight.host.shape)]
        elif ins.opcode == Opcode.INSTALL:
            dsts = [self._buffers[(ins.unit_index, ins.attrs["buffer"])]]
            if index in self._stable_installs:  # nothing overwrites the tile while it is installed: no copy
                return _install_view, ins.opcode, dsts, srcs, ins.attrs
        elif ins.opcode == Opcode.MATMUL:
            srcs.insert(1, self._buffers[(ins.unit_index, ins.attrs["buffer"])])
        return SEMANTICS[ins.opcode], ins.opcode, dsts, srcs, ins.attrs

    @property
    def inputs(self) -> tuple:
        """The inputs as the caller passes them (a host-converted one in fp32)."""
        return self._inputs

    @property
    def outputs(self) -> tuple:
        """The outputs as the caller takes them (a widened one in fp32)."""
        return self._outputs

    # what a one-chip program and a system program (:class:`.system_sim.SystemSimulator`) both answer, so that
    # their callers need not ask which they hold: a program on one chip is a system of one
    @property
    def chips(self) -> tuple:
        """``(system chip, its simulator)`` for every chip the program runs on: here chip 0, this one."""
        return ((0, self),)

    @property
    def chip_config(self) -> ChipConfig:
        return self.config

    @property
    def notes(self) -> str:
        return "one chip"

    @property
    def links(self) -> dict:
        """Bytes and busy cycles per chip-to-chip link direction: none on one chip."""
        return {}

    def destinations(self, index: int) -> tuple:
        """Where host input ``index`` goes: ``(chip, program input)`` pairs, or ``(chip, input, axis, lo, hi)``
        where a chip takes a slice of it."""
        return ((0, index),)

    def _check_inputs(self, inputs) -> list:
        expected = self._inputs
        if len(inputs) != len(expected):
            raise CallError(f"program takes {len(expected)} inputs, got {len(inputs)}")
        arrays = []
        for i, (value, sig) in enumerate(zip(inputs, expected)):
            arr = np.asarray(value)
            if arr.shape != tuple(sig.shape) or arr.dtype != sig.dtype.np:
                raise CallError(f"input {i}: expected {sig.dtype.np}{list(sig.shape)}, "
                                f"got {arr.dtype}{list(arr.shape)}")
            if i in self._converted:
                arr = host_convert(arr, *self._converted[i], self.program.inputs[i].dtype.np)
            arrays.append(np.ascontiguousarray(arr))
        return arrays

    def _check_outputs(self, outputs) -> list:
        expected = self._outputs
        if outputs is None:
            return [np.empty(s.shape, s.dtype.np) for s in expected]
        if len(outputs) != len(expected):
            raise CallError(f"program writes {len(expected)} outputs, got {len(outputs)} buffers")
        for i, (arr, sig) in enumerate(zip(outputs, expected)):
            if arr.shape != tuple(sig.shape) or arr.dtype != sig.dtype.np or not arr.flags.c_contiguous:
                raise CallError(f"output {i}: expected a contiguous {sig.dtype.np}{list(sig.shape)}, "
                                f"got {arr.dtype}{list(arr.shape)}")
        return list(outputs)

    @staticmethod
    def _host_part(array: np.ndarray, ref, attrs) -> np.ndarray:
        """The slice of a host tensor a LOAD or STORE moves: ``ref.size`` elements from byte ``offset``."""
        start = attrs["offset"] // ref.dtype.itemsize
        return array.reshape(-1)[start:start + ref.size]

    def run(self, inputs, outputs=None, reference: bool | None = None) -> list:
        """Execute the program on host arrays.

        Parameters
        ----------
        inputs : sequence of array-like
            One per program input, with exactly its shape and dtype.
        outputs : sequence of numpy arrays, optional
            Buffers to write into; allocated when omitted.
        reference : bool, optional
            Run every instruction on its own, tile by tile (the definition the fast path, which runs the
            tiles of one product as one call, is tested against: :mod:`.fast_path`). By default, as
            :func:`reference_arithmetic` says (off outside it).

        Returns
        -------
        list of numpy.ndarray
            The outputs.
        """
        if self.timing_only:
            raise CallError("a timing-only simulator measures cycles and runs no arithmetic; "
                            "load the program without timing_only to run it")
        host_in = self._check_inputs(inputs)
        caller_out = self._check_outputs(outputs)
        host_out = self._stored(caller_out)
        overflowed = set()
        current = [0]
        # IEEE specials propagate silently, as on the hardware; a result too big for a reduced-precision
        # storage type is reported (numpy flags the overflowing cast, so this costs nothing otherwise)
        watch = dict(over="call", call=lambda *_: overflowed.add(current[0])) if self._reduced_dsts else {}
        if reference is None:
            reference = _REFERENCE.get()
        entries = ((*entry, k) for k, entry in enumerate(self._bound)) if reference else self._fast
        with np.errstate(all="ignore", **watch), self._lock:
            for fn, op, outs, ins, attrs, k in entries:
                current[0] = k
                if op == Opcode.LOAD or op == Opcode.STORE:
                    self._host_move(k, op, outs, ins, attrs, host_in, host_out)
                else:
                    fn(outs, ins, attrs)
        self._warn_overflow(overflowed & self._reduced_dsts)
        return self._widen(host_out, caller_out)

    def _stored(self, caller_out: list) -> list:
        """The buffers STOREs write: the caller's, or a narrow one for a widened output."""
        return [np.empty(sig.shape, sig.dtype.np) if j in self._widened else buffer
                for j, (buffer, sig) in enumerate(zip(caller_out, self.program.outputs))]

    def _widen(self, host_out: list, caller_out: list) -> list:
        for j, (scale, zero_point) in self._widened.items():
            host_widen(caller_out[j], host_out[j], scale, zero_point)
        return caller_out

    def _host_move(self, k, op, outs, ins, attrs, host_in, host_out) -> None:
        instructions = self.program.instructions
        if op == Opcode.LOAD:
            ref = instructions[self.order[k]].dsts[0]
            np.copyto(outs[0], self._host_part(host_in[attrs["index"]], ref, attrs).reshape(ref.shape))
        else:
            ref = instructions[self.order[k]].srcs[0]
            self._host_part(host_out[attrs["index"]], ref, attrs)[...] = ins[0].reshape(-1)

    def bound(self, position: int) -> tuple:
        """The instruction at ``position`` in issue order, bound: ``(function, opcode, outs, ins, attrs)``."""
        return self._bound[position]

    def session(self, inputs, outputs=None) -> "_Session":
        """One call run an instruction at a time, by position in issue order (how a system interleaves chips)."""
        if self.timing_only:
            raise CallError("a timing-only simulator measures cycles and runs no arithmetic")
        caller_out = self._check_outputs(outputs)
        return _Session(self, self._check_inputs(inputs), self._stored(caller_out), caller_out)

    def _warn_overflow(self, positions) -> None:
        for k in sorted(positions):
            ins = self.program.instructions[self.order[k]]
            layer = self.program.layer_names[ins.layer] if ins.layer < len(self.program.layer_names) else ins.layer
            warnings.warn(f"lpx: layer {layer!r} ({ins.opcode.name}) overflowed its {ins.dsts[0].dtype.short} "
                          "storage type: the result holds inf", OverflowWarning, stacklevel=3)


class _Session:
    def __init__(self, sim, host_in, host_out, caller_out):
        self.sim, self.host_in, self.host_out, self.caller_out = sim, host_in, host_out, caller_out
        self._at = None if _REFERENCE.get() else sim._fast_at

    def step(self, position: int) -> None:
        if self._at is None:
            fn, op, outs, ins, attrs = self.sim._bound[position]
        elif position in self._at:
            fn, op, outs, ins, attrs = self._at[position]
        else:
            return
        with np.errstate(all="ignore"):
            if op == Opcode.LOAD or op == Opcode.STORE:
                self.sim._host_move(position, op, outs, ins, attrs, self.host_in, self.host_out)
            else:
                fn(outs, ins, attrs)

    def finish(self) -> list:
        return self.sim._widen(self.host_out, self.caller_out)


class _WeightBytes:
    """A program's dense weights as the bytes it holds them in, by SRAM address: where an operand lies wholly
    inside one, it reads them there. ``placed``: the weights the SRAM image must hold (one stored with
    strides, one whose bytes are not aligned to its items, or one an operand reads in part, beside other
    bytes)."""

    def __init__(self, program):
        held = {id(c): np.ascontiguousarray(c.data).reshape(-1).view(np.uint8) for c in program.constants}
        # a weight stored with strides is laid out in SRAM unlike its bytes; one whose bytes do not start at a
        # multiple of its item size (a format-7 program's, inside the encoding) would keep numpy off its fast
        # paths: both are placed
        placed = {id(c) for c in program.constants
                  if c.ref.strides is not None or held[id(c)].ctypes.data % c.ref.dtype.itemsize}
        weights = sorted((c for c in program.constants if id(c) not in placed and c.ref.nbytes),
                         key=lambda c: c.ref.addr)
        self.starts = [c.ref.addr for c in weights]
        self.ends = [c.ref.addr + c.ref.nbytes for c in weights]
        self.bytes = [held[id(c)] for c in weights]
        for ins in program.instructions:
            for ref in (*ins.srcs, *ins.dsts):
                if not ref.in_sram:
                    continue
                k = bisect_right(self.starts, ref.addr) - 1
                if k >= 0 and ref.end <= self.ends[k]:
                    continue  # inside one weight
                j = bisect_right(self.starts, ref.end - 1)  # weights starting before the operand ends
                for w in range(max(k, 0), j):
                    if self.ends[w] > ref.addr:
                        placed.add(id(weights[w]))
        self.placed = [c for c in program.constants if id(c) in placed]

    def holding(self, ref, sram) -> tuple:
        """``(memory, the SRAM address of its byte 0)`` that holds ``ref``'s bytes."""
        k = bisect_right(self.starts, ref.addr) - 1
        if k >= 0 and ref.end <= self.ends[k]:
            return self.bytes[k], self.starts[k]
        return sram, 0


def _install_view(outs, ins, attrs):
    outs[0].value = ins[0]


def _stable_installs(program, order) -> set:
    """INSTALLs whose source no instruction overwrites before the tile's last MATMUL: those can be bound
    to a view of SRAM instead of a copy (the values are the same; the copy costs time)."""
    from .hazards import footprint_key, meets

    instructions = program.instructions
    users = {}  # INSTALL index -> position (in issue order) of the last MATMUL using its tile
    current = {}
    for pos, i in enumerate(order):
        ins = instructions[i]
        if ins.opcode == Opcode.INSTALL:
            current[(ins.unit_index, ins.attrs["buffer"])] = i
            users[i] = pos
        elif ins.opcode == Opcode.MATMUL:
            installer = current.get((ins.unit_index, ins.attrs["buffer"]))
            if installer is not None:
                users[installer] = pos
    position = {i: pos for pos, i in enumerate(order)}
    stable = set()
    for i, last in users.items():
        source = footprint_key(instructions[i].srcs[0])
        written = [r for k in order[position[i] + 1:last + 1] for r in instructions[k].dsts if r.in_sram]
        if not any(meets(source, footprint_key(r)) for r in written):
            stable.add(i)
    return stable


def _measure_unchecked(columns: ProgramColumns) -> Timeline:
    """The timeline without enforcing the rules (each instruction timed by the machine's rules, a chain's
    members at its pace)."""
    _, _, occupancies, busy = paced_chains(columns)
    makespan = int((columns.cycle + busy + columns.latency).max(initial=0))
    return Timeline(tuple(occupancies), tuple(columns.order.tolist()), makespan, busy)
