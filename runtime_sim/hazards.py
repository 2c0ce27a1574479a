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

from math import inf

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
    """Whether two blocks of one row stride share a byte (exact; numpy arrays or plain ints).

    With ``ay - ax = q·stride + r`` (``0 <= r < stride``), a byte of X's row ``i``
    meets one of Y's row ``i - q`` when ``r < nx``, or of row ``i - q - 1`` when
    ``r > stride - ny``; the rows must exist in both.
    """
    q, r = (ay - ax) // stride, (ay - ax) % stride
    same_row = (r < nx) & (q > -ry) & (q < rx)
    next_row = (r > stride - ny) & (q + 1 > -ry) & (q + 1 < rx)
    return same_row | next_row


def overlaps(keys: np.ndarray, key: tuple) -> np.ndarray:
    """Which footprints in ``keys`` (6 × n, as :func:`footprint_key` gives) share a byte with ``key``.

    Blocks of one row stride compare exactly; a plain range meets a block as
    the block of that stride covering it (exact when it fits in a row);
    blocks of different strides compare by their bounding ranges. Nothing that
    overlaps is ever missed. :func:`meets` is the same test for one pair.
    """
    hit = (keys[0] < key[1]) & (keys[1] > key[0])
    near = np.flatnonzero(hit)  # most queries: few bounding ranges meet, and only those compare exactly
    if len(near):
        hit[near] = meet_pairs(keys[:, near], np.asarray(key, np.int64)[:, None])
    return hit


def meets(a: tuple, b: tuple) -> bool:
    """Whether footprints ``a`` and ``b`` share a byte, by :func:`overlaps`' rules, in plain Python: the
    simulator's checker asks about a handful of accesses in flight at a time, where numpy's per-call cost
    is most of the work."""
    if a[0] >= b[1] or a[1] <= b[0]:
        return False
    if a[2] == b[2] == 0:
        return True
    if a[2] == 0:
        a, b = b, a  # the plain range, if there is one, second
    stride = a[2]
    if b[2] == 0:
        lo, hi = b[0], b[1]
        return bool(_blocks_meet(a[3], a[4], a[5], lo, -(-(hi - lo) // stride), min(hi - lo, stride), stride))
    if b[2] != stride:
        return True  # different strides: the bounding ranges meet
    return bool(_blocks_meet(a[3], a[4], a[5], b[3], b[4], b[5], stride))


def meet_pairs(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Whether each footprint in ``a`` shares a byte with the one beside it in ``b`` (both 6 × n, as
    :func:`footprint_key` gives): :func:`meets`, pair by pair, for a whole program's accesses at once."""
    hit = (a[0] < b[1]) & (a[1] > b[0])
    plain = a[2] == 0
    x = np.where(plain, b, a)  # the block, if there is one, first
    y = np.where(plain, a, b)
    stride = np.maximum(x[2], 1)
    y_plain = y[2] == 0
    length = y[1] - y[0]
    exact = _blocks_meet(x[3], x[4], x[5], np.where(y_plain, y[0], y[3]),
                         np.where(y_plain, -(-length // stride), y[4]), np.where(y_plain, np.minimum(length, stride), y[5]),
                         stride)
    both_plain = plain & (b[2] == 0)
    return hit & (both_plain | (~y_plain & (y[2] != x[2])) | exact)


class AccessLog:
    """SRAM blocks read and written and still in flight, with the cycle each access ends.

    The checker walks a program in issue order and forgets what has ended, so
    only a few accesses are ever in the log: plain lists beat arrays here.
    Accesses are given as :func:`footprint_key` keys.
    """

    def __init__(self):
        self._writes, self._reads = [], []  # (footprint key, end)
        self._first_end = inf  # nothing in the log ends before this cycle: forgetting waits until it comes

    def forget_ended_by(self, cycle: int) -> None:
        """Drop accesses that end by ``cycle``. Only for a caller that asks in non-decreasing cycle order (the
        checker walks the program in issue order): such an access can never delay a later instruction."""
        if cycle < self._first_end:
            return
        self._writes = [e for e in self._writes if e[1] > cycle]
        self._reads = [e for e in self._reads if e[1] > cycle]
        self._first_end = min([e[1] for e in self._writes] + [e[1] for e in self._reads], default=inf)

    @staticmethod
    def _latest(log, key) -> int:
        lo, hi = key[0], key[1]
        return max([end for other, end in log if other[0] < hi and other[1] > lo and meets(other, key)], default=0)

    def raw(self, key: tuple) -> int:
        """Cycle the last write to bytes of ``key`` finishes (reads must not start before)."""
        return self._latest(self._writes, key)

    def war(self, key: tuple) -> int:
        """Cycle the last read of bytes of ``key`` ends (writes must not start before)."""
        return self._latest(self._reads, key)

    def record(self, reads, writes, read_end: int, write_end: int) -> None:
        """Note that an instruction reads the blocks ``reads`` until ``read_end`` and writes ``writes`` until
        ``write_end``."""
        self._reads += [(key, read_end) for key in reads]
        self._writes += [(key, write_end) for key in writes]
        if reads:
            self._first_end = min(self._first_end, read_end)
        if writes:
            self._first_end = min(self._first_end, write_end)


def block_view(bitmap: np.ndarray, ref) -> np.ndarray:
    """The bytes of ``ref``'s footprint as a 2-D view of a byte-per-byte map of SRAM."""
    return block_of(bitmap, *ref.footprint())


def block_of(bitmap: np.ndarray, addr: int, rows: int, run: int, stride: int) -> np.ndarray:
    """``rows`` runs of ``run`` entries, ``stride`` apart from ``addr``, as a 2-D view of ``bitmap``."""
    if rows == 1:
        return bitmap[addr:addr + run].reshape(1, run)
    if addr + rows * stride <= len(bitmap):  # a reshape of the rows' span: far cheaper than as_strided
        return bitmap[addr:addr + rows * stride].reshape(rows, stride)[:, :run]
    return np.lib.stride_tricks.as_strided(bitmap[addr:], shape=(rows, run), strides=(stride, 1))
