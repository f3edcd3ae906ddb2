"""Speculative decoding in the simulated scheduler: drafts scheduled with the newest token, rejected drafts taken
back, outputs of several tokens, vLLM's counters; the acceptance sampler; agreement with the plan in virtual time."""

from __future__ import annotations

import random

import pytest

from deepserve.engines.config import EngineConfig
from deepserve.errors import ConfigError
from deepserve.plan.perf import RequestLengths
from deepserve.simulate.closed_loop import simulate_closed_loop
from deepserve.simulate.config import SimulateConfig
from deepserve.simulate.kv_cache import KVCacheManager
from deepserve.simulate.scheduler import Scheduler, SchedulerLimits, SimRequest
from deepserve.simulate.setup import resolve
from deepserve.simulate.speculation import AcceptanceSampler, Drafting
from deepserve.simulate.tokenizer import generated_token


class Scripted(AcceptanceSampler):
    """Accepts the given counts in turn (capped by the drafts offered): outcomes pinned by hand."""

    def __init__(self, counts: list[int]) -> None:
        super().__init__((1.0,))
        self.counts = counts

    def accepted(self, drafts: int) -> int:
        return min(self.counts.pop(0), drafts)


def scheduler(counts: list[int], k: int = 3, budget: int = 64, max_model_len: int = 4096) -> Scheduler:
    kv = KVCacheManager(1000, 16, max_model_len, False)
    return Scheduler(SchedulerLimits(8, budget, max_model_len), kv, Drafting(k, Scripted(counts)))


def test_a_step_verifies_the_drafts_and_yields_the_accepted_ones_plus_one() -> None:
    s = scheduler([2, 0, 3])
    request = SimRequest("a", list(range(10)), max_tokens=20)
    s.add(request)
    batch = s.schedule()
    assert batch.prefill_tokens == 10 and batch.draft_tokens == 0
    (output,) = s.update(batch)
    assert output.token_ids == [generated_token(0)] and request.draft_tokens == 3  # the drafter ran for it

    batch = s.schedule()
    assert (batch.decode_tokens, batch.draft_tokens, batch.num_tokens) == (1, 3, 4)
    assert batch.queries_per_sequence == 4
    (output,) = s.update(batch)
    assert output.token_ids == [generated_token(i) for i in (1, 2, 3)]  # 2 accepted + 1
    assert request.num_computed_tokens == request.num_tokens - 1  # the rejected draft was taken back

    (output,) = s.update(s.schedule())
    assert len(output.token_ids) == 1  # none accepted: the target's own token
    (output,) = s.update(s.schedule())
    assert len(output.token_ids) == 4
    counters = s.spec_counters
    assert counters is not None
    assert (counters.drafts, counters.draft_tokens, counters.accepted_tokens) == (3, 9, 5)
    assert counters.accepted_per_position == [2, 2, 1]
    assert s.counters.generation_tokens == 1 + 3 + 1 + 4


def test_the_token_budget_cuts_the_drafts_and_a_stop_cuts_the_output() -> None:
    s = scheduler([3], k=3, budget=2)
    request = SimRequest("a", [5], max_tokens=2)
    s.add(request)
    s.update(s.schedule())
    batch = s.schedule()
    assert batch.draft_tokens == 1  # 1 + 3 wanted, 2 fit the budget
    (output,) = s.update(batch)
    assert len(output.token_ids) == 1 and output.finish_reason == "length"  # 2 would come, max_tokens stops at 1
    assert s.spec_counters is not None and s.spec_counters.accepted_tokens == 1  # counted as the sampler accepted


def test_a_preempted_request_starts_again_without_drafts() -> None:
    s = scheduler([0] * 10, k=2)
    request = SimRequest("a", list(range(4)), max_tokens=10)
    s.add(request)
    s.update(s.schedule())
    s._preempt(s.running.pop())
    assert request.draft_tokens == 0
    batch = s.schedule()
    assert batch.draft_tokens == 0 and batch.prefill_tokens == 5  # recomputed as a prompt


def test_the_sampler_draws_vllms_per_position_rates() -> None:
    sampler = AcceptanceSampler((0.8, 0.6, 0.4), rng=random.Random(1))
    assert sampler.conditional == pytest.approx([0.8, 0.75, 2 / 3])
    draws = [sampler.accepted(3) for _ in range(20_000)]
    for position, rate in enumerate((0.8, 0.6, 0.4)):
        assert sum(count > position for count in draws) / len(draws) == pytest.approx(rate, abs=0.015)
    assert AcceptanceSampler((1.0, 1.0)).accepted(2) == 2
    assert AcceptanceSampler((0.0, 0.0)).accepted(2) == 0
    assert AcceptanceSampler((0.9,)).accepted(0) == 0
    with pytest.raises(ValueError, match="must not increase"):
        AcceptanceSampler((0.5, 0.7))


def test_the_simulation_agrees_with_the_plan_in_virtual_time() -> None:
    """One client: each step is the plan's speculative step, and on average 1 + 0.8 + 0.5 tokens a step."""
    engine = EngineConfig(model="deepseek-ai/DeepSeek-V3", num_speculative_tokens=2)
    sim = SimulateConfig(gpu="h200", spec_acceptance="0.8,0.5")
    deployment = resolve(engine, sim)
    assert deployment.speculation is not None and deployment.speculation.tokens_per_step == pytest.approx(2.3)
    assert "speculative decoding: mtp, 2 draft token(s)" in deployment.describe()
    measured = simulate_closed_loop(engine, sim, 1, 1024, 256, num_requests=8, output_spread=0.5)
    predicted = deployment.predict(1, RequestLengths(1024, 256))
    assert measured.mean_tpot_ms == pytest.approx(predicted.tpot_ms, rel=0.05)
    plain = simulate_closed_loop(
        engine.model_copy(update={"num_speculative_tokens": None}),
        SimulateConfig(gpu="h200"),
        1,
        1024,
        256,
        num_requests=8,
    )
    assert measured.mean_tpot_ms < 0.7 * plain.mean_tpot_ms


def test_what_the_simulator_cannot_do_is_refused() -> None:
    with pytest.raises(ConfigError, match="--fixed-step-ms"):
        resolve(EngineConfig(num_speculative_tokens=2), SimulateConfig(fixed_itl_ms=5, spec_acceptance="0.5"))
    with pytest.raises(ConfigError, match="turn speculative decoding on"):
        resolve(EngineConfig(model="deepseek-ai/DeepSeek-V3"), SimulateConfig(spec_acceptance="0.5"))
    with pytest.raises(ConfigError, match="--spec-acceptance"):
        resolve(EngineConfig(speculative_method="ngram", num_speculative_tokens=2), SimulateConfig(fixed_step_ms=5))
