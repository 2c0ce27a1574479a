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
    """``(lo, hi, stride, addr, rows, run)`` of a ref's footprint; stride 0 marks a plain range."""
    addr, rows, run, stride = ref.footprint()
    lo, hi = addr, addr + (rows - 1) * stride + run
    if rows == 1:
        return range_key(lo, hi)
    return (lo, hi, stride, addr, rows, run)


def range_key(lo: int, hi: int) -> tuple:
    """:func:`footprint_key` of the plain byte range ``[lo, hi)``."""
    return (lo, hi, 0, lo, 1, hi - lo)


def _blocks_meet(ax, rx, nx, ay, ry, ny, stride):
    """Whether two blocks of one row stride share a byte (numpy-broadcastable, exact).

    With ``ay - ax = q·stride + r`` (``0 <= r < stride``), a byte of X's row ``i``
    meets one of Y's row ``i - q`` when ``r < nx``, or of row ``i - q - 1`` when
    ``r > stride - ny``; the rows must exist in both.
    """
    q, r = np.divmod(ay - ax, stride)
    same_row = (r < nx) & (q > -ry) & (q < rx)
    next_row = (r > stride - ny) & (q + 1 > -ry) & (q + 1 < rx)
    return same_row | next_row


def overlaps(keys: np.ndarray, key: tuple) -> np.ndarray:
    """Which footprints in ``keys`` (6 × n, as :func:`footprint_key` gives) share a byte with ``key``.

    Blocks of one row stride compare exactly; a plain range meets a block as
    the block of that stride covering it (exact when it fits in a row);
    blocks of different strides compare by their bounding ranges. Nothing that
    overlaps is ever missed.
    """
    lo, hi, stride, addr, rows, run = key
    hit = (keys[0] < hi) & (keys[1] > lo)
    if not hit.any():
        return hit
    k_stride = keys[2]
    if stride:
        k_rows = np.where(k_stride == 0, -(-(keys[1] - keys[0]) // stride), keys[4])
        k_run = np.where(k_stride == 0, np.minimum(keys[1] - keys[0], stride), keys[5])
        exact = _blocks_meet(keys[3], k_rows, k_run, addr, rows, run, stride)
        hit &= np.where((k_stride == stride) | (k_stride == 0), exact, True)
    else:
        safe = np.maximum(k_stride, 1)
        exact = _blocks_meet(keys[3], keys[4], keys[5], lo, -(-(hi - lo) // safe), np.minimum(hi - lo, safe), safe)
        hit &= np.where(k_stride != 0, exact, True)
    return hit


class AccessLog:
    """SRAM blocks read and written so far, with the cycle each access ends.

    Parameters
    ----------
    capacity : int
        Upper bound on the number of reads (and of writes) that will be recorded.
    """

    _FIELDS = 7  # lo, hi, stride, addr, rows, run, end

    def __init__(self, capacity: int):
        capacity = max(capacity, 1)
        self._w = np.zeros((self._FIELDS, capacity), np.int64)
        self._r = np.zeros((self._FIELDS, capacity), np.int64)
        self._nw = self._nr = 0

    def _latest(self, log, n, ref) -> int:
        if not n:
            return 0
        hit = overlaps(log[:6, :n], footprint_key(ref))
        return int(log[6, :n][hit].max()) if hit.any() else 0

    def forget_ended_by(self, cycle: int) -> None:
        """Drop accesses that end by ``cycle``. Only for a caller that asks in non-decreasing cycle order (the
        checker walks the program in issue order): such an access can never delay a later instruction."""
        for name in ("_w", "_r"):
            log, n = getattr(self, name), getattr(self, "_n" + name[1])
            live = np.flatnonzero(log[6, :n] > cycle)
            if len(live) < n:
                log[:, :len(live)] = log[:, live]
                setattr(self, "_n" + name[1], len(live))

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
                self._r[:6, self._nr] = footprint_key(ref)
                self._r[6, self._nr] = read_end
                self._nr += 1
        for ref in dsts:
            if ref.in_sram:
                self._w[:6, self._nw] = footprint_key(ref)
                self._w[6, self._nw] = write_end
                self._nw += 1


def block_view(bitmap: np.ndarray, ref) -> np.ndarray:
    """The bytes of ``ref``'s footprint as a 2-D view of a byte-per-byte map of SRAM."""
    addr, rows, run, stride = ref.footprint()
    if rows == 1:
        return bitmap[addr:addr + run].reshape(1, run)
    return np.lib.stride_tricks.as_strided(bitmap[addr:], shape=(rows, run), strides=(stride, 1))
