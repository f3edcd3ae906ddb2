"""The live progress line: completed of total, output tokens/s, errors; counters shared by worker slots."""

from __future__ import annotations

import asyncio
import io

from rich.console import Console

from deepserve.bench.progress import LiveCounters, ProgressDisplay


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
    async with ProgressDisplay(counters, total=10, duration_s=None, enabled=True, console=console):
        for _ in range(3):
            counters.request_done(0, success=True)
        counters.request_done(0, success=False)
        counters.set_chunks(0, 400)
        await asyncio.sleep(0.7)
    text = out.getvalue()
    assert "4/10" in text
    assert "errors 1" in text
    assert "tok/s" in text


async def test_display_is_silent_when_disabled():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True)
    async with ProgressDisplay(LiveCounters.local(), total=3, duration_s=None, enabled=False, console=console):
        await asyncio.sleep(0.01)
    assert out.getvalue() == ""
