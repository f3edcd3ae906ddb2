"""Clocks for the simulated engine: the event loop's (optionally sped up or slowed down), or a manual one for tests.

Times are simulated seconds. With TIME_SCALE s, one simulated second lasts s wall seconds: 0.1 runs ten times
faster than the modelled GPU (a quick test), 1.0 is real time.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from typing import Protocol


class Timer(Protocol):
    def cancel(self) -> None: ...


class SimClock(Protocol):
    def now(self) -> float:
        """Simulated seconds since the clock started."""
        ...

    def call_at(self, when_s: float, callback: Callable[[], None]) -> Timer:
        """Call CALLBACK at simulated time WHEN_S (at once if it has passed)."""
        ...

    def call_soon(self, callback: Callable[[], None]) -> None:
        """Call CALLBACK after the current callbacks (arrivals of one instant are batched)."""
        ...

    def wall_s(self, simulated_s: float) -> float:
        """Wall seconds that SIMULATED_S simulated seconds last."""
        ...


class LoopClock:
    """The running event loop's monotonic clock, scaled by TIME_SCALE (wall seconds per simulated second)."""

    def __init__(self, time_scale: float = 1.0, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be positive")
        self.time_scale = time_scale
        self.loop = loop or asyncio.get_running_loop()
        self._origin = self.loop.time()

    def now(self) -> float:
        return (self.loop.time() - self._origin) / self.time_scale

    def call_at(self, when_s: float, callback: Callable[[], None]) -> Timer:
        return self.loop.call_at(self._origin + when_s * self.time_scale, callback)

    def call_soon(self, callback: Callable[[], None]) -> None:
        self.loop.call_soon(callback)

    def wall_s(self, simulated_s: float) -> float:
        return simulated_s * self.time_scale


class _ManualTimer:
    __slots__ = ("callback", "cancelled")

    def __init__(self, callback: Callable[[], None]) -> None:
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class ManualClock:
    """Virtual time that moves only when a test says so: `advance(s)` runs, in time order, every callback due
    within S seconds, with now() at each callback's own time. Nothing ever sleeps."""

    def __init__(self) -> None:
        self._now = 0.0
        self._timers: list[tuple[float, int, _ManualTimer]] = []
        self._order = itertools.count()

    def now(self) -> float:
        return self._now

    def call_at(self, when_s: float, callback: Callable[[], None]) -> Timer:
        timer = _ManualTimer(callback)
        heapq.heappush(self._timers, (max(when_s, self._now), next(self._order), timer))
        return timer

    def call_soon(self, callback: Callable[[], None]) -> None:
        self.call_at(self._now, callback)

    def wall_s(self, simulated_s: float) -> float:
        return simulated_s

    def advance(self, seconds: float = 0.0) -> None:
        self.advance_to(self._now + seconds)

    def advance_to(self, when_s: float) -> None:
        while self._timers and self._timers[0][0] <= when_s:
            due_s, _, timer = heapq.heappop(self._timers)
            self._now = max(self._now, due_s)
            if not timer.cancelled:
                timer.callback()
        self._now = max(self._now, when_s)

    def run_until_idle(self, limit_s: float = 1e9) -> None:
        """Advance until no callback is left (or LIMIT_S simulated seconds have passed)."""
        while self._timers and self._timers[0][0] <= limit_s:
            self.advance_to(self._timers[0][0])

    @property
    def pending(self) -> int:
        return sum(1 for _, _, timer in self._timers if not timer.cancelled)
