"""One chip's SRAM, shared by the programs of one model (their SRAM plan).

A model cut into several lpx programs keeps every program's weights resident
at once: each has its own range below the plan's activation base, loaded when
the program is, and all of them reuse the activations above. Loading a program
whose weights overlap another's on the same chip is an error; running one takes
the chip (one program at a time, as the hardware runs them).
"""

from __future__ import annotations

import threading

import numpy as np

from .program import ProgramFormatError


class Chip:
    """The SRAM image a model's programs share.

    Parameters
    ----------
    sram_bytes : int
        What the plan needs (its largest program's high-water mark), not the chip's full SRAM.
    """

    def __init__(self, sram_bytes: int):
        self.sram = np.zeros(max(sram_bytes, 1), np.uint8)
        self.lock = threading.Lock()
        self.resident = {}  # program digest -> (lo, hi) of its weights

    def load(self, program, check_schedule: bool = True):
        """A simulator for ``program`` (a Program, or one validated as ProgramColumns) on this chip, its weights
        placed in the shared SRAM."""
        from .simulator import Simulator

        loaded, program = program, getattr(program, "program", program)
        resident = [c.ref for c in program.constants] + [ref for _, ref in program.state]
        lo = min((ref.addr for ref in resident), default=0)
        hi = max((ref.end for ref in resident), default=0)
        for digest, (other_lo, other_hi) in self.resident.items():
            if digest != program.digest and lo < other_hi and other_lo < hi:
                raise ProgramFormatError(f"program's weights at [{lo:#x}, {hi:#x}) overlap another program's "
                                         f"[{other_lo:#x}, {other_hi:#x}) on the same chip")
        if max(hi, program.plan.sram_bytes) > self.sram.size:
            raise ProgramFormatError(f"program needs {max(hi, program.plan.sram_bytes)} bytes of SRAM, the plan "
                                     f"gave its chip {self.sram.size}")
        self.resident[program.digest] = (lo, hi)
        return Simulator(loaded, check_schedule=check_schedule, chip=self)
