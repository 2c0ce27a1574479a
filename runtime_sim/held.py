"""Weights the host holds for its programs: named, not copied.

A program compiled beside its caller's weight arrays (a decoder whose prefill and decode programs read
the same weights, which ONNX Runtime reads too) need not carry a copy of them. Each of its constants that
lies inside one of those arrays is encoded as ``(weight set, name, byte offset)``; decoding it views the
array where it is. The arrays are registered here, under a weight set id, for as long as the
:class:`HeldWeights` that names them lives (a compiled model keeps its own), and must not change while
they are held: the program's digest covers their names and sizes, not their bytes.

An array the lowering derives from a held one (a tied LM head's transposed embedding table) is made once
for the set and held with it under a name of its own (:meth:`HeldWeights.derived`), so that a decoder's
prefill and decode programs name one copy rather than carrying one each.

A program that holds weights so runs only in the process that holds them; it cannot be exported.
"""

from __future__ import annotations

import os
import threading
import weakref
from bisect import bisect_right
from dataclasses import replace

import numpy as np

from .rules import ProgramFormatError

__all__ = ["HeldWeights", "held_bytes"]

_SETS: dict = {}  # weight set id -> {name: that array's bytes, 1-D uint8}
_LOCK = threading.Lock()


class HeldWeights:
    """A set of named arrays that programs may hold by name instead of copying.

    Parameters
    ----------
    arrays : dict
        ``{name: array}``. Only a C-contiguous array can be viewed from its bytes; any other is left out
        (a constant drawn from it stays a copy).
    """

    def __init__(self, arrays: dict):
        self.id = os.urandom(8)
        self.bytes = {name: np.asarray(a).reshape(-1).view(np.uint8) for name, a in arrays.items()
                      if isinstance(a, np.ndarray) and a.flags.c_contiguous and a.nbytes}
        self.order = {name: k for k, name in enumerate(self.bytes)}
        spans = sorted((b.ctypes.data, b.ctypes.data + b.nbytes, name) for name, b in self.bytes.items())
        self._starts = [s for s, _, _ in spans]
        self._spans = spans
        self._derived = {}  # name -> an array made from held ones (:meth:`derived`), held with them
        self.named = 0  # bytes of constants named so far, not copied
        # name -> the system chip that first held it: a later model over these weights keeps each there
        self.homes = {}
        # (name, offset, bytes) -> (chip, SRAM address) where the first model placed it; of a later model's,
        # the bytes placed there too, and those placed elsewhere (a second copy on the machine)
        self.places, self.shared, self.moved = {}, 0, 0
        with _LOCK:
            _SETS[self.id] = self.bytes
        weakref.finalize(self, _forget, self.id)

    def derived(self, source: np.ndarray, how: tuple, make) -> np.ndarray:
        """``make(source)`` for a ``source`` that lies in a held array, made once for this set and held with it
        under a name of its own (the source's, its offset and shape, and ``how``): every model compiled over
        these weights that derives the same array (a tied head's transposed embedding, in a decoder's prefill
        and decode) gets this one, so its programs name it and the chips keep one copy. ``make(source)``
        itself, held by no one, where ``source`` lies in no held array."""
        where = self.place(source)
        if not where:
            return make(source)
        name = f"{where[0]}@{where[1]}{list(source.shape)}.{'.'.join(str(part) for part in how)}"
        if name not in self._derived:
            array = np.ascontiguousarray(make(source))
            self._derived[name] = array
            self.bytes[name] = array.reshape(-1).view(np.uint8)
            self.order[name] = len(self.order)
            spans = sorted(self._spans + [(array.ctypes.data, array.ctypes.data + array.nbytes, name)])
            self._spans, self._starts = spans, [s for s, _, _ in spans]
        return self._derived[name]

    def given(self) -> dict:
        """``{name: bytes}`` of the arrays the caller gave (not those :meth:`derived` made from them)."""
        return {name: b for name, b in self.bytes.items() if name not in self._derived}

    def place(self, data: np.ndarray) -> tuple:
        """``(name, byte offset)`` of the held array whose buffer holds ``data``'s bytes (C order), or ``()``."""
        if not isinstance(data, np.ndarray) or not data.flags.c_contiguous or not data.nbytes:
            return ()
        start = data.ctypes.data
        k = bisect_right(self._starts, start) - 1
        if k < 0:
            return ()
        lo, hi, name = self._spans[k]
        if start + data.nbytes > hi:
            return ()
        return name, start - lo

    def place_rows(self, data: np.ndarray) -> tuple:
        """``(name, byte offset, pitch)`` of the held array that holds ``data``, a block of rows ``pitch`` bytes
        apart with each row's bytes together (a column block of a held matrix), or ``()``."""
        if not isinstance(data, np.ndarray) or data.ndim < 2 or not data.nbytes:
            return ()
        row = np.lib.stride_tricks.as_strided(data, data.shape[1:], data.strides[1:])
        if not row.flags.c_contiguous or data.strides[0] < row.nbytes:
            return ()
        start, span = data.ctypes.data, (data.shape[0] - 1) * data.strides[0] + row.nbytes
        k = bisect_right(self._starts, start) - 1
        if k < 0 or start + span > self._spans[k][1]:
            return ()
        lo, _, name = self._spans[k]
        return name, start - lo, data.strides[0]

    def holding(self, constants) -> tuple:
        """``constants`` with each that lies inside a held array named (:class:`~.program.Constant`
        ``held``), the others as they are. (A copy with ``held`` set: this module stays below the program's.)"""
        out = []
        for const in constants:
            where = () if const.held else self.place(const.data)
            out.append(replace(const, held=(self.id, *where)) if where else const)
            self.named += const.ref.nbytes if where else 0
        return tuple(out)


    def program(self, program, chip: int = 0):
        """``program`` (a :class:`~.program.Program` on ``chip``, or a system program: each chip's) holding by
        name every constant that lies inside a held array."""
        from dataclasses import replace

        if hasattr(program, "programs"):  # a system program
            held = replace(program, programs=tuple(self.program(p, chip)
                                                   for chip, p in zip(program.chips, program.programs)))
            for chip, part in zip(held.chips, held.programs):  # the first model over them sets their homes
                for const in part.constants:
                    if const.held:
                        self.homes.setdefault(const.held[1], chip)
            return held
        streamed = []
        for weight in program.streamed:
            where = () if weight.held else self.place_rows(weight.data)
            streamed.append(replace(weight, held=(self.id, *where)) if where else weight)
            self.named += weight.host.nbytes if where else 0
        held = replace(program, constants=self.holding(program.constants), streamed=tuple(streamed))
        for const in held.constants:
            if const.held:
                key, where = (*const.held[1:], const.ref.nbytes), (chip, const.ref.addr)
                first = self.places.get(key)
                if first is None:
                    self.places[key] = where
                elif first == where:
                    self.shared += const.ref.nbytes
                else:
                    self.moved += const.ref.nbytes
        return held

    def held_in(self, program) -> int:
        """Bytes of ``program``'s constants (each chip's, for a system program) it holds by name."""
        if hasattr(program, "programs"):
            return sum(self.held_in(p) for p in program.programs)
        return (sum(c.ref.nbytes for c in program.constants if c.held)
                + sum(w.host.nbytes for w in program.streamed if w.held))


def _forget(set_id: bytes) -> None:
    with _LOCK:
        _SETS.pop(set_id, None)


def held_bytes(set_id: bytes, name: str, offset: int, nbytes: int, what: str) -> np.ndarray:
    """The ``nbytes`` bytes at ``offset`` in the array held as ``name`` in weight set ``set_id``.

    Raises
    ------
    ProgramFormatError
        Where this process does not hold that set or that name, or the bytes run past the array's end.
    """
    with _LOCK:
        arrays = _SETS.get(set_id)
    if arrays is None:
        raise ProgramFormatError(f"{what} is held by the host as {name!r} (weight set {set_id.hex()}), and this "
                                 "process holds no such set: a program compiled with hold_weights=True runs only "
                                 "while the model it was compiled in lives, in that process")
    held = arrays.get(name)
    if held is None:
        raise ProgramFormatError(f"{what} is held by the host as {name!r}, which weight set {set_id.hex()} "
                                 "does not hold")
    if offset + nbytes > held.nbytes:
        raise ProgramFormatError(f"{what}: {nbytes} bytes at {offset} run past the end of {name!r} "
                                 f"({held.nbytes} bytes)")
    return held[offset:offset + nbytes]


def held_rows(set_id: bytes, name: str, offset: int, pitch: int, host, what: str) -> np.ndarray:
    """The block of ``host.shape[0]`` rows of ``host``'s other axes, ``pitch`` bytes apart from ``offset`` in
    the array held as ``name`` in weight set ``set_id``: a ``uint8`` view ``[rows, bytes a row]``, not a copy.

    Raises
    ------
    ProgramFormatError
        As :func:`held_bytes`, or where the rows overlap (a pitch shorter than a row).
    """
    rows = host.shape[0] if host.shape else 1
    row_bytes = host.nbytes // rows if rows else 0
    if rows and pitch < row_bytes:
        raise ProgramFormatError(f"{what}: rows of {row_bytes} bytes cannot lie {pitch} bytes apart")
    span = (rows - 1) * pitch + row_bytes if rows else 0
    flat = held_bytes(set_id, name, offset, span, what)
    return np.lib.stride_tricks.as_strided(flat, (rows, row_bytes), (pitch, 1), writeable=False)
