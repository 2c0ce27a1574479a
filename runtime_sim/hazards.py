"""Which earlier accesses to SRAM a new instruction must wait for.

The compiler's scheduler asks :meth:`AccessLog.ready` for the earliest legal
issue cycle; the simulator asks the same log whether the cycle a program chose
is legal. One definition of the rules serves both.
"""

from __future__ import annotations

import numpy as np


class AccessLog:
    """Byte ranges read and written so far, with the cycle each access ends.

    Parameters
    ----------
    capacity : int
        Upper bound on the number of reads (and of writes) that will be recorded.
    """

    def __init__(self, capacity: int):
        capacity = max(capacity, 1)
        self._w = np.zeros((3, capacity), np.int64)  # lo, hi, end
        self._r = np.zeros((3, capacity), np.int64)
        self._nw = self._nr = 0

    @staticmethod
    def _latest(log, n, ref) -> int:
        lo, hi, end = log[0, :n], log[1, :n], log[2, :n]
        hit = (lo < ref.end) & (hi > ref.addr)
        return int(end[hit].max()) if hit.any() else 0

    def raw(self, ref) -> int:
        """Cycle the last write to bytes of ``ref`` finishes (reads must not start before)."""
        return self._latest(self._w, self._nw, ref)

    def war(self, ref) -> int:
        """Cycle the last read of bytes of ``ref`` ends (writes must not start before)."""
        return self._latest(self._r, self._nr, ref)

    def ready(self, srcs, dsts) -> int:
        """Earliest cycle an instruction reading ``srcs`` and writing ``dsts`` may issue."""
        cycle = 0
        for ref in srcs:
            cycle = max(cycle, self.raw(ref))
        for ref in dsts:
            cycle = max(cycle, self.war(ref), self.raw(ref))
        return cycle

    def record(self, srcs, dsts, finish: int) -> None:
        """Note that an instruction reads ``srcs`` and writes ``dsts`` until ``finish``."""
        for ref in srcs:
            self._r[:, self._nr] = (ref.addr, ref.end, finish)
            self._nr += 1
        for ref in dsts:
            self._w[:, self._nw] = (ref.addr, ref.end, finish)
            self._nw += 1
