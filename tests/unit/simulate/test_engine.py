"""The engine on a virtual clock: when tokens appear, pipeline stages, fixed latencies, and the closed loop against
the planner's analytic prediction."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from deepserve.engines.config import EngineConfig
from deepserve.plan.perf import RequestLengths
from deepserve.simulate.clock import ManualClock, Timer
from deepserve.simulate.closed_loop import run_closed_loop, simulate_closed_loop
from deepserve.simulate.config import SimulateConfig
from deepserve.simulate.core import EngineCore
from deepserve.simulate.engine import FixedLatencyEngine, SteppedEngine
from deepserve.simulate.kv_cache import KVCacheManager
from deepserve.simulate.scheduler import Scheduler, SchedulerLimits, SimRequest
from deepserve.simulate.setup import build_core, resolve
from deepserve.simulate.timing import FixedStepTimer, PlannerStepTimer
from deepserve.simulate.tokenizer import generated_token

STEP_S = 0.01


class Recorder:
    def __init__(self) -> None:
        self.times: list[float] = []
        self.tokens: list[int] = []
        self.finish: str | None = None

    def on_tokens(self, request: SimRequest, token_ids: list[int], finish_reason: str | None, now_s: float) -> None:
        self.times.append(round(now_s, 9))
        self.tokens += token_ids
        self.finish = finish_reason


def stepped(clock: ManualClock, stages: int = 1, num_blocks: int = 1000) -> SteppedEngine:
    kv = KVCacheManager(num_blocks, 16, 4096, enable_caching=True)
    core = EngineCore(Scheduler(SchedulerLimits(64, 8192, 4096), kv), FixedStepTimer(STEP_S), stages)
    return SteppedEngine(core, clock)


def submit_at(clock: ManualClock, engine: SteppedEngine | FixedLatencyEngine, when_s: float, request: SimRequest):
    clock.call_at(when_s, lambda: engine.submit(request))


def test_tokens_appear_at_step_ends_and_a_late_arrival_waits_for_the_next_step() -> None:
    clock = ManualClock()
    engine = stepped(clock)
    first, second = Recorder(), Recorder()
    submit_at(clock, engine, 0.0, SimRequest("a", [1] * 20, 4, sink=first))
    submit_at(clock, engine, 0.015, SimRequest("b", [2] * 20, 2, sink=second))  # in the middle of the 2nd step
    clock.run_until_idle()
    assert first.times == [0.01, 0.02, 0.03, 0.04] and first.finish == "length"
    assert second.times == [0.03, 0.04]  # prefilled in the step that started at 0.02, beside a's decode
    assert engine.metrics.ttft.observations == 2 and engine.metrics.itl.observations == 4
    assert engine.metrics.finished["length"] == 2


def test_pipeline_stages_keep_several_steps_in_flight() -> None:
    clock = ManualClock()
    engine = stepped(clock, stages=2)
    first, second = Recorder(), Recorder()
    submit_at(clock, engine, 0.0, SimRequest("a", [1] * 8, 3, sink=first))
    submit_at(clock, engine, 0.005, SimRequest("b", [2] * 8, 3, sink=second))
    clock.run_until_idle()
    # each step crosses both stages (2 x 10 ms); b's first step enters stage 0 as soon as a's leaves it
    assert first.times == [0.02, 0.04, 0.06]
    assert second.times == [0.03, 0.05, 0.07]


def test_an_abort_frees_the_cache_and_lets_a_waiting_request_in() -> None:
    clock = ManualClock()
    engine = stepped(clock, num_blocks=2)  # 32 tokens: one request at a time
    hog, patient = Recorder(), Recorder()
    hog_request = SimRequest("hog", [1] * 20, 100, sink=hog)
    submit_at(clock, engine, 0.0, hog_request)
    submit_at(clock, engine, 0.001, SimRequest("patient", [2] * 20, 1, sink=patient))
    clock.advance_to(0.05)
    assert patient.times == [] and engine.gauges().waiting == 1
    engine.abort(hog_request)
    clock.run_until_idle()
    assert hog_request.finish_reason == "abort" and engine.metrics.finished["abort"] == 1
    assert patient.finish == "length" and patient.times == [0.07]  # the step in flight at 0.05 runs to its end


class LateClock(ManualClock):
    """Runs every timer LATE_S late, as an overloaded event loop would."""

    def __init__(self, late_s: float) -> None:
        super().__init__()
        self.late_s = late_s

    def call_at(self, when_s: float, callback: Callable[[], None]) -> Timer:
        return super().call_at(when_s + self.late_s, callback)


def test_a_loop_a_little_late_catches_up_on_the_ideal_timeline() -> None:
    clock = LateClock(late_s=0.1)
    engine = stepped(clock)
    recorder = Recorder()
    submit_at(clock, engine, 0.0, SimRequest("a", [1] * 8, 30, sink=recorder))
    clock.run_until_idle()
    assert recorder.times == [round(0.1 + 0.01 * (i + 1), 9) for i in range(30)]  # it arrived late too
    assert engine.lag_events == 0


def test_a_loop_that_falls_behind_restarts_the_timeline_and_says_so() -> None:
    clock = LateClock(late_s=1.0)
    engine = stepped(clock)
    recorder = Recorder()
    submit_at(clock, engine, 0.0, SimRequest("a", [1] * 8, 3, sink=recorder))
    clock.run_until_idle()
    assert recorder.finish == "length"
    assert engine.lag_events >= 2 and engine.lag_s > 1.5


def test_fixed_latency_streams_ignore_each_other() -> None:
    clock = ManualClock()
    engine = FixedLatencyEngine(clock, ttft_s=0.1, itl_s=0.02, max_model_len=4096)
    first, second = Recorder(), Recorder()
    submit_at(clock, engine, 0.0, SimRequest("a", [1] * 5, 3, sink=first))
    submit_at(clock, engine, 0.005, SimRequest("b", [1] * 5, 2, sink=second))
    clock.run_until_idle()
    assert first.times == [0.1, 0.12, 0.14] and second.times == [0.105, 0.125]
    burst = FixedLatencyEngine(clock, ttft_s=0.0, itl_s=0.0, max_model_len=4096)
    fast = Recorder()
    burst.submit(SimRequest("c", [1], 100, sink=fast))
    clock.run_until_idle()
    assert len(fast.tokens) == 100 and len(fast.times) == 2  # 64 per turn, then the rest
    assert burst.counters().generation_tokens == 100


def test_fixed_bursts_take_their_size_and_stop_at_the_limit_or_the_natural_end() -> None:
    clock = ManualClock()
    engine = FixedLatencyEngine(clock, ttft_s=0.0, itl_s=0.0, max_model_len=4096, burst_tokens=16)
    capped, natural, context = Recorder(), Recorder(), Recorder()
    engine.submit(SimRequest("a", [1], 40, sink=capped))
    engine.submit(SimRequest("b", [1], 40, eos_after=20, sink=natural))  # token by token: the EOS may end it
    small = FixedLatencyEngine(clock, ttft_s=0.0, itl_s=0.0, max_model_len=30, burst_tokens=16)
    small.submit(SimRequest("c", [1] * 10, 100, sink=context))
    clock.run_until_idle()
    assert len(capped.tokens) == 40 and len(capped.times) == 3 and capped.finish == "length"  # 16 + 16 + 8
    assert capped.tokens == [generated_token(i) for i in range(40)]  # what the token-by-token path gives
    assert len(natural.tokens) == 20 and natural.finish == "stop"
    assert len(context.tokens) == 20 and context.finish == "length"  # the context (30) is full
    with pytest.raises(ValueError, match="burst_tokens"):
        FixedLatencyEngine(clock, ttft_s=0.0, itl_s=0.0, max_model_len=30, burst_tokens=0)


@pytest.fixture(scope="module")
def awq_h100() -> tuple[object, SimulateConfig]:
    sim = SimulateConfig(gpu="h100")
    return resolve(EngineConfig(model="cognitivecomputations/DeepSeek-V3-0324-AWQ"), sim), sim


def test_one_client_reproduces_the_planner_exactly(awq_h100) -> None:
    deployment, sim = awq_h100
    result = run_closed_loop(build_core(deployment, sim), 1, 1024, 64, num_requests=3)
    predicted = deployment.predict(1, RequestLengths(1024, 64))
    assert result.mean_tpot_ms == pytest.approx(predicted.tpot_ms, rel=0.005)
    assert result.mean_ttft_ms == pytest.approx(predicted.ttft_ms, rel=0.005)
    assert result.output_throughput_tok_s == pytest.approx(predicted.output_throughput_tok_s, rel=0.01)


def test_32_clients_agree_with_the_planner(awq_h100) -> None:
    """Staggered lengths (vLLM's --random-range-ratio 0.5): the steady state the analytic model assumes, within 5%.
    Fixed lengths: clients move in waves, all prompts of a wave prefilled together in steps of their own, which the
    analytic model spreads over the decode steps: TPOT falls below the plan (the prompts' cost moves into TTFT; with
    the kernel-table model, where a 1K prompt costs several decode steps, by about a sixth), throughput within 15%."""
    deployment, sim = awq_h100
    workload = RequestLengths(1024, 256)
    predicted = deployment.predict(32, workload)
    waves = run_closed_loop(build_core(deployment, sim), 32, 1024, 256, num_requests=96)
    staggered = run_closed_loop(build_core(deployment, sim), 32, 1024, 256, num_requests=640, output_spread=0.5)
    assert staggered.mean_tpot_ms == pytest.approx(predicted.tpot_ms, rel=0.05)
    assert staggered.output_throughput_tok_s == pytest.approx(predicted.output_throughput_tok_s, rel=0.05)
    assert 0.7 * predicted.tpot_ms < waves.mean_tpot_ms < predicted.tpot_ms
    assert waves.output_throughput_tok_s == pytest.approx(predicted.output_throughput_tok_s, rel=0.15)
    assert waves.mean_ttft_ms > 3 * predicted.ttft_ms  # a wave's prompts queue behind each other


def test_a_small_cache_preempts_and_every_request_still_completes() -> None:
    engine = EngineConfig(
        model="cognitivecomputations/DeepSeek-V3-0324-AWQ", kv_cache_memory_gib=1.0, max_model_len=4096
    )
    roomy = simulate_closed_loop(
        engine.model_copy(update={"kv_cache_memory_gib": None}), SimulateConfig(gpu="h100"), 32, 1024, 256, 64
    )
    tight = simulate_closed_loop(engine, SimulateConfig(gpu="h100"), 32, 1024, 256, 64)  # 15,279 tokens: ~11 fit
    assert roomy.preemptions == 0 and tight.preemptions > 0
    assert tight.requests == 64 and tight.mean_running < 16
    assert tight.output_throughput_tok_s < roomy.output_throughput_tok_s


def test_prompts_in_one_step_attend_each_to_their_own_positions(awq_h100) -> None:
    """Eight 1,024-token prompts in one step cost the attention of eight prompts, not of one 8,192-token prompt:
    the timer gives the step model the mean position over the step's prompt tokens (512 here, not 4,096)."""
    deployment, _sim = awq_h100
    model = deployment.model_of_steps
    scheduler = Scheduler(
        SchedulerLimits(max_num_seqs=16, max_num_batched_tokens=8192, max_model_len=4096),
        KVCacheManager(num_blocks=1000, block_size=64, max_model_len=4096, enable_caching=False),
    )
    for index in range(8):
        scheduler.add(SimRequest(f"r{index}", [7] * 1024, 4, ignore_eos=True))
    batch = scheduler.schedule()
    assert batch.prefill_tokens == 8192 and batch.prefill_positions / batch.prefill_tokens == pytest.approx(512)
    eight = model.step(0, 8192, 0, prefill_mean_position=512).kind("mla_prefill")
    one = model.step(0, 1024, 0).kind("mla_prefill")
    assert eight.compute_s == pytest.approx(8 * one.compute_s)
    assert model.step(0, 8192, 0).kind("mla_prefill").compute_s == pytest.approx(64 * one.compute_s)
    assert PlannerStepTimer(model).step_s(batch) == pytest.approx(model.step(0, 8192, 512, 0, 512).total_s)


def test_closed_loop_prompt_lengths_spread_like_vllms_range_ratio(awq_h100, monkeypatch) -> None:
    deployment, sim = awq_h100
    lengths: list[int] = []
    submit = SteppedEngine.submit

    def recording(engine: SteppedEngine, request: SimRequest) -> None:
        lengths.append(request.num_prompt_tokens)
        submit(engine, request)

    monkeypatch.setattr(SteppedEngine, "submit", recording)
    run_closed_loop(build_core(deployment, sim), 4, 512, 8, num_requests=40, input_spread=0.5)
    assert len(lengths) == 40 and min(lengths) >= 256 and max(lengths) <= 768 and len(set(lengths)) > 10
