"""The runtime bridge: ``lpx.runtime.execute(program, *inputs, *outputs)``.

The VM calls this global function for every offloaded call. The program (a
uint8 tensor constant of the executable) is decoded, validated and loaded into a
simulator once, cached by its verified digest; each call then views the VM's
tensors through DLPack (no copies) and runs the arithmetic.
"""

from __future__ import annotations

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
