"""When each request is released: offsets in seconds from the start of the run, all computed before it starts
(so the hot loop only sleeps until the next offset).

- rate inf: everything at once (offset 0), the load then bounded by max concurrency alone;
- burstiness 1: a Poisson process, exponential gaps of mean 1/rate;
- other burstiness b: gamma gaps with shape b and mean 1/rate, so their coefficient of variation is 1/sqrt(b):
  b < 1 is burstier than Poisson, b > 1 more regular, b = inf a fixed gap (vLLM's --burstiness);
- ramp_up_s: the rate grows linearly from 0 to request_rate over the first ramp_up_s seconds, then stays;
- rate_ramp (vLLM's --ramp-up-strategy): request i of n arrives at the rate start + (end - start) p (linear) or
  start (end / start)^p (exponential), p = i / (n - 1): the ramp spans the requests, not a time, as in vLLM.

Both ramps scale the same unit-rate gaps (a renewal process in "operational time", so burstiness keeps its
meaning): ramp_up_s maps them through the inverse of the expected arrival count, rate_ramp divides request i's gap
by its rate.

As in vLLM, the first request waits one gap, and without a ramp the offsets are scaled so that the last one lands
exactly on n / rate: runs with different seeds then offer the same average rate (vLLM found 1-2 % drift otherwise).
The gaps keep their shape (the scale does not change the coefficient of variation).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from deepserve.errors import ConfigError, unknown_name


@dataclass(frozen=True)
class RateRamp:
    """vLLM's --ramp-up-strategy with --ramp-up-start-rps and --ramp-up-end-rps."""

    strategy: Literal["linear", "exponential"]
    start_rps: float
    end_rps: float

    def rates(self, n: int) -> np.ndarray:
        """The rate at which each of N requests arrives (vLLM's `_get_current_request_rate`)."""
        progress = np.arange(n) / max(n - 1, 1)
        if self.strategy == "linear":
            return self.start_rps + (self.end_rps - self.start_rps) * progress
        return self.start_rps * (self.end_rps / self.start_rps) ** progress

    def describe(self) -> str:
        return f"{self.strategy} ramp from {self.start_rps:g} to {self.end_rps:g} req/s over the requests"


def arrival_offsets_s(
    n: int,
    request_rate: float,
    burstiness: float,
    seed: int,
    ramp_up_s: float | None = None,
    *,
    normalize: bool = True,
    rate_ramp: RateRamp | None = None,
) -> list[float]:
    """Release times of N requests, non-decreasing, in seconds from the start. NORMALIZE=False keeps the raw
    cumulative gaps (a true renewal process) instead of vLLM's rescaling to n / rate. RATE_RAMP replaces
    REQUEST_RATE (and, as in vLLM, the offsets are not rescaled)."""
    if rate_ramp is not None:
        _check(n, math.inf, burstiness, None)
        if n == 0:
            return []
        if not rate_ramp.start_rps > 0:
            raise ConfigError(f"a ramp's start rate must be above 0, got {rate_ramp.start_rps}")
        gaps = _unit_gaps(np.random.default_rng(seed), n, burstiness) / rate_ramp.rates(n)
        return [float(x) for x in np.cumsum(gaps)]
    _check(n, request_rate, burstiness, ramp_up_s)
    if n == 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * n
    # events of a unit-rate renewal process ("operational time"); the rate profile maps them to seconds
    unit_events = np.cumsum(_unit_gaps(np.random.default_rng(seed), n, burstiness))
    if ramp_up_s:
        return [_ramped_time_s(float(s), request_rate, ramp_up_s) for s in unit_events]
    offsets = unit_events / request_rate
    if normalize:
        offsets *= (n / request_rate) / offsets[-1]
    return [float(x) for x in offsets]


def _check(n: int, request_rate: float, burstiness: float, ramp_up_s: float | None) -> None:
    if n < 0:
        raise ConfigError(f"the number of requests must be >= 0, got {n}")
    if not request_rate > 0:
        raise ConfigError(f"--request-rate must be positive (or inf), got {request_rate}")
    if not burstiness > 0:
        raise ConfigError(f"--burstiness must be positive (1 = Poisson, < 1 burstier, > 1 steadier), got {burstiness}")
    if ramp_up_s is not None and not (ramp_up_s >= 0 and math.isfinite(ramp_up_s)):
        raise ConfigError(f"the ramp-up duration must be a finite number of seconds >= 0, got {ramp_up_s}")
    if ramp_up_s and math.isinf(request_rate):
        raise ConfigError("a ramp-up needs a finite --request-rate to ramp up to")


def _unit_gaps(rng: np.random.Generator, n: int, burstiness: float) -> np.ndarray:
    """N gaps of mean 1: exponential (b = 1), gamma with shape b, or all 1 (b = inf)."""
    if math.isinf(burstiness):
        return np.ones(n)
    if burstiness == 1.0:
        return rng.exponential(1.0, size=n)
    return rng.gamma(shape=burstiness, scale=1.0 / burstiness, size=n)


def _ramped_time_s(events: float, rate: float, ramp_up_s: float) -> float:
    """Invert the expected event count Λ(t) of a rate rising linearly from 0 to RATE over RAMP_UP_S:
    Λ(t) = rate t² / (2 ramp) during the ramp, rate ramp / 2 + rate (t - ramp) after it."""
    during_ramp = rate * ramp_up_s / 2
    if events <= during_ramp:
        return math.sqrt(2 * events * ramp_up_s / rate)
    return ramp_up_s + (events - during_ramp) / rate


ArrivalProcess = Callable[[int, float, int, "float | None"], list[float]]


def _poisson(n: int, rate: float, seed: int, ramp_up_s: float | None) -> list[float]:
    return arrival_offsets_s(n, rate, 1.0, seed, ramp_up_s)


def _constant(n: int, rate: float, seed: int, ramp_up_s: float | None) -> list[float]:
    return arrival_offsets_s(n, rate, math.inf, seed, ramp_up_s)


def _all_at_once(n: int, rate: float, seed: int, ramp_up_s: float | None) -> list[float]:
    return [0.0] * n


ARRIVAL_PROCESSES: dict[str, ArrivalProcess] = {
    "poisson": _poisson,
    "constant": _constant,
    "all_at_once": _all_at_once,
}


def arrival_process(name: str) -> ArrivalProcess:
    """A named process with a fixed shape (gamma with its own burstiness goes through `arrival_offsets_s`)."""
    if name not in ARRIVAL_PROCESSES:
        raise ConfigError(unknown_name("arrival process", name, list(ARRIVAL_PROCESSES)))
    return ARRIVAL_PROCESSES[name]


def describe_arrivals(
    request_rate: float, burstiness: float, ramp_up_s: float | None = None, rate_ramp: RateRamp | None = None
) -> str:
    """One line for the console and the results, e.g. "Poisson at 4 req/s, ramped over 30 s"."""
    if rate_ramp is not None:
        return f"{rate_ramp.describe()} ({'Poisson' if burstiness == 1.0 else f'burstiness {burstiness:g}'})"
    if math.isinf(request_rate):
        return "all requests at once (rate inf)"
    if math.isinf(burstiness):
        shape = "fixed gaps"
    elif burstiness == 1.0:
        shape = "Poisson"
    else:
        shape = f"gamma (burstiness {burstiness:g}, CV {1 / math.sqrt(burstiness):.2f})"
    ramp = f", ramped from 0 over {ramp_up_s:g} s" if ramp_up_s else ""
    return f"{shape} at {request_rate:g} req/s{ramp}"


async def sleep_until(perf_s: float) -> None:
    """Sleep until time.perf_counter() reaches PERF_S, never less: the event loop's timers may fire up to a
    millisecond early (uvloop's are in whole milliseconds), which would release a request before its time."""
    while (delay_s := perf_s - time.perf_counter()) > 0:
        await asyncio.sleep(delay_s)
