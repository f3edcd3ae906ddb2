"""The finite-benchmark forecast (plan.benchmark.BenchmarkForecaster implemented by the simulator): the client as a
benchmark runs it, the stretches of pure decoding taken in one move, data-parallel ranks, SGLang's prefill-first
steps, the per-request overhead."""

from __future__ import annotations

from dataclasses import replace

import pytest

from deepserve.models import load_spec
from deepserve.plan.benchmark import BenchmarkRun, Stats
from deepserve.plan.layout import Layout
from deepserve.plan.perf import RequestLengths
from deepserve.plan.planner import build_deployment
from deepserve.simulate.forecast import (
    DataParallelScheduler,
    PrefillFirstScheduler,
    SimulatorForecaster,
    _SteppedRun,
    build_forecast_core,
)


@pytest.fixture(scope="module")
def v3():
    return load_spec("deepseek-ai/DeepSeek-V3")


def _deployment(spec, engine="vllm", layout=None, gpus=8, max_model_len=4096):
    return build_deployment(
        spec,
        "h200",
        gpus,
        engine=engine,
        layout=layout,
        max_model_len=max_model_len,
        workload=RequestLengths(1024, 256),
    )


def _both(deployment, run):
    model = deployment.performance_model()
    fast = SimulatorForecaster().forecast(deployment, model, run)
    slow = _SteppedRun(build_forecast_core(deployment, model), run, model.request_overhead_s).result()
    return fast, slow


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_stretches_of_decoding_are_taken_in_one_move_without_changing_the_result(v3, engine: str) -> None:
    """The fast run gives what the step-by-step engine gives (same steps, same statistics)."""
    run = BenchmarkRun(24, 512, 64, concurrency=6, output_spread=0.5, input_spread=0.5)
    fast, slow = _both(_deployment(v3, engine), run)
    assert fast.duration_s == pytest.approx(slow.duration_s, rel=1e-6)
    assert fast.ttft_ms.mean == pytest.approx(slow.ttft_ms.mean, rel=1e-6)
    assert fast.tpot_ms.mean == pytest.approx(slow.tpot_ms.mean, rel=1e-6)
    assert fast.itl_ms.median == pytest.approx(slow.itl_ms.median, rel=1e-3)
    assert fast.output_tokens == slow.output_tokens


def test_one_request_is_the_planners_single_user(v3) -> None:
    """At one client the forecast is the closed-loop formula's: one prefill step after the per-request overhead,
    then decode steps."""
    deployment = _deployment(v3)
    model = deployment.performance_model()
    forecast = SimulatorForecaster().forecast(deployment, model, BenchmarkRun(3, 1024, 64, concurrency=1))
    steady = model.predict(1, RequestLengths(1024, 64), deployment.running_cap)
    assert forecast.ttft_ms.mean == pytest.approx(steady.ttft_ms, rel=0.01)
    assert forecast.tpot_ms.mean == pytest.approx(steady.tpot_ms, rel=0.01)
    assert model.request_overhead_s > 0 and forecast.ttft_ms.mean > model.request_overhead_s * 1e3


def test_everything_at_once_queues_where_a_closed_loop_would_not(v3) -> None:
    """Sending all requests at once (no concurrency cap) puts them in one queue: the mean TTFT is far above the
    steady closed loop's at the same number of clients."""
    deployment = _deployment(v3)
    model = deployment.performance_model()
    burst = SimulatorForecaster().forecast(deployment, model, BenchmarkRun(64, 2048, 128))
    steady = model.predict(64, RequestLengths(2048, 128), deployment.running_cap)
    assert burst.ttft_ms.mean > 2 * steady.ttft_ms
    assert burst.ttft_ms.p99 > burst.ttft_ms.median


def test_a_request_rate_spreads_arrivals(v3) -> None:
    deployment = _deployment(v3)
    model = deployment.performance_model()
    slow_rate = SimulatorForecaster().forecast(deployment, model, BenchmarkRun(20, 512, 64, request_rate=0.5))
    assert slow_rate.duration_s > 19 / 0.5 * 0.5  # 20 Poisson arrivals at 0.5 req/s take about 40 s
    assert slow_rate.ttft_ms.mean < 2 * model.predict(1, RequestLengths(512, 64), deployment.running_cap).ttft_ms


def test_warm_up_requests_are_not_counted(v3) -> None:
    deployment = _deployment(v3)
    model = deployment.performance_model()
    counted = SimulatorForecaster().forecast(deployment, model, BenchmarkRun(16, 512, 32, concurrency=8))
    steady = SimulatorForecaster().forecast(
        deployment, model, BenchmarkRun(16, 512, 32, concurrency=8, warmup_requests=8)
    )
    assert steady.output_tokens == counted.output_tokens // 2
    assert steady.duration_s < counted.duration_s  # timed from the first counted request's send


def test_data_parallel_ranks_serve_requests_in_parallel(v3) -> None:
    """Eight long prompts on eight DP ranks run side by side: each rank prefills its own, so they do not queue
    behind each other (issue 20: TTFT grew eightfold when they did)."""
    layout = Layout(tp=1, dp=8, ep=True)
    deployment = _deployment(v3, layout=layout, max_model_len=40_000)
    model = deployment.performance_model()
    core = build_forecast_core(deployment, model)
    assert isinstance(core.scheduler, DataParallelScheduler) and len(core.scheduler.ranks) == 8
    one = SimulatorForecaster().forecast(deployment, model, BenchmarkRun(1, 30_000, 16))
    eight = SimulatorForecaster().forecast(deployment, model, BenchmarkRun(8, 30_000, 16))
    assert eight.ttft_ms.mean < 1.6 * one.ttft_ms.mean


def test_sglang_dp_attention_ranks_each_prefill_their_share_of_the_chunk(v3) -> None:
    """SGLang divides --chunked-prefill-size by the DP size (each of 8 ranks: 1,024 of 8,192 tokens a step); vLLM's
    DP ranks each schedule the whole budget; without DP SGLang's rank has it all."""
    layout = Layout(tp=1, dp=8, ep=True)
    budgets = {}
    for engine, shape in (("sglang", layout), ("vllm", layout), ("sglang", None)):
        deployment = _deployment(v3, engine=engine, layout=shape)
        core = build_forecast_core(deployment, deployment.performance_model())
        budgets[engine, shape] = core.scheduler.limits.max_num_batched_tokens
    assert budgets == {("sglang", layout): 1024, ("vllm", layout): 8192, ("sglang", None): 8192}
    old = build_deployment(v3, "h200", 8, engine="sglang", layout=layout, engine_version="0.4.3", max_model_len=4096)
    assert old.prefill_tokens_per_rank_step == 4096  # SGLang 0.4.4 and before halved the chunk, whatever the DP size


def test_sglang_never_mixes_prompts_into_decode_steps(v3) -> None:
    deployment = _deployment(v3, engine="sglang")
    core = build_forecast_core(deployment, deployment.performance_model())
    assert isinstance(core.scheduler, PrefillFirstScheduler)
    seen = []
    original = core.scheduler.schedule

    def watch(now_s: float = 0.0):
        batch = original(now_s)
        seen.append((batch.decode_tokens, batch.prefill_tokens))
        return batch

    core.scheduler.schedule = watch  # type: ignore[method-assign]
    from deepserve.simulate.forecast import _FastRun

    _FastRun(core, BenchmarkRun(12, 700, 40, concurrency=4, output_spread=0.3)).result()
    assert any(d for d, _ in seen) and any(p for _, p in seen)
    assert not [step for step in seen if step[0] and step[1]]


def test_weighted_statistics_by_hand() -> None:
    stats = Stats.weighted([(10.0, 3), (20.0, 1)])
    assert stats.mean == pytest.approx(12.5)
    assert stats.median == 10.0 and stats.p99 == 20.0
    plain = Stats.of([1.0, 2.0, 3.0, 4.0])
    assert plain.mean == 2.5 and plain.median == 2.5 and plain.p99 == 4.0


def test_pipeline_runs_take_the_step_by_step_engine(v3) -> None:
    deployment = build_deployment(v3, "h100", 16, nodes=2, weights="fp8", workload=RequestLengths(512, 32))
    deployment = replace(deployment, max_num_seqs=64)
    model = deployment.performance_model()
    forecast = SimulatorForecaster().forecast(deployment, model, BenchmarkRun(8, 512, 32, concurrency=4))
    assert forecast.output_tokens == 8 * 32 and forecast.duration_s > 0
