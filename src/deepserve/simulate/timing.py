"""How long one engine step takes: the planner's step model for a deployment, or a fixed time (tests).

The planner's `PerformanceModel.step(decode_tokens, prefill_tokens, context_len).total_s` is the time of one step
of the first pipeline stage; the simulator asks it once per step with what the scheduler actually put in that step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from deepserve.simulate.scheduler import ScheduledBatch

if TYPE_CHECKING:
    from deepserve.plan.perf import PerformanceModel


class StepTimer(Protocol):
    request_overhead_s: float  # from a request's arrival to its being schedulable (the API server's own work)

    def step_s(self, batch: ScheduledBatch) -> float:
        """Seconds one pipeline stage spends on BATCH."""
        ...


class PlannerStepTimer:
    """The planner's step model: the batch's bytes and FLOPs at the kernel table's rates, plus engine overheads."""

    def __init__(self, model: PerformanceModel) -> None:
        self.model = model
        self.request_overhead_s = model.request_overhead_s  # the engine profile's per-request overhead

    def step_s(self, batch: ScheduledBatch) -> float:
        # each prompt attends to its own positions: the mean over the step's prompt tokens, not half their sum
        mean_position = batch.prefill_positions / batch.prefill_tokens if batch.prefill_tokens else None
        cost = self.model.step(
            batch.decode_tokens,
            batch.prefill_tokens,
            batch.context_len,
            prefill_mean_position=mean_position,
            queries_per_sequence=batch.queries_per_sequence,  # with drafts: verification, then drafting
        )
        return float(cost.total_s)


class FixedStepTimer:
    """Every step takes STEP_S, whatever it holds: every running stream gets its token at once (lockstep)."""

    def __init__(self, step_s: float) -> None:
        if step_s <= 0:
            raise ValueError("a fixed step time must be positive")
        self.fixed_s = step_s
        self.request_overhead_s = 0.0

    def step_s(self, batch: ScheduledBatch) -> float:
        return self.fixed_s
