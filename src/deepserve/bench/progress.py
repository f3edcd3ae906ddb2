"""The live progress bar: completed of total, current output tokens/s, errors.

Counters are plain integers per worker (a shared array when the load is spread over processes), written by the
drivers and read by the display a few times a second, so the hot path never renders anything."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import time
from collections.abc import Callable, MutableSequence
from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

REFRESH_S = 0.5
FIELDS = 3  # completed, failed, chunks per worker


class LiveCounters:
    """completed / failed requests and received chunks, one slot per worker."""

    def __init__(self, cells: MutableSequence[int], workers: int) -> None:
        self.cells = cells
        self.workers = workers

    @classmethod
    def local(cls) -> LiveCounters:
        return cls([0] * FIELDS, 1)

    @classmethod
    def shared(cls, workers: int) -> LiveCounters:
        cells = multiprocessing.get_context("spawn").Array("q", FIELDS * workers, lock=False)
        return cls(cells, workers)

    def request_done(self, worker: int, success: bool) -> None:
        self.cells[FIELDS * worker + (0 if success else 1)] += 1

    def set_chunks(self, worker: int, chunks: int) -> None:
        self.cells[FIELDS * worker + 2] = chunks

    def totals(self) -> tuple[int, int, int]:
        cells = list(self.cells)
        return sum(cells[0::FIELDS]), sum(cells[1::FIELDS]), sum(cells[2::FIELDS])


class ProgressDisplay:
    """A rich progress bar on stderr while the run lasts (only on a terminal, and only when enabled). It is redrawn
    every REFRESH_S by `tick`, which measures the rate with CLOCK (tests call `tick` after moving a fake clock)."""

    def __init__(
        self,
        counters: LiveCounters,
        total: int | None,
        duration_s: float | None,
        enabled: bool,
        console: Console | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.counters = counters
        self._clock = clock
        self._last_chunks = 0
        self._last_s = clock()
        self.total = total
        self.duration_s = duration_s
        console = console or Console(stderr=True)
        self.enabled = enabled and console.is_terminal
        self.progress = Progress(
            TextColumn("bench"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[tok_s]:>8.0f} tok/s"),
            TextColumn("errors {task.fields[errors]}"),
            TimeElapsedColumn(),
            console=console,
            auto_refresh=False,  # refreshed from our own ticker: no extra thread competing for the GIL
            transient=False,
        )
        self._task_id: TaskID | None = None
        self._ticker: asyncio.Task[None] | None = None

    async def __aenter__(self) -> ProgressDisplay:
        if self.enabled:
            self.progress.start()
            self._task_id = self.progress.add_task("bench", total=self.total, tok_s=0.0, errors=0)
            self._ticker = asyncio.create_task(self._tick())
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
            self._update(0.0)
            self.progress.stop()

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_S)
            self.tick()

    def tick(self) -> None:
        """Redraw with the rate of chunks since the last tick."""
        now_s = self._clock()
        chunks = self.counters.totals()[2]
        self._update((chunks - self._last_chunks) / max(now_s - self._last_s, 1e-9))
        self._last_chunks, self._last_s = chunks, now_s

    def _update(self, chunks_per_s: float) -> None:
        if self._task_id is None:
            return
        completed, failed, _ = self.counters.totals()
        self.progress.update(self._task_id, completed=completed + failed, tok_s=chunks_per_s, errors=failed)
        self.progress.refresh()
