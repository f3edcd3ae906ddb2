"""The load spread over worker processes (--num-workers): the requests are dealt round-robin to processes that share
one start instant (perf_counter is the system's monotonic clock, so their times line up), and their records are
merged."""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ProcessPoolExecutor

from deepserve.bench.arrivals import RateRamp
from deepserve.bench.client import StreamingClient
from deepserve.bench.drive_plan import DrivePlan
from deepserve.bench.driver import DriveOutcome, Driver, run_async, send_warmups
from deepserve.bench.progress import LiveCounters

WORKER_START_DELAY_S = 3.0  # time for spawned workers to import and meet at the shared start instant


def split_plan(plan: DrivePlan, workers: int) -> list[DrivePlan]:
    """Deal the requests round-robin; each worker gets its share of the rate, the concurrency and the warm-ups."""
    plans = []
    for worker in range(workers):
        requests = plan.requests[worker::workers]
        conversations = plan.conversations[worker::workers]
        if not requests and not conversations:
            continue
        concurrency = None
        if plan.max_concurrency is not None:
            concurrency = plan.max_concurrency // workers + (1 if worker < plan.max_concurrency % workers else 0)
            if concurrency == 0:
                continue
        plans.append(
            DrivePlan(
                endpoint=plan.endpoint,
                requests=requests,
                conversations=conversations,
                chat=plan.chat,
                turn_slots=plan.turn_slots,
                schedule_s=None if plan.schedule_s is None else plan.schedule_s[worker::workers],
                warmups=plan.warmups[worker::workers],
                num_requests=None if plan.num_requests is None else len(conversations) or len(requests),
                request_rate=plan.request_rate / workers,
                burstiness=plan.burstiness,
                seed=plan.seed + 7919 * worker,
                max_concurrency=concurrency,
                ramp_up_s=plan.ramp_up_s,
                duration_s=plan.duration_s,
                request_timeout_s=plan.request_timeout_s,
                index_offset=worker,
                index_stride=workers,
                rate_ramp=_ramp_share(plan.rate_ramp, workers),
                verify_tls=plan.verify_tls,
                request_id_prefix=plan.request_id_prefix,
            )
        )
    return plans


def _ramp_share(ramp: RateRamp | None, workers: int) -> RateRamp | None:
    """Each of WORKERS gets its share of the ramp's rates (its requests span the same run)."""
    if ramp is None:
        return None
    return RateRamp(ramp.strategy, ramp.start_rps / workers, ramp.end_rps / workers)


_WORKER_COUNTERS: LiveCounters | None = None


def _init_worker(counters: LiveCounters) -> None:
    global _WORKER_COUNTERS
    _WORKER_COUNTERS = counters


def _worker_main(plan: DrivePlan, worker: int, start_at: float) -> DriveOutcome:
    counters = _WORKER_COUNTERS or LiveCounters.local()
    return run_async(Driver(plan, counters, worker, start_at).run())


async def drive_in_workers(
    plan: DrivePlan, workers: int, counters: LiveCounters, before_run: Callable[[], Awaitable[None]] | None = None
) -> DriveOutcome:
    """BEFORE_RUN (--profile): the warm-ups are sent from here first, then it is awaited, then the workers start (so
    that it falls between the warm-ups and the measured run, which the workers' shared start instant cannot tell)."""
    warmed = 0
    if before_run is not None:
        client = StreamingClient(plan.endpoint, plan.request_timeout_s, verify_tls=plan.verify_tls)
        try:
            warmed = await send_warmups(client, plan.warmups, plan.max_concurrency)
        finally:
            client.close()
        await before_run()
        plan = dataclasses.replace(plan, warmups=[])
    plans = split_plan(plan, workers)
    context = multiprocessing.get_context("spawn")
    start_at = time.perf_counter() + WORKER_START_DELAY_S + (2.0 if plan.warmups else 0.0)
    outcomes: list[DriveOutcome] = []
    with ProcessPoolExecutor(len(plans), mp_context=context, initializer=_init_worker, initargs=(counters,)) as pool:
        futures: list[Future[DriveOutcome]] = [
            pool.submit(_worker_main, sub, worker, start_at) for worker, sub in enumerate(plans)
        ]
        interrupted = False
        for future in futures:
            try:
                outcomes.append(await _await_future(future))
            except asyncio.CancelledError:  # Ctrl-C reached the workers too: they return their partial records
                interrupted = True
                outcomes.append(await _await_future(future))
    merged = merge_outcomes(outcomes)
    merged.interrupted = merged.interrupted or interrupted
    merged.warmups_done += warmed
    return merged


async def _await_future(future: Future[DriveOutcome]) -> DriveOutcome:
    return await asyncio.wrap_future(future)


def merge_outcomes(outcomes: list[DriveOutcome]) -> DriveOutcome:
    merged = DriveOutcome(records=[], end_s=0.0)
    for outcome in outcomes:
        merged.records += outcome.records
        merged.uncounted.update(outcome.uncounted)
        merged.turns_not_sent += outcome.turns_not_sent
        merged.end_s = max(merged.end_s, outcome.end_s)
        merged.clock_origin_s = outcome.clock_origin_s
        merged.interrupted = merged.interrupted or outcome.interrupted
        merged.warmups_done += outcome.warmups_done
    return merged
