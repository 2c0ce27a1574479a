"""Resource calendars for the scheduler: when each resource is taken, and how much of a shared one.

An :class:`Exclusive` calendar holds disjoint busy intervals (a unit instance,
the host link, a plane's install port, a stream number). A :class:`Shared`
calendar is a step function of how much of a capacity is in use (streams, SRAM
read and write bandwidth, a lane's ALUs). Both answer "the earliest cycle at
or after t at which d cycles are free" and take bookings anywhere in time, so
the scheduler can fill a gap it left earlier.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right


class Exclusive:
    """Disjoint ``[start, end)`` bookings of one resource."""

    def __init__(self):
        self.starts: list = []
        self.ends: list = []

    def earliest(self, t: int, d: int) -> int:
        """The first cycle ``>= t`` from which ``d`` cycles are free."""
        i = max(bisect_right(self.starts, t) - 1, 0)
        while i < len(self.starts):
            if self.ends[i] <= t:
                i += 1
                continue
            if self.starts[i] >= t + d:
                return t
            t = self.ends[i]
            i += 1
        return t

    def book(self, t: int, d: int) -> None:
        """Take ``[t, t + d)``. A booking that meets its neighbours merges with them: a busy stretch is one
        interval, so :meth:`earliest` steps over it at once instead of walking every booking in it."""
        if d <= 0:
            return
        i = bisect_left(self.starts, t)
        end = t + d
        if i < len(self.starts) and self.starts[i] == end:  # meets the next one
            self.starts[i] = t
            if i > 0 and self.ends[i - 1] == t:  # and the previous one: all three are one
                self.starts[i] = self.starts[i - 1]
                del self.starts[i - 1], self.ends[i - 1]
            return
        if i > 0 and self.ends[i - 1] == t:  # meets the previous one
            self.ends[i - 1] = end
            return
        self.starts.insert(i, t)
        self.ends.insert(i, end)


class Shared:
    """How much of a capacity is in use: ``level[i]`` on ``[times[i], times[i + 1])``."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.times = [0]
        self.levels = [0]

    def earliest(self, t: int, d: int, demand: int) -> int:
        """The first cycle ``>= t`` from which ``demand`` more fits for ``d`` cycles."""
        if demand <= 0 or d <= 0:
            return t
        if demand > self.capacity:
            raise ValueError(f"a demand of {demand} exceeds the capacity {self.capacity}")
        i = max(bisect_right(self.times, t) - 1, 0)
        start = t
        while i < len(self.times) and self.times[i] < start + d:
            if self.levels[i] + demand > self.capacity:
                start = self.times[i + 1] if i + 1 < len(self.times) else start
                if i + 1 >= len(self.times):  # the last segment is full forever: cannot happen with bookings
                    raise ValueError("capacity exhausted for ever")
            i += 1
        return start

    def _split(self, t: int) -> int:
        i = bisect_right(self.times, t) - 1
        if self.times[i] != t:
            self.times.insert(i + 1, t)
            self.levels.insert(i + 1, self.levels[i])
            return i + 1
        return i

    def book(self, t: int, d: int, demand: int) -> None:
        if demand <= 0 or d <= 0:
            return
        i = self._split(t)
        j = self._split(t + d)
        for k in range(i, j):
            self.levels[k] += demand
