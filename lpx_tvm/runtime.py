"""The runtime bridge: ``lpx.runtime.execute(program, *inputs, *outputs)``.

The VM calls this global function for every offloaded call. The program (a
uint8 tensor constant of the executable) is decoded, validated and loaded into a
simulator once, cached by its verified digest; each call then views the VM's
tensors through DLPack (no copies) and runs the arithmetic.
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
from collections import Counter

import numpy as np
import tvm_ffi

from .runtime_sim import Simulator
from .runtime_sim.chip import Chip
from .runtime_sim.errors import LpxUserError
from .runtime_sim.program import decoded_columns, read_digest
from .runtime_sim.system_sim import SystemSimulator, is_system_program

_SIMULATORS: dict = {}
_CHIPS: dict = {}  # SRAM plan id -> the chip its programs share
_LOCK = threading.Lock()
_CALLS: Counter = Counter()
_RELEASED: list = []  # keys a collected model gave up, not yet forgotten (see :func:`release`)

STORED = "lpx.runtime.stored"
STORED_MAGIC = b"LPXSTORE"
STORED_HEADER = "<8s16sQ"  # magic, the export's id, the data's bytes (the data starts 64 bytes in)
_STORED_SECTIONS: dict = {}  # an export's id -> its stored constants, mapped from the library
_STORED_TENSORS: dict = {}  # (id, offset, dtype, shape) -> the constant as a tensor
_NOT_LIBRARIES: set = set()  # mapped files that are not loadable libraries (searched once)


def program_key(blob) -> tuple:
    """The cache key of an encoded program: its verified digest and length."""
    return read_digest(blob), len(blob)


def release(keys) -> None:
    """Forget the loaded simulators of these programs (:func:`program_key`), and a chip once none of its
    programs is loaded: a compiled model frees them when it is collected, so a sweep over many models does
    not keep every model's SRAM image.

    A collection can run this in the middle of a load, on the thread that holds the lock: the keys are then
    set aside and forgotten at the next load or release, never waited for (that would wait for ever)."""
    _RELEASED.extend(keys)
    if _LOCK.acquire(blocking=False):
        try:
            _forget_released()
        finally:
            _LOCK.release()


def _forget_released() -> None:
    """With the lock held: forget what :func:`release` set aside."""
    while _RELEASED:
        key = _RELEASED.pop()
        sim = _SIMULATORS.pop(key, None)
        chip = getattr(sim, "chip", None)
        if chip is not None:
            chip.resident.pop(sim.program.digest, None)
            if not chip.resident:
                for chip_key in [k for k, c in _CHIPS.items() if c is chip]:
                    del _CHIPS[chip_key]


def clear() -> None:
    """Forget every loaded program and chip (they are loaded again, and verified, on their next call)."""
    with _LOCK:
        _SIMULATORS.clear()
        _CHIPS.clear()


def load_program(blob):
    """The simulator for an encoded program, decoded and verified on first use.

    A program of a model's SRAM plan is loaded onto the chip the model's other
    programs share (their weights resident side by side); one alone gets its own.
    A system program gets a :class:`SystemSimulator` (every chip and the network).
    """
    key = program_key(blob)
    sim = _SIMULATORS.get(key)
    if sim is None:
        with _LOCK:
            _forget_released()
            sim = _SIMULATORS.get(key)
            if sim is None and is_system_program(blob):
                sim = _SIMULATORS[key] = SystemSimulator(memoryview(blob).cast("B"))
            if sim is None:
                # views of the executable's bytes, no copy; validated once, here, for the simulator too
                columns = decoded_columns(memoryview(blob).cast("B"))
                program = columns.program
                if program.plan.model:
                    chip = _CHIPS.setdefault((program.plan.model, program.config_digest),
                                             Chip(program.plan.sram_bytes))
                    sim = chip.load(columns)
                else:
                    sim = Simulator(columns)
                _SIMULATORS[key] = sim
    return sim


def offload_counts() -> Counter:
    """How many times each program (by digest hex) has run on lpx in this process."""
    with _LOCK:
        return Counter(_CALLS)


def total_offloaded_calls() -> int:
    """Total lpx calls in this process."""
    with _LOCK:
        return sum(_CALLS.values())


@tvm_ffi.register_global_func("lpx.runtime.execute", override=True)
def execute(program, *args) -> None:
    """Run one offloaded call: inputs then (destination-passing) outputs."""
    blob = np.from_dlpack(program)
    sim = load_program(blob)
    n_in = len(sim.inputs)
    if len(args) != n_in + len(sim.outputs):
        raise LpxUserError(f"lpx program takes {n_in} inputs and {len(sim.outputs)} outputs, got {len(args)} tensors")
    sim.run([np.from_dlpack(a) for a in args[:n_in]], [np.from_dlpack(a) for a in args[n_in:]])
    with _LOCK:
        _CALLS[read_digest(blob).hex()] += 1


def stored(stored_id: str, offset: int, dtype: str, shape: str):
    """A large constant of an exported library (:mod:`lpx_tvm.library`), viewed where the library lies."""
    key = (stored_id, offset, dtype, shape)
    tensor = _STORED_TENSORS.get(key)
    if tensor is None:
        with _LOCK:
            section = _STORED_SECTIONS.get(stored_id)
            if section is None:
                section = _STORED_SECTIONS[stored_id] = _find_stored(stored_id)
            dims = tuple(int(d) for d in shape.split(",") if d)
            count = int(np.prod(dims, dtype=np.int64))
            array = np.frombuffer(section, np.dtype(dtype), count, offset).reshape(dims)
            tensor = _STORED_TENSORS[key] = tvm_ffi.from_dlpack(array)
    return tensor


tvm_ffi.register_global_func(STORED, stored, override=True)


def _find_stored(stored_id: str) -> np.ndarray:
    """The data of the stored constants named ``stored_id``, from the loaded library that holds them: found by
    its symbol, and mapped copy-on-write from the library's file at the symbol's place in it (so a write can
    never reach the read-only mapping the loader made)."""
    symbol = f"__lpx_stored_{stored_id}"
    for path, segments in _mapped_files().items():
        if path in _NOT_LIBRARIES:
            continue
        try:
            library = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            _NOT_LIBRARIES.add(path)
            continue
        try:
            address = ctypes.addressof(ctypes.c_char.in_dll(library, symbol))
        except ValueError:  # another library (another export's stored constants, maybe: searched again for those)
            continue
        start = next(((lo, at) for lo, hi, at in segments if lo <= address < hi), None)
        if start is None:
            continue
        at = address - start[0] + start[1]
        with open(path, "rb") as lib:
            lib.seek(at)
            magic, found, nbytes = struct.unpack(STORED_HEADER, lib.read(struct.calcsize(STORED_HEADER)))
        if magic != STORED_MAGIC or found.decode() != stored_id:
            raise LpxUserError(f"{path}: its stored constants' header is damaged (symbol {symbol})")
        return np.memmap(path, np.uint8, mode="c", offset=at + 64, shape=(nbytes,))
    raise LpxUserError(f"the executable reads constants stored in a library (id {stored_id}) that is not "
                       "loaded in this process: load that library with tvm.runtime.load_module")


def _mapped_files() -> dict:
    """Each file mapped into this process, with its mappings' address ranges and file offsets."""
    files: dict = {}
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or not fields[5].startswith("/"):
                continue
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            files.setdefault(fields[5].strip(), []).append((lo, hi, int(fields[2], 16)))
    return files
