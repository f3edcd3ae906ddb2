"""Drive a benchmark: check the target, build the workload, send it (warm-up first), collect records, summarise.

The measured run is `_Driver`: a dispatcher releases requests at their arrival offsets (open loop) into at most
max_concurrency slots (closed loop), each request is one task on the streaming client, and records are built
from what arrived. With num_workers > 1 the requests are dealt round-robin to worker processes that share one
start instant (perf_counter is the system's monotonic clock, so their times line up) and the records are merged.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import math
import multiprocessing
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

import httpx

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a Linux/macOS dependency
    uvloop = None  # type: ignore[assignment]

from deepserve import _compat
from deepserve.bench.arrivals import RateRamp, arrival_offsets_s
from deepserve.bench.client import (
    Endpoint,
    RawResponse,
    StreamingClient,
    build_payload,
    build_request_bytes,
    decode_events,
    reconcile_chunk_tokens,
)
from deepserve.bench.config import BenchConfig, TargetConfig
from deepserve.bench.output import BenchResult, save_result
from deepserve.bench.progress import LiveCounters, ProgressDisplay
from deepserve.bench.server_metrics import GATEWAY_ENGINES_PATH, ServerMetricsScraper, ServerMetricsSummary
from deepserve.bench.tokenizer import TokenCounter, TokenizerOptions, load_token_counter
from deepserve.bench.types import RequestRecord, RequestSpec
from deepserve.bench.workloads import Workload, build_workload
from deepserve.errors import DeepserveError, unknown_name

__all__ = ["BenchError", "BenchResult", "run_benchmark", "save_result"]

T = TypeVar("T")
PREFLIGHT_TIMEOUT_S = 10.0
READY_CHECK_INTERVAL_S = 1.0
ID_HEADER_PREFIX = b"x-request-id:"  # lower case: header names are compared case-insensitively
WORKER_START_DELAY_S = 3.0  # time for spawned workers to import and meet at the shared start instant


class BenchError(DeepserveError):
    """The benchmark cannot start: the server is unreachable, rejects us, or does not serve the model."""


@dataclass
class PreparedRequest:
    """A request encoded once before the run, so that sending it is one socket write."""

    spec_index: int
    prompt_len: int
    wire: bytes
    request_id: str = ""  # sent as x-request-id (vLLM's --request-id-prefix + index), kept in the record

    def renamed(self, request_id: str) -> PreparedRequest:
        """The same request under another id: a duration-bound run that goes through the workload again must not
        send an id twice (engines key their request state by it). Raises ValueError unless the request carries its
        id header exactly once (a request sent under a stale id would corrupt the run silently)."""
        head, blank, body = self.wire.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        at = [i for i, line in enumerate(lines) if line.lower().startswith(ID_HEADER_PREFIX)]
        expected = f"x-request-id: {self.request_id}".encode()
        if len(at) != 1 or lines[at[0]] != expected:
            found = [line.decode(errors="replace") for line in lines if line.lower().startswith(ID_HEADER_PREFIX)]
            raise ValueError(
                f"cannot rename request {self.spec_index} to {request_id!r}: expected the header "
                f"{expected.decode()!r} exactly once, found {found or 'none'}"
            )
        lines[at[0]] = f"x-request-id: {request_id}".encode()
        return PreparedRequest(self.spec_index, self.prompt_len, b"\r\n".join(lines) + blank + body, request_id)


@dataclass
class DrivePlan:
    """Everything one driver (the main process, or one worker) needs; picklable for worker processes."""

    endpoint: Endpoint
    requests: list[PreparedRequest]
    warmups: list[PreparedRequest]
    num_requests: int | None  # None: until duration_s
    request_rate: float
    burstiness: float
    seed: int
    max_concurrency: int | None
    ramp_up_s: float | None
    duration_s: float | None
    request_timeout_s: float
    index_offset: int = 0  # worker w sends indices w, w + W, …
    index_stride: int = 1
    request_id_prefix: str = ""  # ids of requests sent again in a duration-bound run: this prefix + their index
    rate_ramp: RateRamp | None = None  # vLLM's --ramp-up-strategy: replaces request_rate for the first batch
    verify_tls: bool = True


@dataclass(repr=False)  # a task's repr (asyncio builds some) must not format thousands of records
class DriveOutcome:
    records: list[RequestRecord]
    texts: dict[int, str]  # generated text of requests without usage, for the tokenizer count afterwards
    end_s: float  # when the last request ended, on the run's clock
    clock_origin_s: float = 0.0  # the run's t = 0 as time.perf_counter() (CLOCK_MONOTONIC: same in every process)
    interrupted: bool = False
    warmups_done: int = 0
    attribution: set[str] = field(default_factory=set)

    def __repr__(self) -> str:
        return f"DriveOutcome({len(self.records)} records, end_s={self.end_s:.3f}, interrupted={self.interrupted})"


def run_benchmark(config: BenchConfig, display: bool = True) -> BenchResult:
    """Run CONFIG's benchmark and return the result (partial and marked incomplete after Ctrl-C)."""
    target, workload_config = config.target, config.workload
    model = preflight(config)
    counter = load_token_counter(
        workload_config.tokenizer,
        target.root_url,
        model,
        target.resolved_api_key(),
        TokenizerOptions(
            served_model=target.request_model(model),
            mode=workload_config.tokenizer_mode,
            trust_remote_code=workload_config.trust_remote_code,
            server_only=workload_config.skip_tokenizer_init,
            verify_tls=not target.insecure,
            chat_template_kwargs=target.template_kwargs(),
        ),
    )
    workload = build_workload(workload_config, counter, target.chat)
    return run_workload(config, model, workload, counter, display)


def run_workload(
    config: BenchConfig, model: str, workload: Workload, counter: TokenCounter | None, display: bool = True
) -> BenchResult:
    """Send WORKLOAD (already built) to the checked target. COUNTER counts output tokens when the server sends
    no usage; without one, one token per chunk is assumed (and the records say so)."""
    if not workload.requests:
        raise BenchError("the workload has no requests; check --num-prompts and the dataset")
    plan = make_plan(config, model, workload.requests)
    raise_open_files_limit()
    started_at = datetime.now()
    outcome, server, profile = run_async(_measure(config, plan, display))
    records = finish_records(outcome, counter)
    return BenchResult(
        config=config,
        model_id=model,
        records=records,
        duration_s=outcome.end_s,
        server=server,
        workload_definition=workload.definition,
        tokenizer_source=workload.tokenizer_source,
        output_tokens_source=_output_source(records),
        token_attribution=",".join(sorted(outcome.attribution)) or "chunks",
        incomplete=outcome.interrupted,
        warmups_done=outcome.warmups_done,
        started_at=started_at,
        clock_origin_s=outcome.clock_origin_s,
        profile=profile,
    )


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


def preflight(config: BenchConfig) -> str:
    """Check the server before any work: reachable, accepts our key, serves the model (and the LoRA adapters).
    Returns --model, else the server's first model."""
    target = config.target
    response = _list_models(target)
    if response.status_code in (401, 403):
        raise BenchError(
            f"the server at {target.root_url} rejected the request with HTTP {response.status_code}; "
            "pass a valid --api-key (or set OPENAI_API_KEY)"
        )
    served = _served_models(response)
    if target.model is None and not target.served_model_name and not served:
        raise BenchError(f"{response.url} lists no models (HTTP {response.status_code}); pass --model")
    model = target.model or target.served_model_name or served[0]
    for name in (target.request_model(model), *target.lora_modules):
        if served and name not in served:
            raise BenchError(unknown_name("model", name, served) + " (as listed by the server's /v1/models)")
    return model


def _list_models(target: TargetConfig) -> httpx.Response:
    """GET /v1/models. With --ready-check-timeout-sec, asked again every second for that long while the server
    cannot be reached, fails (5xx) or lists no model (an engine still loading, a gateway without a healthy
    upstream yet)."""
    url = target.root_url + "/v1/models"
    deadline_s = time.monotonic() + target.ready_check_timeout_sec
    while True:
        try:
            response = httpx.get(
                url, headers=target.request_headers(), timeout=PREFLIGHT_TIMEOUT_S, verify=not target.insecure
            )
        except httpx.HTTPError as exc:
            if time.monotonic() < deadline_s:
                time.sleep(READY_CHECK_INTERVAL_S)
                continue
            waited = f"; waited {target.ready_check_timeout_sec} s" if target.ready_check_timeout_sec else ""
            raise BenchError(
                f"cannot reach the server at {target.root_url} ({exc.__class__.__name__}: {exc}); "
                f"is it running? Check --base-url (or --host/--port){waited}"
            ) from exc
        ready = response.status_code < 500 and (response.status_code != 200 or bool(_served_models(response)))
        if ready or time.monotonic() >= deadline_s:
            return response
        time.sleep(READY_CHECK_INTERVAL_S)


def _served_models(response: httpx.Response) -> list[str]:
    if response.status_code != 200:
        return []
    try:
        data = response.json().get("data", [])
        return [str(item["id"]) for item in data if isinstance(item, dict) and "id" in item]
    except (ValueError, AttributeError):
        return []


def make_plan(config: BenchConfig, model: str, specs: list[RequestSpec]) -> DrivePlan:
    target, load = config.target, config.load
    endpoint = Endpoint.from_url(target.url)
    headers = target.request_headers()
    extras = target.body_extras()
    prefix = target.request_id_prefix if target.request_id_prefix is not None else f"bench-{uuid.uuid4().hex[:8]}-"
    models = target.request_models(model, len(specs), config.workload.seed)

    def prepare(position: int, spec: RequestSpec, request_id: str) -> PreparedRequest:
        payload = build_payload(spec, models[position % len(specs)], target.chat, extras)
        wire = build_request_bytes(endpoint, payload, headers, request_id)
        return PreparedRequest(position, spec.prompt_len, wire, request_id)

    requests = [prepare(i, spec, f"{prefix}{i}") for i, spec in enumerate(specs)]
    warmups = [prepare(i, specs[i % len(specs)], f"{prefix}warmup-{i}") for i in range(load.num_warmups)]
    return DrivePlan(
        endpoint=endpoint,
        requests=requests,
        warmups=warmups,
        num_requests=None if load.duration_s is not None else len(requests),
        request_rate=load.request_rate,
        burstiness=load.burstiness,
        seed=config.workload.seed,
        max_concurrency=load.max_concurrency,
        ramp_up_s=load.ramp_up_s,
        duration_s=load.duration_s,
        request_timeout_s=target.request_timeout_s,
        rate_ramp=load.rate_ramp(),
        verify_tls=not target.insecure,
        request_id_prefix=prefix,
    )


async def _measure(
    config: BenchConfig, plan: DrivePlan, display: bool
) -> tuple[DriveOutcome, ServerMetricsSummary, str | None]:
    profiler = _Profiler(config) if config.metrics.profile else None
    before_run = profiler.start if profiler is not None else None
    scraper = _scraper(config)
    if scraper is not None:
        await scraper.start()
    workers = config.load.num_workers
    counters = LiveCounters.shared(workers) if workers > 1 else LiveCounters.local()
    total = plan.num_requests
    try:
        async with ProgressDisplay(counters, total, plan.duration_s, display and not config.output.disable_tqdm):
            if workers > 1:
                outcome = await _drive_in_workers(plan, workers, counters, before_run)
            else:
                outcome = await _Driver(plan, counters, worker=0, before_run=before_run).run()
    finally:  # whatever happened to the run, a profiler we started is stopped, and the scraper's client closed
        profile = await profiler.stop() if profiler is not None else None
        server = await scraper.stop() if scraper is not None else ServerMetricsSummary(False, "disabled")
    return outcome, server, profile


class _Profiler:
    """vLLM's --profile: the server's profiler runs from after the warm-ups (as vLLM starts it) to the run's end."""

    def __init__(self, config: BenchConfig) -> None:
        self.config = config
        self.started = False

    async def start(self) -> None:
        await _profile_call(self.config, "/start_profile")
        self.started = True

    async def stop(self) -> str | None:
        """What happened to the profile, for the results (None: never started)."""
        if not self.started:
            return None
        try:
            await _profile_call(self.config, "/stop_profile")
        except BenchError as exc:  # the run's data stands; say why the profile may be incomplete
            return f"started, but stopping failed: {exc}"
        return "started after the warm-ups, stopped after the run"


async def _profile_call(config: BenchConfig, path: str) -> None:
    """vLLM's profiler endpoints (the server needs a profiler config, else they are 404)."""
    target = config.target
    url = target.root_url + path
    try:
        async with httpx.AsyncClient(timeout=PREFLIGHT_TIMEOUT_S * 6, verify=not target.insecure) as client:
            response = await client.post(url, headers=target.request_headers())
    except httpx.HTTPError as exc:
        raise BenchError(f"--profile: POST {url} failed ({exc.__class__.__name__}: {exc})") from exc
    if response.status_code != 200:
        raise BenchError(
            f"--profile: POST {url} answered HTTP {response.status_code}; start vLLM with a profiler config "
            "(--profiler-config) and send the benchmark to the engine itself, not through a gateway"
        )


def _scraper(config: BenchConfig) -> ServerMetricsScraper | None:
    metrics = config.metrics
    if not metrics.server_metrics:
        return None
    root = config.target.root_url
    url = metrics.server_metrics_url or root + "/metrics"
    fallback = None if metrics.server_metrics_url else root + GATEWAY_ENGINES_PATH  # behind deepserve's gateway
    headers = config.target.request_headers()
    verify = not config.target.insecure
    return ServerMetricsScraper(url, metrics.server_metrics_interval_s, headers, fallback, verify)


class _Driver:
    """Releases PLAN's requests on schedule into the concurrency limit and turns responses into records."""

    def __init__(
        self,
        plan: DrivePlan,
        counters: LiveCounters,
        worker: int,
        start_at: float | None = None,
        before_run: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """BEFORE_RUN: awaited between the warm-ups and the measured run (--profile starts the profiler there)."""
        self.plan = plan
        self.before_run = before_run
        self.counters = counters
        self.worker = worker
        self.start_at = start_at
        self.client = StreamingClient(plan.endpoint, plan.request_timeout_s, verify_tls=plan.verify_tls)
        self.t0 = 0.0
        self.in_flight = 0
        self.slot_freed = asyncio.Event()
        self.tasks: set[asyncio.Task[None]] = set()
        self.outcome = DriveOutcome(records=[], texts={}, end_s=0.0)

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
            delay_s = self.t0 + offset_s - time.perf_counter()
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            await self._wait_for_slot()
            if plan.duration_s is not None and time.perf_counter() - self.t0 >= plan.duration_s:
                return
            request = plan.requests[position % len(plan.requests)]
            index = plan.index_offset + position * plan.index_stride
            if position >= len(plan.requests) and request.request_id:
                request = request.renamed(f"{plan.request_id_prefix}{index}")
            self.in_flight += 1
            task = asyncio.create_task(self._one(index, request, offset_s))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def _offsets(self) -> Iterator[float]:
        """Arrival offsets (s after t0): zeros in closed loop, else the arrival process, batch after batch (a
        duration-bound run may need more than one workload's worth; a ramp spans the first batch, the later ones
        keep its final rate)."""
        plan = self.plan
        rate = plan.rate_ramp.end_rps if plan.rate_ramp is not None else plan.request_rate
        if math.isinf(rate):
            while True:
                yield 0.0
        batch = max(len(plan.requests), 1)
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
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.slot_freed.wait(), 0.05)

    async def _one(self, index: int, request: PreparedRequest, scheduled_s: float) -> None:
        try:
            sent_abs, response = await self.client.send(request.wire)
        except Exception as exc:  # a client bug must not end the run: the request fails, with the reason
            now = time.perf_counter()
            sent_abs, response = now, RawResponse(error=f"client error: {exc.__class__.__name__}: {exc}", end_s=now)
        finally:
            self.in_flight -= 1
            self.slot_freed.set()
        try:
            record, text, source = build_record(index, request.prompt_len, scheduled_s, sent_abs, response, self.t0)
        except Exception as exc:
            error = f"undecodable response: {exc.__class__.__name__}: {exc}"
            record, text, source = (
                RequestRecord(index, request.prompt_len, scheduled_s, sent_abs - self.t0, error=error),
                "",
                "",
            )
        record.request_id = request.request_id
        self.outcome.records.append(record)
        if record.output_len_source == "tokenizer":
            self.outcome.texts[index] = text
        if source:
            self.outcome.attribution.add(source)
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


def build_record(
    index: int, prompt_len: int, scheduled_s: float, sent_abs: float, response: Any, t0: float
) -> tuple[RequestRecord, str, str]:
    """(record, generated text, token attribution) from a finished raw response; times relative to T0."""
    decoded = decode_events(response)
    record = RequestRecord(
        index=index,
        prompt_len=decoded.usage_prompt_tokens or prompt_len,
        scheduled_s=scheduled_s,
        sent_s=sent_abs - t0,
        end_s=None if response.end_s is None else response.end_s - t0,
        status_code=response.status or None,
        error=decoded.error,
    )
    times = [arrived - t0 for arrived in decoded.chunk_times]
    tokens = decoded.chunk_tokens
    if decoded.usage_completion_tokens is not None:
        record.output_len = decoded.usage_completion_tokens
        tokens = reconcile_chunk_tokens(tokens, record.output_len)
    else:
        record.output_len = sum(tokens)
        record.output_len_source = "tokenizer"  # counted from the text after the run
    set_chunks(record, times, tokens)
    return record, decoded.text, decoded.token_count_source if times else ""


def set_chunks(record: RequestRecord, times: list[float], tokens: list[int]) -> None:
    """Keep the chunks that carry tokens after reconciliation (the first one always)."""
    kept = [(t, k) for position, (t, k) in enumerate(zip(times, tokens, strict=True)) if k > 0 or position == 0]
    record.chunk_times_s = [t for t, _ in kept]
    record.chunk_tokens = [k for _, k in kept]
    record.first_token_s = record.chunk_times_s[0] if kept else None


def finish_records(outcome: DriveOutcome, counter: TokenCounter | None) -> list[RequestRecord]:
    """Count the output of requests whose server sent no usage with the tokenizer (after the run, so that the
    tokenizer never competes with timing)."""
    for record in outcome.records:
        if record.output_len_source == "tokenizer" and counter is None:
            record.output_len_source = "chunks"  # nothing to count with: one token per chunk
        elif record.output_len_source == "tokenizer" and record.success and counter is not None:
            record.output_len = counter.count(outcome.texts.get(record.index, "")) or record.output_len
            set_chunks(record, record.chunk_times_s, reconcile_chunk_tokens(record.chunk_tokens, record.output_len))
    return sorted(outcome.records, key=lambda record: record.index)


def _output_source(records: list[RequestRecord]) -> str:
    sources = {record.output_len_source for record in records if record.success}
    if not sources:
        return "none"
    return sources.pop() if len(sources) == 1 else "mixed"


# --- worker processes ---------------------------------------------------------------------------------------------


def split_plan(plan: DrivePlan, workers: int) -> list[DrivePlan]:
    """Deal the requests round-robin; each worker gets its share of the rate, the concurrency and the warm-ups."""
    plans = []
    for worker in range(workers):
        requests = plan.requests[worker::workers]
        if not requests:
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
                warmups=plan.warmups[worker::workers],
                num_requests=None if plan.num_requests is None else len(requests),
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
    return run_async(_Driver(plan, counters, worker, start_at).run())


async def _drive_in_workers(
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
    merged = DriveOutcome(records=[], texts={}, end_s=0.0)
    for outcome in outcomes:
        merged.records += outcome.records
        merged.texts.update(outcome.texts)
        merged.end_s = max(merged.end_s, outcome.end_s)
        merged.clock_origin_s = outcome.clock_origin_s
        merged.interrupted = merged.interrupted or outcome.interrupted
        merged.warmups_done += outcome.warmups_done
        merged.attribution |= outcome.attribution
    return merged
