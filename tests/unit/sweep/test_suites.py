"""Suites as data, and their scaling to a model's context and a time budget."""

from __future__ import annotations

import math

import pytest

from deepserve.bench.config import BenchConfig
from deepserve.errors import ConfigError
from deepserve.sweep.grid import apply_overrides
from deepserve.sweep.suites import SUITES, SpeedProbe, fit_prefill, get_suite, plan_suite
from tests.helpers import present

# Roughly the tiny model on 2 CPU cores: 116 output tok/s alone, about 870 at concurrency 64 (docs/DESIGN.md);
# prefill 0.3 s at 1K tokens, 27 s at 10K, 68 s at 16K (measured: attention dominates).
TINY_CPU = SpeedProbe(
    prefill_tok_s=20000.0,
    tpot_s=1 / 116,
    peak_output_tok_s=900.0,
    prefill_s_per_tok2=2.5e-7,
    batched_prefill_tok_s=30000.0,
)
# Roughly 8xH100 serving V3 (seed 001): 33 output tok/s alone, a plateau near 620.
H100 = SpeedProbe(prefill_tok_s=20000.0, tpot_s=1 / 33, peak_output_tok_s=620.0)


def estimated_s(plan) -> float:
    """What the plan will take: timed points their duration plus one request's drain; counted points their work."""
    total = 0.0
    for point in plan.points:
        if "duration_s" in point.params:
            load = point.concurrency or 1
            total += point.params["duration_s"] + TINY_CPU.request_s(point.input_len or 0, point.output_len or 0, load)
        else:
            total += TINY_CPU.count_bounded_s(point)
    return total


def test_the_issue_s_suites_exist_at_the_seeds_sizes():
    concurrency = get_suite("concurrency").points()
    assert [p.concurrency for p in concurrency][:1] == [1] and concurrency[-1].concurrency == 200
    assert {(p.input_len, p.output_len) for p in concurrency} == {(1024, 256)}
    rates = [p.request_rate for p in get_suite("request-rate").points()]
    assert rates[0] == 1 and rates[-1] == 20
    assert {p.input_len for p in get_suite("input-length").points()} == {1024, 4096}
    assert [p.output_len for p in get_suite("output-length").points()] == [256, 1024, 4096]
    assert [p.input_len for p in get_suite("long-prompt").points()] == [10240, 16384]
    [mixed] = get_suite("mixed-inputs").points()
    assert (mixed.num_prompts, mixed.concurrency, mixed.request_rate) == (200, 100, 100)
    assert mixed.params["sampled_min_input_len"] == 100 and mixed.params["sampled_max_input_len"] == 32768
    two_k = get_suite("concurrency-2k").points()
    assert (two_k[0].concurrency, two_k[-1].concurrency, two_k[0].input_len, two_k[0].output_len) == (
        1,
        1024,
        2048,
        512,
    )
    prefix = {p.variant: p for p in get_suite("prefix-cache").points()}
    assert prefix["shared prefix"].params["shared_prefix_len"] == 2000 and prefix["no sharing"].input_len == 3200
    assert {p.concurrency for p in prefix.values()} == {128}
    reasoning = get_suite("reasoning").points()
    assert {p.variant for p in reasoning} == {"thinking on", "thinking off"}
    assert {p.params["chat_template_kwargs"] for p in reasoning} == {'{"thinking": true}', '{"thinking": false}'}
    assert {p.params["endpoint"] for p in reasoning} == {"/v1/chat/completions"}
    offline = get_suite("offline").points()
    assert [p.num_prompts for p in offline] == [32, 64, 128, 256, 512, 1024]
    assert all(p.concurrency is None and math.isinf(p.request_rate) for p in offline)


def test_unknown_suite_lists_the_valid_ones():
    with pytest.raises(ConfigError, match="valid: concurrency"):
        get_suite("nope")


@pytest.mark.parametrize("name", list(SUITES))
def test_every_suite_point_is_a_valid_bench_config(name: str):
    base = BenchConfig.model_validate({})
    plan = plan_suite(SUITES[name], 32768, 900, TINY_CPU)
    for point in plan.points:
        apply_overrides(base, point.params)  # raises on a field the bench does not know


@pytest.mark.parametrize("name", list(SUITES))
def test_every_suite_fits_15_minutes_on_the_tiny_cpu_model(name: str):
    plan = plan_suite(SUITES[name], 32768, 900, TINY_CPU)
    assert estimated_s(plan) <= 900, plan.notes


def test_context_scaling_keeps_the_ratios():
    plan = plan_suite(get_suite("input-length"), 2048, None, None)
    lengths = sorted({present(p.input_len) for p in plan.points})
    assert lengths[1] / lengths[0] == pytest.approx(4, rel=0.01)
    assert max(p.max_request_tokens() for p in plan.points) <= 0.9 * 2048
    assert "2048-token context" in plan.notes[0]


def test_without_a_budget_the_seeds_sizes_stand():
    plan = plan_suite(get_suite("concurrency"), 32768, None, None)
    assert plan.length_factor == 1.0 and plan.point_duration_s is None
    assert {(p.input_len, p.output_len) for p in plan.points} == {(1024, 256)}
    assert plan.points[-1].num_prompts == 1000  # five waves at concurrency 200
    assert all("duration_s" not in p.params for p in plan.points)


def test_a_fast_server_keeps_the_seed_lengths_and_runs_each_point_for_a_time():
    plan = plan_suite(get_suite("request-rate"), 32768, 3600, H100)
    assert plan.length_factor == 1.0
    assert {p.input_len for p in plan.points} == {1024}
    assert all(p.params["duration_s"] == pytest.approx(plan.point_duration_s, abs=0.1) for p in plan.points)


def test_a_slow_server_gets_shorter_requests():
    plan = plan_suite(get_suite("output-length"), 32768, 900, TINY_CPU)
    assert plan.length_factor < 0.5
    outputs = [present(p.output_len) for p in plan.points]
    assert outputs == sorted(outputs) and outputs[-1] / outputs[0] == pytest.approx(16, rel=0.1)


def test_flags_the_user_gave_are_not_scaled():
    plan = plan_suite(get_suite("output-length"), 32768, 900, TINY_CPU, {"random_input_len": 1000})
    assert {p.input_len for p in plan.points} == {1000}


def test_prefill_fit_recovers_linear_and_quadratic_parts():
    truth = SpeedProbe(prefill_tok_s=20000.0, tpot_s=0.01, peak_output_tok_s=1.0, prefill_s_per_tok2=2.5e-7)
    rate, quadratic = fit_prefill(512, truth.prefill_s(512), 2048, truth.prefill_s(2048))
    assert rate == pytest.approx(20000.0, rel=1e-6) and quadratic == pytest.approx(2.5e-7, rel=1e-6)
    # Noise that would make the quadratic part negative falls back to a plain rate.
    rate, quadratic = fit_prefill(512, 0.2, 2048, 0.5)
    assert quadratic == 0.0 and rate == pytest.approx(2048 / 0.5)


def test_long_prompts_shrink_when_prefill_is_quadratic():
    linear = SpeedProbe(prefill_tok_s=20000.0, tpot_s=1 / 116, peak_output_tok_s=900.0)
    assert plan_suite(get_suite("long-prompt"), 32768, 120, linear).length_factor == 1.0
    plan = plan_suite(get_suite("long-prompt"), 32768, 120, TINY_CPU)
    assert plan.length_factor < 1.0
    assert sum(TINY_CPU.count_bounded_s(point) for point in plan.points) <= 0.5 * 120
