"""The live progress line: completed of total, output tokens/s, errors; counters shared by worker slots."""

from __future__ import annotations

import io

from rich.console import Console

from deepserve.bench.progress import LiveCounters, ProgressDisplay
from tests.helpers import FakeClock


def test_counters_sum_over_workers():
    counters = LiveCounters([0] * 6, workers=2)
    counters.request_done(0, success=True)
    counters.request_done(1, success=True)
    counters.request_done(1, success=False)
    counters.set_chunks(0, 10)
    counters.set_chunks(1, 5)
    assert counters.totals() == (2, 1, 15)


async def test_display_shows_completed_of_total_rate_and_errors():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    counters = LiveCounters.local()
    clock = FakeClock(100.0)
    async with ProgressDisplay(counters, total=10, duration_s=None, enabled=True, console=console, clock=clock) as bar:
        for _ in range(3):
            counters.request_done(0, success=True)
        counters.request_done(0, success=False)
        counters.set_chunks(0, 400)
        clock.now_s += 0.5
        bar.tick()  # what the display's own ticker does every REFRESH_S
        text = out.getvalue()
    assert "4/10" in text
    assert "errors 1" in text
    assert "800 tok/s" in text  # 400 chunks in 0.5 s of the display's clock


async def test_display_is_silent_when_disabled():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True)
    async with ProgressDisplay(LiveCounters.local(), total=3, duration_s=None, enabled=False, console=console):
        pass
    assert out.getvalue() == ""
