"""The scheduler's calendars (``codegen/calendar.py``) against a cycle-by-cycle reference."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lpx_tvm.codegen.calendar import Exclusive, Shared

HORIZON = 200


def _first_free(busy: np.ndarray, t: int, d: int) -> int:
    """The reference: the first cycle >= t from which d cycles of ``busy`` are all free."""
    while busy[t:t + d].any():
        t += 1
    return t


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 150), st.integers(1, 12)), max_size=30),
       st.lists(st.tuples(st.integers(0, 150), st.integers(1, 12)), min_size=1, max_size=10))
@pytest.mark.slow
def test_exclusive_finds_the_first_free_stretch_and_books_it(bookings, queries):
    calendar, busy = Exclusive(), np.zeros(HORIZON + 400, bool)
    for t, d in bookings:  # each at the first free stretch from t, as the scheduler books
        start = calendar.earliest(t, d)
        assert start == _first_free(busy, t, d)
        calendar.book(start, d)
        busy[start:start + d] = True
    for t, d in queries:
        assert calendar.earliest(t, d) == _first_free(busy, t, d)
    # touching bookings are one interval: never two that meet
    assert all(end < start for end, start in zip(calendar.ends, calendar.starts[1:]))


def test_bookings_that_meet_merge_into_one_interval():
    calendar = Exclusive()
    for t in (10, 0, 5):  # [10,15), [0,5), then [5,10) joins both
        calendar.book(t, 5)
    assert (calendar.starts, calendar.ends) == ([0], [15])
    assert calendar.earliest(3, 1) == 15


def test_shared_holds_a_demand_until_the_capacity_is_reached():
    shared = Shared(4)
    shared.book(0, 10, 3)
    assert shared.earliest(0, 5, 1) == 0 and shared.earliest(0, 5, 2) == 10
