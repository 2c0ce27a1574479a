"""The allocator's free list, worked by hand: next fit from where the last block ended, wrapping at its
window, and freed space merged with its neighbours."""

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
