"""Arrival processes, checked statistically with fixed seeds: mean rate, and burstiness through the coefficient of
variation (CV) of the gaps, which is 1/sqrt(burstiness) for gamma gaps (1 for Poisson)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from deepserve.bench.arrivals import ARRIVAL_PROCESSES, arrival_offsets_s, arrival_process, describe_arrivals
from deepserve.errors import ConfigError

N = 40_000


def _gaps(offsets: list[float]) -> np.ndarray:
    return np.diff(np.concatenate([[0.0], np.asarray(offsets)]))


def _cv(gaps: np.ndarray) -> float:
    return float(np.std(gaps) / np.mean(gaps))


def test_infinite_rate_releases_everything_at_once() -> None:
    assert arrival_offsets_s(5, math.inf, 1.0, seed=0) == [0.0] * 5
    assert arrival_offsets_s(0, 3.0, 1.0, seed=0) == []


@pytest.mark.parametrize("rate", [0.5, 8.0, 200.0])
def test_poisson_has_the_asked_mean_rate_and_cv_one(rate: float) -> None:
    gaps = _gaps(arrival_offsets_s(N, rate, 1.0, seed=1, normalize=False))
    assert np.mean(gaps) == pytest.approx(1 / rate, rel=0.02)  # 1/sqrt(N) = 0.5 % standard error
    assert _cv(gaps) == pytest.approx(1.0, rel=0.03)


@pytest.mark.parametrize("burstiness", [0.25, 0.5, 2.0, 4.0, 16.0])
def test_gamma_burstiness_sets_the_cv(burstiness: float) -> None:
    gaps = _gaps(arrival_offsets_s(N, 10.0, burstiness, seed=2, normalize=False))
    assert np.mean(gaps) == pytest.approx(0.1, rel=0.03)
    assert _cv(gaps) == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_burstier_is_burstier_in_counts_per_window() -> None:
    """Index of dispersion of arrivals per 1 s window: ~1 for Poisson, > 1 bursty, < 1 regular."""

    def dispersion(burstiness: float) -> float:
        offsets = np.asarray(arrival_offsets_s(N, 20.0, burstiness, seed=3))
        counts = np.bincount(offsets.astype(int))
        return float(np.var(counts) / np.mean(counts))

    assert dispersion(0.25) > 2.5
    assert 0.85 < dispersion(1.0) < 1.15
    assert dispersion(4.0) < 0.5


def test_normalized_offsets_end_exactly_on_n_over_rate_and_keep_the_cv() -> None:
    offsets = arrival_offsets_s(1000, 4.0, 0.5, seed=4)
    raw = arrival_offsets_s(1000, 4.0, 0.5, seed=4, normalize=False)
    assert offsets[-1] == pytest.approx(1000 / 4.0)
    assert _cv(_gaps(offsets)) == pytest.approx(_cv(_gaps(raw)), rel=1e-9)


def test_infinite_burstiness_gives_fixed_gaps() -> None:
    gaps = _gaps(arrival_offsets_s(10, 5.0, math.inf, seed=0))
    assert gaps == pytest.approx([0.2] * 10)


def test_offsets_are_sorted_and_seeded() -> None:
    a = arrival_offsets_s(500, 3.0, 0.7, seed=11)
    assert a == sorted(a) and a[0] > 0  # the first request waits one gap, as in vLLM
    assert a == arrival_offsets_s(500, 3.0, 0.7, seed=11)
    assert a != arrival_offsets_s(500, 3.0, 0.7, seed=12)


def test_linear_ramp_rises_from_zero_to_the_rate() -> None:
    rate, ramp_s = 50.0, 100.0
    offsets = np.asarray(arrival_offsets_s(N, rate, 1.0, seed=5, ramp_up_s=ramp_s))
    # the expected count by time t is rate t^2 / (2 ramp) during the ramp: 1/4 of the way, 1/16 of the ramp's total
    in_ramp = rate * ramp_s / 2
    assert np.sum(offsets < ramp_s) == pytest.approx(in_ramp, rel=0.03)
    assert np.sum(offsets < ramp_s / 4) == pytest.approx(in_ramp / 16, rel=0.08)
    # the rate in the ramp's 10 s windows grows linearly: rate * midpoint / ramp
    counts = np.histogram(offsets, bins=10, range=(0, ramp_s))[0]
    expected = [rate * (k + 0.5) / 10 * 10 for k in range(10)]
    assert counts == pytest.approx(expected, rel=0.15, abs=10)
    after = offsets[offsets >= ramp_s]
    assert len(after) / (after[-1] - ramp_s) == pytest.approx(rate, rel=0.03)


def test_bad_parameters_fail_fast() -> None:
    with pytest.raises(ConfigError, match="request-rate"):
        arrival_offsets_s(3, 0.0, 1.0, seed=0)
    with pytest.raises(ConfigError, match="burstiness"):
        arrival_offsets_s(3, 1.0, 0.0, seed=0)
    with pytest.raises(ConfigError, match="ramp"):
        arrival_offsets_s(3, math.inf, 1.0, seed=0, ramp_up_s=10)
    with pytest.raises(ConfigError, match="ramp"):
        arrival_offsets_s(3, 1.0, 1.0, seed=0, ramp_up_s=-1)


def test_registry_names_and_unknown_name() -> None:
    assert set(ARRIVAL_PROCESSES) == {"poisson", "constant", "all_at_once"}
    assert arrival_process("poisson")(4, 2.0, 0, None) == arrival_offsets_s(4, 2.0, 1.0, 0)
    assert arrival_process("constant")(4, 2.0, 0, None) == pytest.approx([0.5, 1.0, 1.5, 2.0])
    with pytest.raises(ConfigError, match="valid: all_at_once, constant, poisson"):
        arrival_process("uniform")


def test_description_names_the_process() -> None:
    assert describe_arrivals(math.inf, 1.0) == "all requests at once (rate inf)"
    assert describe_arrivals(4.0, 1.0, 30.0) == "Poisson at 4 req/s, ramped from 0 over 30 s"
    assert describe_arrivals(2.0, 0.25) == "gamma (burstiness 0.25, CV 2.00) at 2 req/s"
