"""Which earlier SRAM accesses a new one must wait for, with strided views.

Every access is a 2-D block of bytes (``TensorRef.footprint``): ``rows`` runs of
``run`` bytes, ``row_stride`` apart. Two blocks with the same row stride overlap
only where their rows and their columns both do, so the tiles of one tensor that
interleave in memory (the column blocks of a matrix) stay independent; blocks
with different strides are compared by their bounding ranges, which can only add
a dependency, never drop one.

The compiler's scheduler and the simulator both use this log: one definition of
overlap serves planning and checking.
"""

from __future__ import annotations

import numpy as np


def footprint_key(ref) -> tuple:
    """(lo, hi, stride, row0, row1, col0, col1) of a ref's footprint; stride 0 marks a plain range."""
    addr, rows, run, stride = ref.footprint()
    lo, hi = addr, addr + (rows - 1) * stride + run
    col0 = addr % stride if stride else 0
    if rows == 1 or col0 + run > stride:  # a single run, or a block whose rows wrap: use its range
        return (lo, hi, 0, 0, 0, 0, 0)
    return (lo, hi, stride, addr // stride, addr // stride + rows, col0, col0 + run)


class AccessLog:
    """SRAM blocks read and written so far, with the cycle each access ends.

    Parameters
    ----------
    capacity : int
        Upper bound on the number of reads (and of writes) that will be recorded.
    """

    _FIELDS = 8  # lo, hi, stride, row0, row1, col0, col1, end

    def __init__(self, capacity: int):
        capacity = max(capacity, 1)
        self._w = np.zeros((self._FIELDS, capacity), np.int64)
        self._r = np.zeros((self._FIELDS, capacity), np.int64)
        self._nw = self._nr = 0

    @staticmethod
    def _hits(log, n, key) -> np.ndarray:
        lo, hi, stride, row0, row1, col0, col1 = key
        f = log[:, :n]
        hit = (f[0] < hi) & (f[1] > lo)
        if stride:
            blocky = f[2] == stride
            rows = (f[3] < row1) & (f[4] > row0)
            cols = (f[5] < col1) & (f[6] > col0)
            hit &= ~blocky | (rows & cols)
        return hit

    def _latest(self, log, n, ref) -> int:
        if not n:
            return 0
        hit = self._hits(log, n, footprint_key(ref))
        return int(log[7, :n][hit].max()) if hit.any() else 0

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
            if ref.in_sram:
                cycle = max(cycle, self.raw(ref))
        for ref in dsts:
            if ref.in_sram:
                cycle = max(cycle, self.war(ref), self.raw(ref))
        return cycle

    def record(self, srcs, dsts, read_end: int, write_end: int) -> None:
        """Note that an instruction reads ``srcs`` until ``read_end`` and writes ``dsts`` until ``write_end``."""
        for ref in srcs:
            if ref.in_sram:
                self._r[:7, self._nr] = footprint_key(ref)
                self._r[7, self._nr] = read_end
                self._nr += 1
        for ref in dsts:
            if ref.in_sram:
                self._w[:7, self._nw] = footprint_key(ref)
                self._w[7, self._nw] = write_end
                self._nw += 1


def block_view(bitmap: np.ndarray, ref) -> np.ndarray:
    """The bytes of ``ref``'s footprint as a 2-D view of a byte-per-byte map of SRAM."""
    addr, rows, run, stride = ref.footprint()
    if rows == 1:
        return bitmap[addr:addr + run].reshape(1, run)
    return np.lib.stride_tricks.as_strided(bitmap[addr:], shape=(rows, run), strides=(stride, 1))
