"""A finite benchmark run forecast in virtual time: plan's `BenchmarkForecaster`, implemented by the simulator.

The planner's deployment (KV cache, max_num_seqs, token budget, layout) and its step model drive the simulator's
scheduler; a client sends the run's requests as the benchmark would (all at once, at a Poisson rate, under a
concurrency cap), and the forecast reports what the benchmark prints: TTFT, TPOT, ITL and end-to-end latency
(mean, median, P99), throughputs and the run's duration. Its first wave, its queue and its drain are in it, which
the steady closed-loop formula leaves out.

Two things the simulator's single scheduler does not do, modelled here:
- data-parallel attention: each rank runs its own scheduler (requests go to the least loaded), all ranks step
  together and the step lasts as long as the busiest rank's work (the experts see every rank's tokens);
- engines that do not mix prompts into decode steps (SGLang): a step either prefills (prompts first) or decodes.

With speculative decoding (the deployment's), every rank's scheduler drafts and accepts as the simulator's does
(simulate/speculation.py, seeded), and the steps are taken one by one (acceptance varies from step to step).
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field

from deepserve.engines.vllm import default_batch_limits, default_block_size
from deepserve.plan.benchmark import BenchmarkForecast, BenchmarkRun, Stats
from deepserve.plan.perf import PerformanceModel, RankLoad
from deepserve.plan.types import Deployment
from deepserve.simulate.clock import ManualClock
from deepserve.simulate.core import EngineCore
from deepserve.simulate.engine import SteppedEngine
from deepserve.simulate.kv_cache import KVCacheManager
from deepserve.simulate.scheduler import (
    ScheduledBatch,
    Scheduler,
    SchedulerCounters,
    SchedulerLimits,
    SimRequest,
    StepOutput,
)
from deepserve.simulate.speculation import AcceptanceSampler, Drafting
from deepserve.simulate.timing import PlannerStepTimer

PROMPT_TOKEN = 1  # prefix caching is off for a benchmark's random prompts: their contents do not matter


class SimulatorForecaster:
    """plan.benchmark.BenchmarkForecaster: the run through the simulator's scheduler, in virtual time."""

    def forecast(self, deployment: Deployment, model: PerformanceModel, run: BenchmarkRun) -> BenchmarkForecast:
        core = build_forecast_core(deployment, model)
        runner = _FastRun if deployment.layout.pp == 1 else _SteppedRun
        return runner(core, run, model.request_overhead_s).result()


# ---- the engine ---------------------------------------------------------------------------------------------


def build_forecast_core(deployment: Deployment, model: PerformanceModel) -> EngineCore:
    """The simulated engine of DEPLOYMENT timed by MODEL: one scheduler per data-parallel rank."""
    dp = deployment.layout.dp
    schedulers = [_rank_scheduler(deployment, model) for _ in range(dp)]
    if dp == 1:
        return EngineCore(schedulers[0], MemoStepTimer(model), deployment.layout.pp)
    return EngineCore(DataParallelScheduler(schedulers), RankedStepTimer(model), deployment.layout.pp)  # type: ignore[arg-type]


def _rank_scheduler(deployment: Deployment, model: PerformanceModel) -> Scheduler:
    memory, layout, accelerator = deployment.memory, deployment.layout, deployment.accelerator
    block_size = default_block_size(deployment.spec.is_mla, accelerator)
    default_seqs, _ = default_batch_limits(accelerator)
    seqs = deployment.max_num_seqs_in_effect or default_seqs
    pool = deployment.engine_pool_sequences_per_rank  # SGLang's V4 sliding-window pool, at the planned prompts
    if pool is not None:
        seqs = max(min(seqs, pool), 1)
    limits = SchedulerLimits(
        max_num_seqs=seqs * deployment.micro_batches_capped(),
        max_num_batched_tokens=deployment.prefill_tokens_per_rank_step,
        max_model_len=memory.max_model_len,
    )
    blocks = max(memory.kv_cache_tokens // layout.dp // block_size, 1)
    state_blocks = 0
    cache = memory.kv_layout
    if cache is not None and not cache.is_linear and cache.block_bytes:
        # V4: vLLM's pool of blocks (models/kv_cache.py): the growing cache's block holds kv_block_tokens tokens,
        # every request also holds its windows' and compressor state's blocks; the pages prompts in flight hold
        # beyond their windows are not the decoding requests' to use
        block_size = memory.kv_block_tokens
        blocks = max((memory.kv_cache_bytes_per_gpu - memory.kv_prompt_in_flight_bytes) // cache.block_bytes, 1)
        state_blocks = memory.kv_state_blocks_per_sequence
    kv = KVCacheManager(blocks, block_size, memory.max_model_len, False, state_blocks)
    speculation = deployment.speculation
    drafting = None
    if speculation is not None:
        drafting = Drafting(speculation.num_tokens, AcceptanceSampler(speculation.acceptance, seed=0))
    scheduler = Scheduler if model.mixed_prefill else PrefillFirstScheduler
    return scheduler(limits, kv, drafting)


class PrefillFirstScheduler(Scheduler):
    """SGLang's policy: a step prefills (the rest of a chunked prompt, then new prompts within the token budget) or,
    when no prompt can start, decodes every running request; prompts never share a step with decodes."""

    def schedule(self, now_s: float = 0.0) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self._continue_prompts(batch, self.limits.max_num_batched_tokens)
        self._schedule_waiting(batch, budget, now_s)
        if batch.empty:
            self._schedule_running(batch, self.limits.max_num_batched_tokens)
        self.counters.steps += 1 if batch.entries else 0
        return batch

    def _continue_prompts(self, batch: ScheduledBatch, budget: int) -> int:
        for request in self.running:
            remaining = request.num_prompt_tokens - request.num_computed_tokens
            if remaining <= 0 or budget <= 0:
                continue
            tokens = min(remaining, budget)
            if not self.kv.allocate(request, tokens):
                break
            batch.add(request, tokens)
            request.num_computed_tokens += tokens
            budget -= tokens
        return budget


@dataclass
class RankedBatch(ScheduledBatch):
    """One step of every data-parallel rank: the ranks' batches, merged for the counts."""

    ranks: list[ScheduledBatch] = field(default_factory=list)


class DataParallelScheduler:
    """One scheduler per data-parallel rank behind the Scheduler interface EngineCore uses: requests go to the rank
    with the fewest requests (vLLM's DP coordinator balances on load), every rank schedules its own step."""

    def __init__(self, ranks: list[Scheduler]) -> None:
        self.ranks = ranks
        self.limits = ranks[0].limits
        self.kv = ranks[0].kv
        self._rank_of: dict[str, Scheduler] = {}

    @property
    def has_unfinished(self) -> bool:
        return any(rank.has_unfinished for rank in self.ranks)

    @property
    def running(self) -> list[SimRequest]:
        return [request for rank in self.ranks for request in rank.running]

    @property
    def waiting(self) -> list[SimRequest]:
        return [request for rank in self.ranks for request in rank.waiting]

    @property
    def counters(self) -> SchedulerCounters:
        total = SchedulerCounters()
        for rank in self.ranks:
            for name, value in vars(rank.counters).items():
                setattr(total, name, getattr(total, name) + value)
        return total

    def add(self, request: SimRequest) -> None:
        rank = min(self.ranks, key=lambda r: len(r.running) + len(r.waiting))
        self._rank_of[request.request_id] = rank
        rank.add(request)

    def abort(self, request: SimRequest) -> bool:
        rank = self._rank_of.get(request.request_id)
        return rank.abort(request) if rank is not None else False

    def rank_of(self, request: SimRequest) -> Scheduler:
        return self._rank_of[request.request_id]

    def schedule(self, now_s: float = 0.0) -> RankedBatch:
        merged = RankedBatch()
        for rank in self.ranks:
            batch = rank.schedule(now_s)
            merged.ranks.append(batch)
            merged.entries.extend(batch.entries)
            merged.decode_tokens += batch.decode_tokens
            merged.prefill_tokens += batch.prefill_tokens
            merged.decode_context_tokens += batch.decode_context_tokens
            merged.prefill_positions += batch.prefill_positions
            merged.preempted.extend(batch.preempted)
        return merged

    def update(self, batch: RankedBatch, now_s: float = 0.0) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        for rank, part in zip(self.ranks, batch.ranks, strict=True):
            outputs.extend(rank.update(part, now_s))
        for output in outputs:
            if output.finish_reason is not None:
                self._rank_of.pop(output.request.request_id, None)
        return outputs


def _rounded(value: float) -> float:
    """VALUE to three significant digits: step times of contexts within 0.5% of each other are taken as one."""
    return float(f"{value:.3g}")


class MemoStepTimer(PlannerStepTimer):
    """The planner's step model with its answers remembered: a benchmark of thousands of requests asks for the same
    step (the same batch, contexts within 0.5%) thousands of times."""

    def __init__(self, model: PerformanceModel) -> None:
        super().__init__(model)
        self._seen: dict[tuple[float, ...], float] = {}

    def step_s(self, batch: ScheduledBatch) -> float:
        mean = batch.prefill_positions / batch.prefill_tokens if batch.prefill_tokens else 0.0
        key = (batch.decode_tokens, batch.prefill_tokens, _rounded(batch.context_len), _rounded(mean),
               batch.queries_per_sequence)  # fmt: skip
        if key not in self._seen:
            self._seen[key] = super().step_s(batch)
        return self._seen[key]


class RankedStepTimer:
    """A data-parallel step lasts as long as its busiest rank: each rank's attention and dense layers on its own
    tokens, the experts on every rank's tokens."""

    def __init__(self, model: PerformanceModel) -> None:
        self.model = model
        self.request_overhead_s = model.request_overhead_s
        self._seen: dict[tuple[object, ...], float] = {}

    def step_s(self, batch: ScheduledBatch) -> float:
        assert isinstance(batch, RankedBatch)
        loads = {_load(part) for part in batch.ranks if not part.empty}
        context = _rounded(batch.context_len)
        queries = batch.queries_per_sequence  # with drafts: the drafts each decoding sequence verifies, and itself
        return max(
            self._rank_step_s(batch.decode_tokens, batch.prefill_tokens, context, load, queries) for load in loads
        )

    def _rank_step_s(self, decode: int, prefill: int, context: float, load: RankLoad, queries: float) -> float:
        key = (decode, prefill, context, load, queries)
        if key not in self._seen:
            step = self.model.step(decode, prefill, context, rank=load, queries_per_sequence=queries)
            self._seen[key] = step.total_s
        return self._seen[key]


def _load(batch: ScheduledBatch) -> RankLoad:
    mean = _rounded(batch.prefill_positions / batch.prefill_tokens) if batch.prefill_tokens else None
    return RankLoad(batch.decode_tokens, batch.prefill_tokens, 0.0, mean)


# ---- the client ---------------------------------------------------------------------------------------------


@dataclass
class _Record:
    sent_s: float
    prompt_len: int
    timed: bool  # not one of the run's warm-up requests
    first_s: float | None = None
    last_s: float | None = None
    tokens: int = 0
    gaps_s: list[tuple[float, int]] = field(default_factory=list)  # (gap, how many tokens came after such a gap)


class _Client:
    """The benchmark client: requests arrive (at once or at a Poisson rate), wait for a slot under the concurrency
    cap, and are timed as vLLM's benchmark times them (from the moment a request is sent). The engine's scheduler
    sees a request REQUEST_OVERHEAD_S after it was sent (the API server's work before its first token that no step
    accounts for: the engine profile's per-request overhead)."""

    def __init__(self, core: EngineCore, run: BenchmarkRun, request_overhead_s: float = 0.0) -> None:
        self.run = run
        self.core = core
        self.overhead_s = request_overhead_s
        self.inbox: deque[tuple[float, SimRequest]] = deque()  # sent, not yet with the engine: (when it is, request)
        self.random = random.Random(run.seed)
        self.records: dict[str, _Record] = {}
        self.arrivals = deque(self._arrivals())  # (time, prompt_len, output_len), in time order
        self.ready: deque[tuple[float, int, int]] = deque()  # arrived or slot freed: (send time, lengths)
        self.in_flight = 0
        self.sent = 0
        self.end_s = 0.0

    def _arrivals(self) -> list[tuple[float, int, int]]:
        rate, times, now = self.run.request_rate, [], 0.0
        for _ in range(self.run.num_prompts):
            times.append((now, self._draw(self.run.input_len, self.run.input_spread), self._output_len()))
            if rate:
                now += self.random.expovariate(rate)
        return times

    def _output_len(self) -> int:
        return max(self._draw(self.run.output_len, self.run.output_spread), 2)

    def _draw(self, mean: int, spread: float) -> int:
        width = round(mean * spread)
        return max(self.random.randint(mean - width, mean + width), 1)

    def next_send_s(self) -> float:
        """When the next request can be sent (an arrival, or one waiting, with a free slot); inf while every slot
        is taken (a request's end frees one)."""
        cap = self.run.concurrency
        if cap is not None and self.in_flight >= cap:
            return math.inf
        return min((queue[0][0] for queue in (self.ready, self.arrivals) if queue), default=math.inf)

    def next_event_s(self) -> float:
        """The next send or the next request reaching the engine."""
        return min(self.next_send_s(), self.inbox[0][0] if self.inbox else math.inf)

    def engine_due(self, now_s: float) -> list[SimRequest]:
        """Requests sent by NOW_S whose API-server overhead is over: the engine takes them now."""
        for request in self.requests_due(now_s):
            self.inbox.append((now_s + self.overhead_s, request))
        due = []
        while self.inbox and self.inbox[0][0] <= now_s:
            due.append(self.inbox.popleft()[1])
        return due

    def requests_due(self, now_s: float) -> list[SimRequest]:
        """The requests sent by NOW_S: arrivals in order, as slots allow."""
        while self.arrivals and self.arrivals[0][0] <= now_s:
            self.ready.append(self.arrivals.popleft())
        due = []
        cap = self.run.concurrency
        while self.ready and self.ready[0][0] <= now_s and (cap is None or self.in_flight < cap):
            _, prompt_len, output_len = self.ready.popleft()
            due.append(self._request(now_s, prompt_len, output_len))  # sent now: when it arrived or got a slot
        return due

    def _request(self, sent_s: float, prompt_len: int, output_len: int) -> SimRequest:
        self.in_flight += 1
        request_id = f"req-{self.sent}"
        self.sent += 1
        self.records[request_id] = _Record(sent_s, prompt_len, timed=self.sent > self.run.warmup_requests)
        request = SimRequest(request_id, [PROMPT_TOKEN] * prompt_len, output_len, ignore_eos=True, sink=self)
        request.arrival_s = sent_s
        return request

    def on_tokens(self, request: SimRequest, token_ids: list[int], finish_reason: str | None, now_s: float) -> None:
        self.tokens_at(request.request_id, now_s, len(token_ids), 1)
        if finish_reason is not None:
            self.finished(now_s)

    def tokens_at(self, request_id: str, now_s: float, count: int, steps: int) -> None:
        """COUNT tokens over STEPS equal steps ending at NOW_S (the first at its own time)."""
        record = self.records[request_id]
        if record.first_s is None:
            record.first_s = now_s
        elif record.last_s is not None:
            record.gaps_s.append(((now_s - record.last_s) / steps, steps))
        record.last_s = now_s
        record.tokens += count

    def finished(self, now_s: float) -> None:
        self.in_flight -= 1  # a request waiting for a slot is sent at the next step boundary, when the loop asks
        self.end_s = max(self.end_s, now_s)

    def forecast(self) -> BenchmarkForecast:
        done = [r for r in self.records.values() if r.first_s is not None and r.last_s is not None]
        if len(done) < self.run.num_prompts:
            raise RuntimeError(f"only {len(done)} of {self.run.num_prompts} simulated requests finished")
        done = [r for r in done if r.timed]
        start_s = min(r.sent_s for r in done)
        ttfts = [(r.first_s or 0.0) - r.sent_s for r in done]
        tpots = [((r.last_s or 0.0) - (r.first_s or 0.0)) / (r.tokens - 1) for r in done if r.tokens > 1]
        gaps = [gap for r in done for gap in r.gaps_s]
        e2els = [(r.last_s or 0.0) - r.sent_s for r in done]
        return BenchmarkForecast(
            run=self.run,
            duration_s=self.end_s - start_s,
            output_tokens=sum(r.tokens for r in done),
            input_tokens=sum(r.prompt_len for r in done),
            ttft_ms=_ms(ttfts),
            tpot_ms=_ms(tpots),
            itl_ms=Stats.weighted([(gap * 1e3, count) for gap, count in gaps]),
            e2el_ms=_ms(e2els),
            preemptions=self.core.scheduler.counters.preemptions,
        )


class _SteppedRun(_Client):
    """Through the simulator's engine on a manual clock, step by step (pipelines: steps overlap across stages)."""

    def result(self) -> BenchmarkForecast:
        clock = ManualClock()
        engine = SteppedEngine(self.core, clock)

        def pump() -> None:
            now = clock.now()
            for request in self.requests_due(now):
                engine.submit(request)  # the engine holds it for the per-request overhead
            upcoming = self.next_send_s()
            if upcoming < math.inf:
                clock.call_at(upcoming, pump)

        self._pump = pump
        clock.call_at(0.0, pump)
        clock.run_until_idle()
        return self.forecast()

    def finished(self, now_s: float) -> None:
        super().finished(now_s)
        self._pump()


class _FastRun(_Client):
    """The scheduler's steps one by one while anything changes; a stretch of steps in which every running request
    only decodes and nothing arrives or ends is taken in one move (the same steps, timed at the stretch's mean
    context): a benchmark of hundreds of requests takes a fraction of a second."""

    def result(self) -> BenchmarkForecast:
        scheduler, now = self.core.scheduler, 0.0
        while True:
            for request in self.engine_due(now):
                scheduler.add(request)
            if not scheduler.has_unfinished:
                upcoming = self.next_event_s()
                if upcoming == math.inf:
                    break
                now = upcoming
                continue
            now = self._advance(now)
        return self.forecast()

    def _advance(self, now_s: float) -> float:
        batch = self.core.scheduler.schedule(now_s)
        if batch.empty:  # nothing fits until a request ends or arrives: wait for the next send
            upcoming = self.next_event_s()
            if upcoming == math.inf:
                raise RuntimeError("the simulated engine can schedule nothing and nothing is left to arrive")
            return upcoming
        steps = self._stretch(batch, now_s)
        if steps > 1:
            _shift_context(batch, (steps - 1) / 2)
        step_s = self.core.timer.step_s(batch)
        end_s = now_s + step_s
        for output in self.core.scheduler.update(batch, end_s):
            self.on_tokens(output.request, output.token_ids, output.finish_reason, end_s)
        if steps > 1:
            end_s = self._decode_more(batch, steps - 1, step_s, end_s)
        return end_s

    def _stretch(self, batch: ScheduledBatch, now_s: float) -> int:
        """How many steps like BATCH (decodes only) can run before anything changes: the first request to end,
        the next request sent, the KV cache's free blocks."""
        scheduler = self.core.scheduler
        # waiting requests the scheduler left out of a decode-only step without preempting stay out until a request
        # ends: decoding only takes blocks (the KV room below), max_num_seqs and the token budget stay as they are
        if batch.prefill_tokens or batch.preempted or not batch.decode_tokens or scheduler_drafts(scheduler):
            return 1
        remaining = min(request.max_tokens - len(request.output_token_ids) for request, _, _ in batch.entries)
        steps = remaining - 1  # the step that ends a request runs on its own
        upcoming = self.next_event_s()
        if upcoming < math.inf:
            estimate = self.core.timer.step_s(batch)
            steps = min(steps, int((upcoming - now_s) / estimate))
        return max(min(steps, _kv_room_steps(scheduler, batch)), 1)

    def _decode_more(self, batch: ScheduledBatch, steps: int, step_s: float, start_s: float) -> float:
        end_s = start_s + steps * step_s
        counters = self.core.scheduler.counters
        for request, _, _ in batch.entries:
            _kv_of(self.core.scheduler, request).allocate(request, steps)
            request.num_computed_tokens += steps
            request.output_token_ids.extend([request.output_token_ids[-1]] * steps)
            request.num_tokens += steps
            request.last_token_s = end_s
            counters.generation_tokens += steps
            self.tokens_at(request.request_id, end_s, steps, steps)
        return end_s


def _shift_context(batch: ScheduledBatch, tokens: float) -> None:
    """Time a stretch at its mean context: every decoding sequence TOKENS further on."""
    batch.decode_context_tokens += round(batch.decode_tokens * tokens)
    for part in getattr(batch, "ranks", ()):
        part.decode_context_tokens += round(part.decode_tokens * tokens)


def scheduler_drafts(scheduler: Scheduler | DataParallelScheduler) -> bool:
    """Whether the scheduler drafts (speculative decoding): its steps yield a random number of tokens each."""
    ranks = scheduler.ranks if isinstance(scheduler, DataParallelScheduler) else [scheduler]
    return any(rank.drafting is not None for rank in ranks)


def _kv_of(scheduler: Scheduler | DataParallelScheduler, request: SimRequest) -> KVCacheManager:
    if isinstance(scheduler, DataParallelScheduler):
        return scheduler.rank_of(request).kv
    return scheduler.kv


def _kv_room_steps(scheduler: Scheduler | DataParallelScheduler, batch: ScheduledBatch) -> int:
    """Steps the decoding requests can take before some rank's KV cache runs out of free blocks (then the
    scheduler preempts, which only step-by-step scheduling reproduces)."""
    ranks = scheduler.ranks if isinstance(scheduler, DataParallelScheduler) else [scheduler]
    room = math.inf
    for rank in ranks:
        running = len(rank.running)
        if running:
            room = min(room, rank.kv.pool.num_free // running * rank.kv.block_size)
    return int(min(room, 1_000_000))


def _ms(values: list[float]) -> Stats:
    return Stats.of([value * 1e3 for value in values])
