"""Reading an engine's Prometheus /metrics: one small parser, driven by each engine's table of metric names.

Everything that reads a running engine's series goes through here: the benchmark's server metrics
(bench/server_metrics.py), the gateway's engine-aware balancing (gateway/engine_load.py) and its merged
/metrics/engines (gateway/engine_metrics.py); `deepserve tune` reads them through the benchmark.

A table (`MetricNames`) names, per quantity (requests running, KV-cache usage, prefix-cache hits, speculative
decoding's drafts, ...), the series an engine reports it in. Several names for one quantity are fallbacks: engines
rename series between versions, and the first name present wins. How several label sets of one series combine
(several engines behind one server, or replicas behind deepserve's gateway) is the quantity's: requests add up, a
KV-cache fraction takes the fullest engine, a windowed average takes the mean; counters are kept per series (name
and labels as written) so that their growth can be followed series by series.

Only the wanted series are parsed, found by searching the text for their names: vLLM's /metrics is about 100 KB of
mostly histograms, read several times a second.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields, replace
from typing import Literal

from deepserve.engines import trtllm_metrics as trtllm
from deepserve.engines import vllm_metrics as vllm

Combine = Literal["sum", "max", "mean", "series"]
LOAD_QUANTITIES = ("waiting", "running", "kv_cache_usage")  # what the gateway's engine_aware balancing reads

# How several label sets of one quantity's series combine; "series": a counter, kept per series.
COMBINE: dict[str, Combine] = {
    "waiting": "sum",
    "running": "sum",
    "kv_cache_usage": "max",  # a fraction of each engine's own cache: the fullest engine
    "prefix_cache_queries": "series",
    "prefix_cache_hits": "series",
    "prefix_cache_hit_rate": "mean",  # SGLang's windowed gauge
    "preemptions": "series",
    "spec_drafts": "series",
    "spec_draft_tokens": "series",
    "spec_accepted_tokens": "series",
    "spec_accepted_tokens_per_position": "series",
    "spec_acceptance_length": "mean",  # SGLang's windowed gauges
    "spec_acceptance_rate": "mean",
}


@dataclass(frozen=True)
class MetricNames:
    """The series in which one engine reports each quantity; several names: the first one present wins."""

    waiting: tuple[str, ...] = ()  # requests queued, not yet scheduled
    running: tuple[str, ...] = ()  # requests in the running batch
    kv_cache_usage: tuple[str, ...] = ()  # fraction (0..1) of the KV cache in use
    prefix_cache_queries: tuple[str, ...] = ()  # counter: prompt tokens looked up in the prefix cache
    prefix_cache_hits: tuple[str, ...] = ()  # counter: of which found there
    prefix_cache_hit_rate: tuple[str, ...] = ()  # gauge: an engine's own recent hit rate (no counters)
    preemptions: tuple[str, ...] = ()  # counter: requests preempted (vLLM) or retracted (SGLang)
    spec_drafts: tuple[str, ...] = ()  # counter: speculative drafts proposed (one per sequence per step)
    spec_draft_tokens: tuple[str, ...] = ()  # counter: draft tokens proposed
    spec_accepted_tokens: tuple[str, ...] = ()  # counter: draft tokens accepted
    spec_accepted_tokens_per_position: tuple[str, ...] = ()  # counter, labelled position="i": accepted at draft i
    spec_acceptance_length: tuple[str, ...] = ()  # gauge: an engine's recent mean tokens per step (no counters)
    spec_acceptance_rate: tuple[str, ...] = ()  # gauge: its recent accepted / draft tokens
    engine: str = ""
    path: str = "/metrics"  # where the engine serves them in Prometheus's text format

    def of(self, quantity: str) -> tuple[str, ...]:
        names: tuple[str, ...] = getattr(self, quantity)
        return names

    def all_names(self) -> tuple[str, ...]:
        return tuple(name for quantity in COMBINE for name in self.of(quantity))

    def only(self, *quantities: str) -> MetricNames:
        """This table with the other quantities left out (a reader that wants a few looks for fewer series)."""
        empty: dict[str, tuple[str, ...]] = {quantity: () for quantity in COMBINE if quantity not in quantities}
        return replace(self, **empty)  # type: ignore[arg-type]  # every key is a tuple field

    def quantity_of(self, name: str) -> str | None:
        return next((quantity for quantity in COMBINE if name in self.of(quantity)), None)


# vLLM's V1 engine: vllm/v1/metrics/loggers.py and vllm/v1/spec_decode/metrics.py (vLLM 0.32).
VLLM_METRICS = MetricNames(
    engine="vllm",
    waiting=(vllm.WAITING,),
    running=(vllm.RUNNING,),
    kv_cache_usage=vllm.KV_CACHE_USAGE_NAMES,
    prefix_cache_queries=(vllm.PREFIX_CACHE_QUERIES,),
    prefix_cache_hits=(vllm.PREFIX_CACHE_HITS,),
    preemptions=(vllm.PREEMPTIONS,),
    spec_drafts=(vllm.SPEC_DECODE_DRAFTS,),
    spec_draft_tokens=(vllm.SPEC_DECODE_DRAFT_TOKENS,),
    spec_accepted_tokens=(vllm.SPEC_DECODE_ACCEPTED_TOKENS,),
    spec_accepted_tokens_per_position=(vllm.SPEC_DECODE_ACCEPTED_PER_POSITION,),
)

# SGLang: python/sglang/srt/metrics/collector.py (github.com/sgl-project/sglang @ 00ae9c15). Its speculative
# decoding figures are gauges averaged over its last logging window ("mostrecent"), not counters, so a run's
# acceptance from them is the mean of the scraped values; its prefix cache has a windowed hit-rate gauge and the
# counters sglang:cached_tokens_total / sglang:prompt_tokens_total; a retraction is its preemption.
SGLANG_METRICS = MetricNames(
    engine="sglang",
    waiting=("sglang:num_queue_reqs",),
    running=("sglang:num_running_reqs",),
    kv_cache_usage=("sglang:token_usage",),  # the fraction of the KV-cache token pool in use
    prefix_cache_queries=("sglang:prompt_tokens_total",),
    prefix_cache_hits=("sglang:cached_tokens_total",),
    prefix_cache_hit_rate=("sglang:cache_hit_rate",),
    preemptions=("sglang:num_retracted_requests_total",),
    spec_acceptance_length=("sglang:spec_accept_length",),
    spec_acceptance_rate=("sglang:spec_accept_rate",),
)

# TensorRT-LLM's `trtllm-serve` (engines/trtllm_metrics.py): Prometheus text at its own path, counters of draft and
# accepted tokens (no per-draft count) and a windowed prefix-cache hit rate.
TRTLLM_METRICS = MetricNames(
    engine="trtllm",
    path=trtllm.PROMETHEUS_PATH,
    waiting=(trtllm.WAITING,),
    running=(trtllm.RUNNING,),
    kv_cache_usage=(trtllm.KV_CACHE_USAGE,),
    prefix_cache_hit_rate=(trtllm.KV_CACHE_HIT_RATE,),
    spec_draft_tokens=(trtllm.SPEC_DECODE_DRAFT_TOKENS,),
    spec_accepted_tokens=(trtllm.SPEC_DECODE_ACCEPTED_TOKENS,),
    spec_acceptance_length=(trtllm.SPEC_DECODE_ACCEPTANCE_LENGTH,),
)

ENGINE_METRICS: dict[str, MetricNames] = {"vllm": VLLM_METRICS, "sglang": SGLANG_METRICS, "trtllm": TRTLLM_METRICS}


@dataclass(frozen=True)
class Sample:
    """One sample line: its metric name, its labels exactly as written (`{a="1",b="2"}`, or ""), its value."""

    name: str
    labels: str
    value: float

    @property
    def series(self) -> str:
        return self.name + self.labels


def sample_lines(text: str, name: str) -> Iterator[str]:
    """The sample lines of series NAME (any labels) in TEXT, found by searching for the name at line starts (a
    longer name that starts with NAME, or NAME inside a HELP/TYPE comment, is not it)."""
    start = 0
    while True:
        at = text.find(name, start)
        if at < 0:
            return
        start = at + len(name)
        if at and text[at - 1] != "\n":
            continue
        if text[start : start + 1] not in ("{", " "):
            continue
        end = text.find("\n", start)
        yield text[at : end if end >= 0 else len(text)]


def parse_sample(line: str) -> Sample | None:
    """One sample line (`name{labels} value [timestamp]`); None when it does not parse."""
    name = sample_name(line)
    rest = line[len(name) :]
    labels = ""
    if rest.startswith("{"):
        close = _labels_end(rest)
        if close < 0:
            return None
        labels, rest = rest[: close + 1], rest[close + 1 :]
    parts = rest.split()
    with contextlib.suppress(IndexError, ValueError):
        return Sample(name, labels, float(parts[0]))
    return None


def parse_samples(text: str, names: Iterable[str]) -> list[Sample]:
    """Every sample of the series NAMES in TEXT (Prometheus text format)."""
    samples = []
    for name in names:
        for line in sample_lines(text, name):
            sample = parse_sample(line)
            if sample is not None:
                samples.append(sample)
    return samples


def sample_name(line: str) -> str:
    """The metric name of a sample line."""
    ends = [i for i in (line.find("{"), line.find(" ")) if i >= 0]
    return line[: min(ends)] if ends else line


def _labels_end(rest: str) -> int:
    """The index of the `}` that closes the label set REST opens (quoted values may hold braces)."""
    quoted = escaped = False
    for index, char in enumerate(rest):
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = quoted
        elif char == '"':
            quoted = not quoted
        elif char == "}" and not quoted:
            return index
    return -1


def label_value(labels: str, key: str) -> str | None:
    """The value of label KEY in a label set as written (`{a="1",position="2"}`), unescaped; None when absent."""
    at = labels.find(f'{key}="')
    while at > 0 and labels[at - 1] not in "{,":
        at = labels.find(f'{key}="', at + 1)
    if at < 0:
        return None
    value, index = [], at + len(key) + 2
    while index < len(labels) and labels[index] != '"':
        char = labels[index]
        if char == "\\" and index + 1 < len(labels):
            index += 1
            char = {"n": "\n"}.get(labels[index], labels[index])
        value.append(char)
        index += 1
    return "".join(value)


def with_label(line: str, key: str, value: str) -> str:
    """Sample LINE with KEY="VALUE" as its first label (escaped as the text format requires)."""
    label = f'{key}="{_escape(value)}"'
    brace, space = line.find("{"), line.find(" ")
    if brace != -1 and (space == -1 or brace < space):
        inner = brace + 1
        separator = "" if line[inner : inner + 1] == "}" else ","
        return f"{line[:inner]}{label}{separator}{line[inner:]}"
    if space == -1:
        return line
    return f"{line[:space]}{{{label}}}{line[space:]}"


LEFT_OUT_PREFIX = "# replica "
LEFT_OUT_MARK = " left out: "


def left_out_comment(replica: str, reason: str) -> str:
    """The comment line a merged exposition (the gateway's /metrics/engines) has for a replica it lacks."""
    return f"{LEFT_OUT_PREFIX}{replica}{LEFT_OUT_MARK}{reason}"


def read_left_out(text: str) -> dict[str, str]:
    """{replica: reason} from the left_out_comment lines of TEXT."""
    missing: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith(LEFT_OUT_PREFIX) and LEFT_OUT_MARK in line:
            replica, _, reason = line[len(LEFT_OUT_PREFIX) :].partition(LEFT_OUT_MARK)
            missing[replica] = reason
    return missing


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def read_metrics(text: str, names: MetricNames) -> dict[str, float]:
    """The series of NAMES' table in TEXT: gauges by metric name, their label sets combined by the quantity's rule
    (COMBINE); counters by series (`name{labels}` as written), each kept apart."""
    values: dict[str, float] = {}
    counts: dict[str, int] = {}
    for sample in parse_samples(text, names.all_names()):
        combine = COMBINE[names.quantity_of(sample.name) or "running"]
        if combine == "series":
            values[sample.series] = sample.value
        elif sample.name not in values:
            values[sample.name], counts[sample.name] = sample.value, 1
        elif combine == "sum":
            values[sample.name] += sample.value
        elif combine == "max":
            values[sample.name] = max(values[sample.name], sample.value)
        else:  # mean: a running mean over the label sets
            counts[sample.name] += 1
            values[sample.name] += (sample.value - values[sample.name]) / counts[sample.name]
    return values


def detect_engine(text: str, tables: Iterable[MetricNames] | None = None) -> MetricNames | None:
    """The first table (vLLM's, then SGLang's) whose series TEXT has; None when it has none of any."""
    for names in tables if tables is not None else ENGINE_METRICS.values():
        if any(next(sample_lines(text, name), None) is not None for name in names.all_names()):
            return names
    return None


def first_present(values: dict[str, float], names: tuple[str, ...]) -> float | None:
    """The value of the first of NAMES in VALUES (read_metrics' gauges), None when none is there."""
    return next((values[name] for name in names if name in values), None)


def series_name(key: str) -> str:
    """The metric name of a counter's series key: `vllm:x_total{replica="a"}` -> `vllm:x_total`."""
    return key.partition("{")[0]


def series_labels(key: str) -> str:
    """The label set of a counter's series key, as written (`{replica="a"}`, or "")."""
    name = series_name(key)
    return key[len(name) :]


def quantity_fields() -> tuple[str, ...]:
    """Every quantity a table can name (for tests that check the tables are complete)."""
    return tuple(field.name for field in fields(MetricNames) if field.name not in ("engine", "path"))
