"""The measured run of one process: a dispatcher releases requests at their arrival offsets (open loop) into at most
max_concurrency slots (closed loop); each request is one task on the streaming client, and records are built from
what arrived."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a Linux/macOS dependency
    uvloop = None  # type: ignore[assignment]

from deepserve import _compat
from deepserve.bench.arrivals import arrival_offsets_s, sleep_until
from deepserve.bench.client import DecodedStream, StreamingClient
from deepserve.bench.conversations import PreparedConversation, converse
from deepserve.bench.drive_plan import DrivePlan, PreparedRequest
from deepserve.bench.progress import LiveCounters
from deepserve.bench.records import Phases, UncountedOutput, record_of, send_safely
from deepserve.bench.types import RequestRecord

T = TypeVar("T")


@dataclass(repr=False)  # a task's repr (asyncio builds some) must not format thousands of records
class DriveOutcome:
    records: list[RequestRecord]
    end_s: float  # when the last request ended, on the run's clock
    uncounted: dict[int, UncountedOutput] = field(default_factory=dict)  # no usage: counted after the run
    clock_origin_s: float = 0.0  # the run's t = 0 as time.perf_counter() (CLOCK_MONOTONIC: same in every process)
    interrupted: bool = False
    warmups_done: int = 0
    turns_not_sent: int = 0  # multi-turn: turns after a failed one, which could not be built

    def __repr__(self) -> str:
        return f"DriveOutcome({len(self.records)} records, end_s={self.end_s:.3f}, interrupted={self.interrupted})"


def run_async(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run on uvloop where it is installed (cheaper per read than asyncio's loop). Ctrl-C cancels the main task,
    which the driver turns into partial results."""
    factory = uvloop.new_event_loop if uvloop is not None else None
    return _compat.run(coroutine, factory)


def raise_open_files_limit() -> None:
    """One socket per concurrent stream: lift the soft limit on open files (often 1,024) to the hard limit."""
    with contextlib.suppress(ImportError, ValueError, OSError):
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No garbage-collector pauses while timing: a full collection over many records stalls the event loop for
    milliseconds, which would land in some TTFT/ITL samples. Memory held by cycles is reclaimed afterwards."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()


class Driver:
    """Releases PLAN's requests on schedule into the concurrency limit and turns responses into records."""

    def __init__(
        self,
        plan: DrivePlan,
        counters: LiveCounters,
        worker: int,
        start_at: float | None = None,
        before_run: Callable[[], Awaitable[None]] | None = None,
        on_in_flight: Callable[[int], None] | None = None,
    ) -> None:
        """BEFORE_RUN: awaited between the warm-ups and the measured run (--profile starts the profiler there).
        ON_IN_FLIGHT: told the requests in flight each time one is released and each time one ends (the
        server-metrics sampler)."""
        self.plan = plan
        self.before_run = before_run
        self.on_in_flight = on_in_flight
        self.counters = counters
        self.worker = worker
        self.start_at = start_at
        self.client = StreamingClient(plan.endpoint, plan.request_timeout_s, verify_tls=plan.verify_tls)
        self.t0 = 0.0
        self.in_flight = 0
        self.slot_freed = asyncio.Event()
        self.tasks: set[asyncio.Task[None]] = set()
        self.outcome = DriveOutcome(records=[], end_s=0.0)

    async def run(self) -> DriveOutcome:
        ticker = asyncio.create_task(self._publish_chunks())
        try:
            await self._warm_up()
            if self.before_run is not None:
                await self.before_run()
            with collector_paused():
                if self.start_at is not None:
                    await asyncio.sleep(max(0.0, self.start_at - time.perf_counter()))
                self.t0 = self.start_at if self.start_at is not None else time.perf_counter()
                self.outcome.clock_origin_s = self.t0
                await self._dispatch()
                if self.tasks:
                    await asyncio.gather(*self.tasks)
        except asyncio.CancelledError:  # Ctrl-C: keep what finished, drop what was in flight
            self.outcome.interrupted = True
            for task in self.tasks:
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
        finally:
            ticker.cancel()
            self.client.close()
            self.counters.set_chunks(self.worker, self.client.tally.events)
        ends = [record.end_s for record in self.outcome.records if record.end_s is not None]
        self.outcome.end_s = max(ends, default=time.perf_counter() - self.t0)
        return self.outcome

    async def _publish_chunks(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            self.counters.set_chunks(self.worker, self.client.tally.events)

    async def _warm_up(self) -> None:
        self.outcome.warmups_done = await send_warmups(self.client, self.plan.warmups, self.plan.max_concurrency)

    async def _dispatch(self) -> None:
        plan = self.plan
        for position, offset_s in enumerate(self._offsets()):
            if plan.num_requests is not None and position >= plan.num_requests:
                return
            if plan.duration_s is not None and offset_s >= plan.duration_s:
                return
            await sleep_until(self.t0 + offset_s)
            await self._wait_for_slot()
            if plan.duration_s is not None and time.perf_counter() - self.t0 >= plan.duration_s:
                return
            self.in_flight += 1
            if self.on_in_flight is not None:
                self.on_in_flight(self.in_flight)
            task = asyncio.create_task(self._unit(position, offset_s))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def _unit(self, position: int, offset_s: float) -> Coroutine[Any, Any, None]:
        """The work released at POSITION: one request, or one whole conversation."""
        plan = self.plan
        index = plan.index_offset + position * plan.index_stride
        if plan.conversations:
            conversation = plan.conversations[position % len(plan.conversations)]
            return self._conversation(index * plan.turn_slots, conversation, offset_s)
        request = plan.requests[position % len(plan.requests)]
        if position >= len(plan.requests) and request.request_id:
            request = request.renamed(f"{plan.request_id_prefix}{index}")
        return self._one(index, request, offset_s)

    def _offsets(self) -> Iterator[float]:
        """Arrival offsets (s after t0): a replayed trace's own times; zeros in closed loop; else the arrival
        process, batch after batch (a duration-bound run may need more than one workload's worth; a ramp spans the
        first batch, the later ones keep its final rate). A trace is replayed once."""
        plan = self.plan
        if plan.schedule_s is not None:
            yield from plan.schedule_s
            return
        rate = plan.rate_ramp.end_rps if plan.rate_ramp is not None else plan.request_rate
        if math.isinf(rate):
            while True:
                yield 0.0
        batch = max(plan.units, 1)
        base_s, round_ = 0.0, 0
        while True:
            first = round_ == 0
            offsets = arrival_offsets_s(
                batch,
                rate,
                plan.burstiness,
                plan.seed + round_,
                plan.ramp_up_s if first else None,
                rate_ramp=plan.rate_ramp if first else None,
            )
            for offset in offsets:
                yield base_s + offset
            base_s += offsets[-1] + 1.0 / rate
            round_ += 1

    def _concurrency_limit(self) -> float:
        limit = self.plan.max_concurrency
        if limit is None:
            return math.inf
        ramp_s = self.plan.ramp_up_s
        if ramp_s and math.isinf(self.plan.request_rate):  # closed loop: ramp the concurrency instead of the rate
            elapsed_s = time.perf_counter() - self.t0
            return max(1, math.ceil(limit * min(1.0, elapsed_s / ramp_s)))
        return limit

    async def _wait_for_slot(self) -> None:
        while self.in_flight >= self._concurrency_limit():
            self.slot_freed.clear()
            await _compat.wait_for_event(self.slot_freed, 0.05)

    async def _one(self, index: int, request: PreparedRequest, scheduled_s: float) -> None:
        try:
            sent = await send_safely(self.client, request.wire, self._deadline())
        finally:
            self._free_slot()
        if sent is None:
            return  # its connection was ready only after the run's end: never sent, no record
        sent_abs, response = sent
        record, decoded = record_of(index, request.prompt_len, scheduled_s, sent_abs, response, self.t0)
        record.request_id, record.conversation, record.turn = request.request_id, request.session, request.turn
        self._keep(record, decoded)

    async def _conversation(self, first_index: int, conversation: PreparedConversation, scheduled_s: float) -> None:
        plan = self.plan
        try:
            self.outcome.turns_not_sent += await converse(
                self.client,
                conversation,
                plan.endpoint,
                plan.chat,
                first_index,
                plan.request_id_prefix,
                self.t0,
                scheduled_s,
                self._keep,
                self._deadline(),
            )
        finally:
            self._free_slot()

    def _deadline(self) -> float | None:
        """The last instant a request may go out (perf_counter seconds): a duration-bound run's end."""
        return None if self.plan.duration_s is None else self.t0 + self.plan.duration_s

    def _free_slot(self) -> None:
        self.in_flight -= 1
        self.slot_freed.set()
        if self.on_in_flight is not None:
            self.on_in_flight(self.in_flight)

    def _keep(self, record: RequestRecord, decoded: DecodedStream) -> None:
        self.outcome.records.append(record)
        if record.output_len_source == "tokenizer":
            phases = Phases.of(decoded, self.t0)  # reasoning and tool calls are output tokens too
            uncounted = UncountedOutput(decoded.text, decoded.chunk_text_lens, phases, decoded.other_text)
            self.outcome.uncounted[record.index] = uncounted
        self.counters.request_done(self.worker, record.success)


async def send_warmups(client: StreamingClient, warmups: list[PreparedRequest], max_concurrency: int | None) -> int:
    """Warm-up requests: connections opened and the server's caches primed, nothing recorded. Returns how many."""
    if not warmups:
        return 0
    limit = asyncio.Semaphore(max_concurrency or len(warmups))

    async def one(request: PreparedRequest) -> None:
        async with limit:
            await client.send(request.wire)

    await asyncio.gather(*(one(request) for request in warmups))
    return len(warmups)
