"""The scheduler's log of earlier SRAM accesses: a query finds exactly the earlier accesses whose bytes meet
its own, however large either is (entries are filed at the scale of their size), against plain interval
arithmetic."""

import numpy as np
import pytest

from lpx_tvm.codegen import schedule
from lpx_tvm.codegen.schedule import _DepLog
from lpx_tvm.runtime_sim.hazards import range_key


@pytest.mark.parametrize("few", [0, 1 << 20], ids=["numpy", "python"])
def test_a_query_finds_every_earlier_access_that_meets_it_at_every_scale(monkeypatch, few):
    """Both ways of testing the candidates: numpy's over a crowded query, plain Python's over a few."""
    monkeypatch.setattr(schedule, "_FEW", few)
    rng = np.random.default_rng(7)
    sizes = [4, 100, 16384, 40000, 1 << 20, 3 << 20]  # below, at and far above the 16 KiB blocks
    ranges = []
    for _ in range(300):
        lo = int(rng.integers(0, 8 << 20))
        ranges.append((lo, lo + int(rng.choice(sizes)) + int(rng.integers(0, 64))))
    log = _DepLog(len(ranges))
    for index, (lo, hi) in enumerate(ranges):
        log.add("r", range_key(lo, hi), index)
    for _ in range(200):
        lo = int(rng.integers(0, 8 << 20))
        hi = lo + int(rng.choice(sizes))
        want = {k for k, (a, b) in enumerate(ranges) if a < hi and lo < b}
        assert set(log.hits("r", range_key(lo, hi))) == want


def test_a_dense_write_retires_the_accesses_inside_it_and_is_found_in_their_place():
    """Reads of [0, 100) and [50 KiB, 51 KiB), then a write of [0, 1 MiB): a later read of [60, 70) meets the
    write only (the read it overlapped is retired: the write is ordered after it); one of [2 MiB, +8) meets
    nothing."""
    log = _DepLog(4)
    log.add("r", range_key(0, 100), 0)
    log.add("r", range_key(50 << 10, 51 << 10), 1)
    log.add("w", range_key(0, 1 << 20), 2)
    assert log.hits("r", range_key(60, 70)) == []
    assert log.hits("w", range_key(60, 70)) == [2]
    assert log.hits("w", range_key(50 << 10, (50 << 10) + 1)) == [2]
    assert log.hits("w", range_key(2 << 20, (2 << 20) + 8)) == []
