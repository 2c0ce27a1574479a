"""The allocator's free list, worked by hand: next fit from where the last block ended, wrapping at its
window, and freed space merged with its neighbours."""

import pytest

from lpx_tvm.codegen.alloc import _FreeList


def test_next_fit_takes_space_after_the_last_block_and_reuses_freed_space_late():
    free = _FreeList(0, 1000, window=1000)
    assert [free.take(100), free.take(200), free.take(100)] == [0, 100, 300]
    free.give(100, 200)  # [100, 300) is free again, but the search goes on from 400
    assert free.take(150) == 400
    assert free.high_water == 550


def test_a_search_that_reaches_the_window_wraps_to_the_start():
    free = _FreeList(0, 1000, window=600)
    assert [free.take(300), free.take(200)] == [0, 300]
    free.give(0, 300)
    # 500 + 200 would pass the window (600): the search wraps and takes the freed block at 0
    assert free.take(200) == 0


def test_freed_neighbours_merge_into_one_block():
    free = _FreeList(0, 1000, window=1000)
    a, b, c = free.take(100), free.take(100), free.take(100)
    free.give(a, 100)
    free.give(c, 100)
    free.give(b, 100)
    assert free.blocks == [(0, 1000)]
    assert free.take(1000) == 0  # one block of the whole range again, so the largest request fits


def test_a_request_larger_than_any_free_block_gets_none():
    free = _FreeList(0, 1000, window=1000)
    free.take(600)
    assert free.take(500) is None


from hypothesis import given, settings, strategies as st  # noqa: E402


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 400)), max_size=60), st.integers(200, 1000))
@pytest.mark.slow
def test_taken_blocks_never_overlap_and_no_byte_is_lost(steps, window):
    """Any sequence of takes and gives (a give frees a block taken earlier, chosen by the draw): every taken
    block lies in [0, 1000) and overlaps no other block still taken; the free blocks and the taken ones
    together cover [0, 1000) exactly once, free blocks sorted, disjoint and merged (no two touch); and a take
    is refused only when no free block holds the request."""
    free = _FreeList(0, 1000, window=window)
    taken = []
    for give, size in steps:
        if give and taken:
            lo, n = taken.pop(size % len(taken))
            free.give(lo, n)
        else:
            fits = any(hi - lo >= size for lo, hi in free.blocks)
            got = free.take(size)
            assert (got is not None) == fits
            if got is not None:
                taken.append((got, size))
        spans = sorted(taken + [(lo, hi - lo) for lo, hi in free.blocks])
        assert sum(n for _, n in spans) == 1000
        assert spans[0][0] == 0
        assert all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:]))
        assert all(hi1 < lo2 for (_, hi1), (lo2, _) in zip(free.blocks, free.blocks[1:]))
