"""The seeds' experiments as named recipes, and how they shrink to fit a small model and a time budget.

A suite is data: a base workload, a grid of parameter values, and the charts to read. Its points are written at the
seeds' sizes (input 1,024 / output 256, concurrency 1 to 200, ...). `plan_suite` then scales them:

1. to the served model's context: every length in the suite shrinks by one factor (so 1K against 4K stays 1:4) until
   the longest request fits in 90% of the context;
2. to a time budget (default 15 minutes), using a short speed probe of the server (prefill tokens/s, decode time per
   token, peak output tokens/s): sweeps along concurrency or request rate run each point for an equal share of the
   budget (bench's --duration-s), and lengths shrink (by one factor per suite) until one request at the suite's
   heaviest point fits well inside its share; fixed-count points (offline batches, long prompts, the sampled set)
   keep their counts and shrink their lengths until their estimated time fits.
Without a budget (--time-budget-s 0) the suite runs at the seeds' sizes, scaled only to the context.

Point parameters use `deepserve bench`'s config field names (vLLM's flag names with underscores).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from itertools import product
from typing import Any

from deepserve.errors import ConfigError, unknown_name
from deepserve.results.series import OFFLINE, PREFIX_NONE, PREFIX_SHARED

DEFAULT_TIME_BUDGET_S = 900.0  # every suite finishes on the tiny CPU model within 15 minutes
MIN_POINT_DURATION_S = 3.0  # a time-bounded point issues requests for at least this long
CONTEXT_FILL = 0.9  # the longest request may use this much of the context
MIN_INPUT_LEN = 16
MIN_OUTPUT_LEN = 4
# Token-length fields of the workload config, scaled together.
LENGTH_FIELDS = (
    "random_input_len",
    "random_output_len",
    "long_prompt_len",
    "sampled_min_input_len",
    "sampled_max_input_len",
    "shared_prefix_len",
)


@dataclass(frozen=True)
class SuitePoint:
    """One benchmark of a suite: overrides of `deepserve bench`'s config fields, plus a variant name for charts."""

    params: dict[str, Any]
    variant: str | None = None

    @property
    def concurrency(self) -> int | None:
        value = self.params.get("max_concurrency")
        return int(value) if value is not None else None

    @property
    def request_rate(self) -> float:
        value = self.params.get("request_rate")
        return math.inf if value is None else float(value)

    @property
    def time_bounded(self) -> bool:
        """Sweeps along concurrency or rate measure a steady state: they can run for a set time instead of a count.
        Offline batches, long prompts and sampled sets are defined by their count."""
        return self.variant not in (OFFLINE,) and self.params.get("dataset_name") in (None, "random", "shared_prefix")

    @property
    def input_len(self) -> int | None:
        if self.params.get("dataset_name") == "long":
            return int(self.params["long_prompt_len"])
        if self.params.get("dataset_name") == "sampled":
            return None  # varies per request; the result's mean says how long they were
        value = self.params.get("random_input_len")
        return int(value) if value is not None else None

    @property
    def output_len(self) -> int | None:
        value = self.params.get("random_output_len")
        return int(value) if value is not None else None

    @property
    def num_prompts(self) -> int:
        return int(self.params.get("num_prompts") or 1)

    def max_request_tokens(self) -> int:
        """The longest request this point sends (input + output)."""
        longest_input = max(
            int(self.params.get(name) or 0) for name in ("random_input_len", "long_prompt_len", "sampled_max_input_len")
        )
        return longest_input + int(self.params.get("random_output_len") or 0)


@dataclass(frozen=True)
class Suite:
    name: str
    title: str
    seed: str  # which seed ran this experiment, and how
    description: str  # what it measures and which chart to read
    base: dict[str, Any]
    grid: dict[str, list[Any]]  # parameter → values; the points are the product
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)  # name → overrides, crossed with the grid
    sweep_axis: str | None = None  # saturation is tracked along this parameter
    charts: tuple[str, ...] = ()
    parts: tuple[Suite, ...] = ()  # a suite made of several experiments: their points, one after the other

    def points(self) -> list[SuitePoint]:
        if self.parts:
            return [point for part in self.parts for point in part.points()]
        variants: Iterable[tuple[str | None, dict[str, Any]]] = self.variants.items() or [(None, {})]
        names = list(self.grid)
        points = []
        for variant, overrides in variants:
            for values in product(*(self.grid[name] for name in names)):
                params = {**self.base, **overrides, **dict(zip(names, values, strict=True))}
                params.setdefault("num_prompts", _seed_count(params))
                points.append(SuitePoint(params, variant))
        return points


def _seed_count(params: dict[str, Any]) -> int:
    """How many requests a point sends at the seeds' size: five waves at a concurrency limit, a minute of arrivals
    at a request rate, the batch itself offline."""
    rate = params.get("request_rate")
    if rate is not None and math.isfinite(rate):
        return max(math.ceil(rate * 60), 20)
    concurrency = params.get("max_concurrency")
    return max(5 * int(concurrency), 50) if concurrency else 100


THINKING_ON, THINKING_OFF = "thinking on", "thinking off"
_RANDOM_1K = {"dataset_name": "random", "random_input_len": 1024, "random_output_len": 256, "ignore_eos": True}
_CONCURRENCY_CHARTS = ("throughput_vs_concurrency", "itl_vs_concurrency", "ttft_ttlt_vs_concurrency")
_RATE_CHARTS = ("completed_vs_offered_rate", "ttft_ttlt_vs_rate", "throughput_vs_completed_rate")
_RATES = [1, 2, 3, 4, 5, 6, 8, 10, 12, 14, 16, 18, 20]

# Seed 004 (DeepSeek-R1 on 8 x H200 and 8 x MI300X with SGLang, vLLM and TensorRT-LLM): every online run has
# 3,200-token inputs; its offline runs are batches submitted at once.
_SEED004_ONLINE = {"dataset_name": "random", "random_input_len": 3200, "random_output_len": 800, "ignore_eos": True}
SEED004 = Suite(
    name="seed004",
    title="Seed 004's comparison: online, output lengths, prefix caching, offline batches",
    seed="H200/MI300X comparison (seed 004): input 3,200; concurrency 4-128 at output 800; output 1,600-6,400 at "
    "concurrency 128; 2,000 of 3,200 tokens shared as a prefix at 128; offline batches of 32-1,024 at output 800 and "
    "256-1,024 at 1,600 and 3,200",
    description="Every experiment of seed 004 in one run, for one server or, with --target NAME=URL, several "
    "(engines or machines) into one report with a line per target: throughput and end-to-end latency against "
    "concurrency and output length, TTFT and ITL, throughput against latency, prefix sharing on and off, offline "
    "throughput against batch size.",
    base=_SEED004_ONLINE,
    grid={},
    sweep_axis="max_concurrency",
    charts=(
        "throughput_vs_concurrency",
        "ttft_ttlt_vs_concurrency",
        "itl_vs_concurrency",
        "throughput_vs_latency",
        "throughput_vs_output_len",
        "latency_vs_output_len",
        "prefix_sharing",
        "throughput_vs_batch_size",
    ),
    parts=(
        Suite("seed004-online", "", "", "", _SEED004_ONLINE, {"max_concurrency": [4, 8, 16, 32, 64, 128]}),
        Suite(
            "seed004-output-length",
            "",
            "",
            "",
            _SEED004_ONLINE | {"max_concurrency": 128},
            {"random_output_len": [1600, 3200, 6400]},
        ),
        Suite(
            "seed004-prefix",
            "",
            "",
            "",
            _SEED004_ONLINE | {"max_concurrency": 128},
            {},
            variants={
                PREFIX_NONE: {"dataset_name": "random"},
                PREFIX_SHARED: {"dataset_name": "shared_prefix", "shared_prefix_len": 2000, "num_prefix_groups": 1},
            },
        ),
        Suite(
            "seed004-offline-800",
            "",
            "",
            "",
            _SEED004_ONLINE,
            {"num_prompts": [32, 64, 128, 256, 512, 1024]},
            variants={OFFLINE: {}},
        ),
        Suite(
            "seed004-offline-long",
            "",
            "",
            "",
            _SEED004_ONLINE,
            {"random_output_len": [1600, 3200], "num_prompts": [256, 512, 1024]},
            variants={OFFLINE: {}},
        ),
    ),
)

SUITES: dict[str, Suite] = {
    suite.name: suite
    for suite in (
        Suite(
            name="concurrency",
            title="Throughput and latency against concurrency",
            seed="8xH100 AWQ report: input 1,024 / output 256, max concurrency 1 to 200",
            description="Output and total throughput, median and P99 ITL (against the SLO), TTFT and time to last "
            "token at each concurrency limit. Answers: the highest concurrency within the ITL SLO, and where "
            "throughput stops rising.",
            base=_RANDOM_1K,
            grid={"max_concurrency": [1, 2, 4, 8, 16, 24, 32, 48, 64, 100, 128, 150, 200]},
            sweep_axis="max_concurrency",
            charts=_CONCURRENCY_CHARTS,
        ),
        Suite(
            name="request-rate",
            title="Completed against offered request rate",
            seed="8xH100 AWQ report: QPS 1 to 20, input 1,024 / output 256 (server saturated near 2.75 QPS)",
            description="Poisson arrivals at 1 to 20 requests/s: the rate the server completes against the rate the "
            "client offers, and TTFT and time to last token as the queue builds. Answers: the saturation rate.",
            base=_RANDOM_1K,
            grid={"request_rate": _RATES},
            sweep_axis="request_rate",
            charts=_RATE_CHARTS,
        ),
        Suite(
            name="input-length",
            title="Input 1K against 4K",
            seed="8xH100 AWQ report: input 4,096 against 1,024 (output 256) over request rates",
            description="The request-rate sweep at two input lengths: long inputs raise total throughput but cap "
            "output throughput and saturate the server sooner.",
            base=_RANDOM_1K,
            grid={"random_input_len": [1024, 4096], "request_rate": [1, 2, 3, 4, 6, 8, 12, 16, 20]},
            sweep_axis="request_rate",
            charts=_RATE_CHARTS,
        ),
        Suite(
            name="output-length",
            title="Output 256, 1K and 4K",
            seed="8xH100 R1 report (output 256/1,024/4,096) and the H200/MI300X comparison (concurrency 128)",
            description="The same input (1,024) with longer outputs at concurrency 128: throughput against output "
            "length; TTFT should stay flat while total throughput falls.",
            base=_RANDOM_1K | {"max_concurrency": 128},
            grid={"random_output_len": [256, 1024, 4096]},
            charts=("throughput_vs_output_len",),
        ),
        Suite(
            name="long-prompt",
            title="A single long prompt of 10K and of 16K tokens",
            seed="long-context checks: one prompt of 10K and of 16K tokens",
            description="One request at a time with a 10K- and a 16K-token prompt (output 256): the cost of prefill "
            "alone, read as TTFT against input length.",
            base={"dataset_name": "long", "random_output_len": 256, "ignore_eos": True, "max_concurrency": 1},
            grid={"long_prompt_len": [10240, 16384], "num_prompts": [1]},
            charts=("latency_vs_input_len",),
        ),
        Suite(
            name="mixed-inputs",
            title="200 requests with inputs between 100 and 32K tokens",
            seed="mixed-length load: 200 requests of 100 to 32K input tokens at concurrency 100 and rate 100",
            description="A burst of requests whose inputs vary 300-fold: the point table shows how TTFT and its P99 "
            "stretch when long prefills share the batch with short ones.",
            base={
                "dataset_name": "sampled",
                "num_prompts": 200,
                "sampled_min_input_len": 100,
                "sampled_max_input_len": 32768,
                "random_output_len": 256,
                "ignore_eos": True,
                "max_concurrency": 100,
                "request_rate": 100,
            },
            grid={},
        ),
        Suite(
            name="concurrency-2k",
            title="Input 2,048 / output 512 at concurrency 1 to 1,024",
            seed="8xB200 table: input 2,048 / output 512 at concurrency 1 to 1,024 (saturation near 512)",
            description="The concurrency sweep at longer requests and far higher concurrency: where the batch fills "
            "and TTFT explodes.",
            base=_RANDOM_1K | {"random_input_len": 2048, "random_output_len": 512},
            grid={"max_concurrency": [1, 8, 16, 32, 64, 128, 256, 512, 1024]},
            sweep_axis="max_concurrency",
            charts=_CONCURRENCY_CHARTS,
        ),
        Suite(
            name="prefix-cache",
            title="Prefix sharing on against off",
            seed="H200/MI300X comparison: input 3,200 with 2,000 tokens (62.5%) shared as a prefix, concurrency 128",
            description="The same input length with a 2,000-token shared prefix and with none. On a server with "
            "prefix caching, sharing cuts TTFT; on vLLM's CPU build (MLA) prefix caching is off, so both match.",
            base={"random_input_len": 3200, "random_output_len": 800, "ignore_eos": True, "max_concurrency": 128},
            grid={},
            variants={
                PREFIX_NONE: {"dataset_name": "random"},
                PREFIX_SHARED: {"dataset_name": "shared_prefix", "shared_prefix_len": 2000, "num_prefix_groups": 1},
            },
            charts=("prefix_sharing",),
        ),
        Suite(
            name="reasoning",
            title="Thinking on against off",
            seed="DeepSeek V3.1 and later: thinking switched per request with chat_template_kwargs (issue 18)",
            description="The concurrency sweep on the chat endpoint with the model's thinking on and off "
            '(chat_template_kwargs {"thinking": true} / false): the time to the first answer token, reasoning '
            "and answer tokens per request, and what thinking costs in throughput.",
            base=_RANDOM_1K | {"endpoint": "/v1/chat/completions"},
            grid={"max_concurrency": [1, 4, 16, 64]},
            variants={
                THINKING_ON: {"chat_template_kwargs": '{"thinking": true}'},
                THINKING_OFF: {"chat_template_kwargs": '{"thinking": false}'},
            },
            sweep_axis="max_concurrency",
            charts=_CONCURRENCY_CHARTS,
        ),
        Suite(
            name="offline",
            title="Offline throughput at batch sizes 32 to 1,024",
            seed="H200/MI300X comparison: offline batches of 32 to 1,024 requests, input 3,200 / output 800",
            description="Each batch submitted at once with no concurrency limit: the server's throughput when "
            "latency does not matter.",
            base={"dataset_name": "random", "random_input_len": 3200, "random_output_len": 800, "ignore_eos": True},
            grid={"num_prompts": [32, 64, 128, 256, 512, 1024]},
            variants={OFFLINE: {}},
            charts=("throughput_vs_batch_size",),
        ),
        SEED004,
    )
}


def suite_names() -> list[str]:
    return list(SUITES)


def get_suite(name: str) -> Suite:
    if name not in SUITES:
        raise ConfigError(unknown_name("suite", name, suite_names()))
    return SUITES[name]


@dataclass(frozen=True)
class SpeedProbe:
    """How fast the server is, measured by short runs before a budgeted suite (see `deepserve.sweep.probe`).

    Prefill time for a prompt of L tokens: t(L) = L / prefill_tok_s + prefill_s_per_tok2 · L². The quadratic term
    is attention; on the tiny CPU model it dominates beyond a few thousand tokens (16K tokens take far longer than
    16 times 1K), on a GPU deployment it is small."""

    prefill_tok_s: float  # the linear part: input tokens per second
    tpot_s: float  # seconds per output token of one request alone
    peak_output_tok_s: float  # output tokens per second with many requests in flight
    prefill_s_per_tok2: float = 0.0  # the quadratic part of prefill time
    batched_prefill_tok_s: float | None = None  # input tokens/s with many prompts prefilled together

    def prefill_s(self, input_len: float, input_len_squared: float | None = None) -> float:
        squared = input_len * input_len if input_len_squared is None else input_len_squared
        return input_len / self.prefill_tok_s + self.prefill_s_per_tok2 * squared

    def decode_tok_s(self, concurrency: float) -> float:
        return min(concurrency / self.tpot_s, self.peak_output_tok_s)

    def request_s(self, input_len: int, output_len: int, concurrency: float) -> float:
        """One request's latency with CONCURRENCY in flight: its prefill, waiting behind the others' prefills, and
        its decode at the per-request rate the batch leaves it."""
        per_request_tok_s = self.decode_tok_s(concurrency) / max(concurrency, 1)
        return self.prefills_s(input_len, max(concurrency, 1)) + output_len / per_request_tok_s

    def prefills_s(self, input_len: float, count: float, input_len_squared: float | None = None) -> float:
        """COUNT prefills together: the linear part batches (at the batched rate), attention's part does not."""
        squared = input_len * input_len if input_len_squared is None else input_len_squared
        if count <= 1:
            return self.prefill_s(input_len, squared)
        rate = max(self.batched_prefill_tok_s or self.prefill_tok_s, self.prefill_tok_s)
        return count * (input_len / rate + self.prefill_s_per_tok2 * squared)

    def count_bounded_s(self, point: SuitePoint) -> float:
        """Estimated time of a point that sends a fixed number of requests."""
        n = point.num_prompts
        concurrency = min(point.concurrency or n, n)
        mean_len, mean_squared = _input_moments(point)
        output_len = point.output_len or 0
        work_s = self.prefills_s(mean_len, n, mean_squared) + n * output_len / self.decode_tok_s(concurrency)
        return max(work_s, self.request_s(round(mean_len), output_len, 1))


def _input_moments(point: SuitePoint) -> tuple[float, float]:
    """Mean input length and mean squared input length: a sampled set draws lengths uniformly in [low, high]."""
    if point.input_len is not None:
        return float(point.input_len), float(point.input_len) ** 2
    low = float(point.params.get("sampled_min_input_len") or 0)
    high = float(point.params.get("sampled_max_input_len") or 0)
    mean_squared = (high**3 - low**3) / (3 * (high - low)) if high > low else low * low
    return (low + high) / 2, mean_squared


def fit_prefill(short_len: int, short_s: float, long_len: int, long_s: float) -> tuple[float, float]:
    """(prefill_tok_s, prefill_s_per_tok2) through two measured prefills; a noisy pair that would give a negative
    term falls back to what one of them alone says."""
    quadratic = (long_s / long_len - short_s / short_len) / (long_len - short_len)
    linear_s_per_tok = short_s / short_len - quadratic * short_len
    if quadratic <= 0:
        return long_len / long_s if long_s > 0 else short_len / short_s, 0.0
    if linear_s_per_tok <= 0:  # all attention: keep a small linear part
        linear_s_per_tok = 0.1 * short_s / short_len
        quadratic = (short_s - linear_s_per_tok * short_len) / short_len**2
    return 1 / linear_s_per_tok, quadratic


@dataclass(frozen=True)
class SuitePlan:
    """A suite's points as they will run, and how they were scaled (saved in the sweep index)."""

    suite: Suite
    points: list[SuitePoint]
    length_factor: float
    point_duration_s: float | None  # each time-bounded point runs this long; None: its request count decides
    notes: list[str]

    def describe(self) -> dict[str, Any]:
        return {
            "length_factor": round(self.length_factor, 4),
            "point_duration_s": None if self.point_duration_s is None else round(self.point_duration_s, 1),
            "notes": self.notes,
        }


def plan_suite(
    suite: Suite,
    context_len: int | None,
    time_budget_s: float | None,
    probe: SpeedProbe | None,
    overrides: dict[str, Any] | None = None,
) -> SuitePlan:
    """SUITE's points scaled to CONTEXT_LEN and TIME_BUDGET_S (see the module doc). OVERRIDES (flags the user gave,
    such as --num-prompts) apply to every point and are never scaled."""
    points = [SuitePoint({**point.params, **(overrides or {})}, point.variant) for point in suite.points()]
    notes: list[str] = []
    factor = 1.0
    if context_len:
        longest = max(point.max_request_tokens() for point in points)
        if longest > CONTEXT_FILL * context_len:
            factor = CONTEXT_FILL * context_len / longest
            notes.append(f"lengths × {factor:.3f} to fit the {context_len}-token context")
    if not time_budget_s or probe is None:
        return SuitePlan(suite, _distinct(_scaled(points, factor, overrides)), factor, None, notes)
    timed = [point for point in points if point.time_bounded]
    counted = [point for point in points if not point.time_bounded]
    # Fixed-count points get their estimated time: at most half the budget (40% when timed points share it). The
    # margin is for what the estimate misses: on the tiny CPU model the sampled set took 1.4 times its estimate.
    counted_budget_s = time_budget_s * (0.4 if timed else 0.5)
    factor = _fit_counted(counted, factor, counted_budget_s, probe, overrides, notes)
    counted_s = sum(probe.count_bounded_s(point) for point in _scaled(counted, factor, overrides))
    duration_s = None
    if timed:
        # Each point's share, less room for the in-flight requests to finish after issuing stops.
        duration_s = max(MIN_POINT_DURATION_S, (time_budget_s * 0.85 - counted_s) / len(timed) * 0.6)
        factor = _fit_timed(timed, factor, duration_s, probe, overrides, notes)
        notes.append(f"each concurrency/rate point issues requests for {duration_s:.0f} s")
    scaled = _scaled(points, factor, overrides)
    if duration_s is not None:
        scaled = [_bound_by_time(point, duration_s, probe) for point in scaled]
    return SuitePlan(suite, _distinct(scaled), factor, duration_s, notes)


def _fit_counted(
    points: list[SuitePoint],
    factor: float,
    budget_s: float,
    probe: SpeedProbe,
    overrides: dict[str, Any] | None,
    notes: list[str],
) -> float:
    start = factor
    while points and factor > 1e-3:
        if sum(probe.count_bounded_s(point) for point in _scaled(points, factor, overrides)) <= budget_s:
            break
        factor *= 0.8
    if factor < start:
        notes.append(f"lengths × {factor:.3f} so that the fixed-count points fit the time budget")
    return factor


def _fit_timed(
    points: list[SuitePoint],
    factor: float,
    duration_s: float,
    probe: SpeedProbe,
    overrides: dict[str, Any] | None,
    notes: list[str],
) -> float:
    """Shrink lengths until one request at the heaviest point takes at most half of a point's duration, so that
    each point completes several rounds of requests and its drain stays short."""
    start = factor
    while factor > 1e-3:
        scaled = _scaled(points, factor, overrides)
        worst_s = max(
            probe.request_s(point.input_len or 0, point.output_len or 0, _load_of(point, probe)) for point in scaled
        )
        if worst_s <= duration_s / 2:
            break
        factor *= 0.8
    if factor < start:
        notes.append(f"lengths × {factor:.3f} so that requests finish well within each point's time")
    return factor


def _load_of(point: SuitePoint, probe: SpeedProbe) -> float:
    """Requests in flight at a point: its concurrency limit, or what its arrival rate sustains (Little's law,
    capped at the first 100 in flight)."""
    if point.concurrency is not None:
        return point.concurrency
    if math.isfinite(point.request_rate):
        one_s = probe.request_s(point.input_len or 0, point.output_len or 0, 1)
        return min(max(point.request_rate * one_s, 1.0), 100.0)
    return point.num_prompts


def _bound_by_time(point: SuitePoint, duration_s: float, probe: SpeedProbe) -> SuitePoint:
    """A time-bounded point issues requests for DURATION_S; it needs only as many distinct prompts as it can send
    in that time (the runner cycles them), which keeps building the workload cheap."""
    if not point.time_bounded:
        return point
    load = _load_of(point, probe)
    one_s = probe.request_s(point.input_len or 0, point.output_len or 0, load)
    rate = point.request_rate if math.isfinite(point.request_rate) else load / max(one_s, 1e-3)
    wanted = math.ceil(rate * duration_s) + (point.concurrency or 0)
    num_prompts = max(1, min(point.num_prompts, wanted))
    return replace(point, params={**point.params, "duration_s": round(duration_s, 1), "num_prompts": num_prompts})


def _distinct(points: list[SuitePoint]) -> list[SuitePoint]:
    """POINTS without repeats: lengths shrunk to their floors can make two points of a suite the same (seed 004's
    outputs of 800 and 1,600 both become 4 tokens), and one benchmark answers both."""
    seen: list[tuple[dict[str, Any], str | None]] = []
    kept = []
    for point in points:
        key = (point.params, point.variant)
        if key not in seen:
            seen.append(key)
            kept.append(point)
    return kept


def _scaled(points: list[SuitePoint], factor: float, overrides: dict[str, Any] | None) -> list[SuitePoint]:
    if factor >= 1.0:
        return points
    fixed = set(overrides or {})
    return [replace(point, params=_scale_lengths(point.params, factor, fixed)) for point in points]


def _scale_lengths(params: dict[str, Any], factor: float, fixed: set[str]) -> dict[str, Any]:
    scaled = dict(params)
    for name in LENGTH_FIELDS:
        if name in params and params[name] is not None and name not in fixed:
            floor = MIN_OUTPUT_LEN if name == "random_output_len" else MIN_INPUT_LEN
            scaled[name] = max(floor, round(params[name] * factor))
    if scaled.get("shared_prefix_len") and scaled.get("random_input_len"):
        # The prefix must stay shorter than the prompt it is part of.
        scaled["shared_prefix_len"] = min(scaled["shared_prefix_len"], scaled["random_input_len"] - 1)
    return scaled
