"""The engine core: scheduler steps on a simulated timeline, through the pipeline stages, with vLLM's metrics.

It is synchronous and is told the time: the real-time server (engine.py) drives it from clock callbacks, the
closed-loop driver (closed_loop.py) from a discrete-event loop, and tests step it by hand.

Pipeline parallelism: like vLLM's batch queue, up to `stages` steps are in flight at once; a step enters stage 0
when stage 0 is free and passes every stage in turn (each stage takes the step model's time for the batch, that of
the first stage, the largest). Its tokens appear when it leaves the last stage. With one stage a step starts when
the last one ended.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace

from deepserve.simulate.metrics import CounterReading, EngineMetrics, GaugeReading
from deepserve.simulate.scheduler import ScheduledBatch, Scheduler, SimRequest, StepOutput
from deepserve.simulate.timing import StepTimer


@dataclass(frozen=True)
class InFlightStep:
    batch: ScheduledBatch
    start_s: float
    stage_s: float
    finish_s: float


class EngineCore:
    def __init__(self, scheduler: Scheduler, timer: StepTimer, stages: int = 1) -> None:
        if stages < 1:
            raise ValueError("a pipeline has at least one stage")
        self.scheduler = scheduler
        self.timer = timer
        self.stages = stages
        self.metrics = EngineMetrics(scheduler.limits.max_model_len)
        self.in_flight: deque[InFlightStep] = deque()
        self.busy_s = 0.0  # stage-0 time spent on steps (utilisation = busy_s / elapsed)
        self.steps_started = 0
        self.scheduled_entries = 0  # requests in steps, summed over steps (mean batch = this / steps_started)
        self._stage_free_s = [0.0] * stages

    @property
    def max_model_len(self) -> int:
        return self.scheduler.limits.max_model_len

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    @property
    def has_room(self) -> bool:
        """Another step may enter the pipeline (fewer than `stages` in flight)."""
        return len(self.in_flight) < self.stages

    @property
    def entry_free_s(self) -> float:
        """When stage 0 can take the next step."""
        return self._stage_free_s[0]

    @property
    def next_finish_s(self) -> float:
        return self.in_flight[0].finish_s if self.in_flight else math.inf

    def add(self, request: SimRequest) -> None:
        self.scheduler.add(request)

    def abort(self, request: SimRequest, now_s: float) -> bool:
        if not self.scheduler.abort(request):
            return False
        self._observe_finished(request, now_s)
        return True

    def start_step(self, start_s: float) -> InFlightStep | None:
        """Schedule one step starting at START_S (stage 0 must be free by then); None when nothing can run."""
        batch = self.scheduler.schedule(start_s)
        if batch.empty:
            return None
        stage_s = self.timer.step_s(batch)
        finish_s = start_s
        for stage in range(self.stages):
            finish_s = max(finish_s, self._stage_free_s[stage]) + stage_s
            self._stage_free_s[stage] = finish_s
        step = InFlightStep(batch, start_s, stage_s, finish_s)
        self.in_flight.append(step)
        self.busy_s += stage_s
        self.steps_started += 1
        self.scheduled_entries += len(batch.entries)
        self.metrics.iteration_tokens.observe(batch.num_tokens)
        return step

    def finish_step(self) -> tuple[InFlightStep, list[StepOutput]]:
        """The oldest step in flight ends: its outputs, observed in the metrics."""
        step = self.in_flight.popleft()
        outputs = self.scheduler.update(step.batch, step.finish_s)
        metrics = self.metrics
        for output in outputs:
            request = output.request
            if output.previous_token_s is None:
                metrics.ttft.observe(step.finish_s - request.arrival_s)
            else:
                metrics.itl.observe(step.finish_s - output.previous_token_s)
            if output.finish_reason is not None:
                self._observe_finished(request, step.finish_s)
        return step, outputs

    def _observe_finished(self, request: SimRequest, now_s: float) -> None:
        self.metrics.observe_finished(
            request.finish_reason or "abort",
            request.arrival_s,
            request.first_scheduled_s,
            request.first_token_s,
            now_s,
            request.num_prompt_tokens,
            len(request.output_token_ids),
        )

    def gauges(self) -> GaugeReading:
        scheduler = self.scheduler
        return GaugeReading(len(scheduler.running), len(scheduler.waiting), scheduler.kv.usage)

    def counters(self) -> CounterReading:
        c, spec = self.scheduler.counters, self.scheduler.spec_counters
        reading = CounterReading(c.prompt_tokens, c.generation_tokens, c.preemptions, c.prefix_queries, c.prefix_hits)
        if spec is None:
            return reading
        return replace(
            reading,
            spec_drafts=spec.drafts,
            spec_draft_tokens=spec.draft_tokens,
            spec_accepted_tokens=spec.accepted_tokens,
            spec_accepted_per_position=tuple(spec.accepted_per_position),
        )
