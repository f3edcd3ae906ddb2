"""Sample the engine's Prometheus /metrics during a run and summarise what the server saw beside the client's view.

The text is read by the engines' shared reader (engines/metrics.py), with the table of the engine whose series the
server exports (vLLM's, SGLang's): gauges combined over label sets (requests add up, KV-cache usage takes the
fullest engine), counters kept per series (name and labels, the replica's included) and each series' growth over
the run summed: behind the gateway a replica may be missing from some scrapes (only healthy ones are listed) or join
late, and a sum across replicas taken per scrape would then count its whole lifetime, or go negative. A server
without /metrics is noted in the result, never an error.

When to sample: a peak between two scrapes is missed, so a run must be sampled often enough for its own length. By
default (`--server-metrics-interval-s` not given) the interval grows with the run: every 50 ms at first, then a
twentieth of the time elapsed, at most 1 s, so a run of a few seconds gets dozens of samples and a long one one a
second (scraping vLLM's /metrics costs its API server a few milliseconds of CPU each time). And a sample is taken
whenever the client's requests in flight reach a new high (once the server has had a moment to schedule them): the
instant the engine's running batch is most likely at its peak.

Behind deepserve's gateway, `<base>/metrics` has only the gateway's series; its `/metrics/engines` has every healthy
replica's, labelled by replica. When the first URL has no engine series, the scraper tries that one; the summary
says which URL the numbers came from. The gateway answers that URL from a scrape up to a quarter second old (it
shields the engines from callers in a loop), so the run's first and last samples, which bound every counter's
growth, are taken that long after the run's start and end: the last one then counts the last requests' steps (a
run of the tiny MTP model, whose last wave took under a quarter second, had half its drafts missing without it).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from deepserve._compat import wait_for_event
from deepserve.bench.config import BenchConfig
from deepserve.engines import vllm_metrics as vllm
from deepserve.engines.metrics import (
    ENGINE_METRICS,
    VLLM_METRICS,
    MetricNames,
    detect_engine,
    label_value,
    read_left_out,
    read_metrics,
    series_labels,
    series_name,
)

GATEWAY_ENGINES_PATH = "/metrics/engines"  # deepserve's gateway: every replica's /metrics (gateway/engine_metrics.py)
# How old the gateway's answer there may be (gateway/engine_metrics.py CACHE_S; a test keeps them equal), plus a margin
GATEWAY_ENGINES_MAX_AGE_S = 0.25
GATEWAY_FRESH_WAIT_S = GATEWAY_ENGINES_MAX_AGE_S + 0.05
AUTO_MIN_INTERVAL_S = 0.05  # the first samples of a run
AUTO_MAX_INTERVAL_S = 1.0  # a long run's
AUTO_SAMPLES_PER_ELAPSED = 20  # interval = elapsed / 20 in between
ENGINE_TITLES = {"vllm": "vLLM", "sglang": "SGLang"}
NO_SAMPLE_IN_RUN = (
    "no sample was taken while requests were in flight (each scrape outlasted the run, or none landed in it): the"
    " peaks are the server's before and after the run, not during it; a longer run, or --server-metrics-url at the"
    " engine itself, gives some"
)
ENGINE_IDLE_IN_EVERY_SAMPLE = (
    "the engine reported no request running or waiting in any sample, though some were taken while requests were"
    " in flight: the samples landed only between the engine's bursts of work (on a machine short of CPU, this client"
    " or the server's API process got a core only while the engine idled), or the engine had finished each request"
    " before the client got the answer; the peaks are not the run's"
)
# a client that waited this share of the run for a CPU, and at least this long, is named in the note
CLIENT_WAIT_NOTE_SHARE = 0.1
CLIENT_WAIT_NOTE_MIN_S = 0.5
PEAK_SETTLE_S = 0.02  # after a new high of requests in flight: time for the server to read and schedule them


def auto_interval_s(elapsed_s: float) -> float:
    """The time to the next sample of a run ELAPSED_S old, when no fixed interval was asked for."""
    return min(AUTO_MAX_INTERVAL_S, max(AUTO_MIN_INTERVAL_S, elapsed_s / AUTO_SAMPLES_PER_ELAPSED))


def parse_metrics(text: str, names: MetricNames | None = None) -> dict[str, float]:
    """The series of NAMES' table (default: the engine whose series TEXT has, else vLLM's) in Prometheus TEXT: gauges
    by name, combined over label sets; counters by series, `name{labels}` as written (engines/metrics.py)."""
    return read_metrics(text, names or detect_engine(text) or VLLM_METRICS)


@dataclass
class SpecDecodeSummary:
    """Speculative decoding over the run, from the engine's counters (vLLM) or the mean of its windowed gauges
    (SGLang). Definitions are vLLM's (vllm/v1/spec_decode/metrics.py): acceptance rate = accepted / draft tokens;
    mean acceptance length = 1 + accepted / drafts (the tokens one verification step yields); acceptance at draft
    position i = accepted at i / drafts."""

    source: str  # "counters" or "gauges (mean of N samples)"
    drafts: float | None = None
    draft_tokens: float | None = None
    accepted_tokens: float | None = None
    acceptance_rate: float | None = None
    mean_acceptance_length: float | None = None
    acceptance_by_position: list[float] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def spec_decode_from_counters(
    drafts: float, draft_tokens: float, accepted: float, accepted_by_position: list[float]
) -> SpecDecodeSummary:
    """vLLM's figures from the growth of its four counters over the run (per position: in position order)."""
    return SpecDecodeSummary(
        source="counters",
        drafts=drafts,
        draft_tokens=draft_tokens,
        accepted_tokens=accepted,
        acceptance_rate=accepted / draft_tokens if draft_tokens else None,
        mean_acceptance_length=1 + accepted / drafts if drafts else None,
        acceptance_by_position=[count / drafts for count in accepted_by_position] if drafts else [],
    )


@dataclass
class ServerMetricsSummary:
    """What the server reported during the measured run. Peaks are over samples; totals are each counter series'
    growth over the run (see series_growth), summed over series."""

    available: bool
    note: str = ""
    url: str | None = None  # where the numbers came from
    engine: str | None = None  # whose metric names the server exports: vllm, sglang
    scrapes: int = 0
    # samples taken while the client had requests in flight (when it sent and when the answer came); None: not
    # known (a run driven by several worker processes). Peaks come from these: with none, they are not the run's.
    samples_in_run: int | None = None
    sampling: str = ""  # when samples were taken
    peak_running: float | None = None
    peak_waiting: float | None = None
    peak_kv_cache_usage_perc: float | None = None  # 0..1, as vLLM reports it
    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None
    prefix_cache_hit_rate: float | None = None
    preemptions: float | None = None
    spec_decode: SpecDecodeSummary | None = None  # None: the engine reported no speculative decoding
    # seconds this client's event loop was runnable but waiting for a CPU between the first and last sample (Linux's
    # run-queue wait); None where the kernel does not say
    client_cpu_wait_s: float | None = None
    # behind the gateway: replicas some samples lacked, each with how many and the last reason the gateway gave
    replicas_left_out: dict[str, str] = field(default_factory=dict)
    samples: list[dict[str, float]] = field(default_factory=list, repr=False)

    def to_json(self) -> dict[str, Any]:
        data = {key: value for key, value in self.__dict__.items() if key not in ("samples", "spec_decode")}
        data["spec_decode"] = self.spec_decode.to_json() if self.spec_decode is not None else None
        return data


def summarize_samples(samples: list[dict[str, float]], names: MetricNames | None = None) -> ServerMetricsSummary:
    """Peaks, counter growth and speculative decoding over SAMPLES (parse_metrics of each scrape) read with NAMES'
    table (default: the engine whose series the samples hold, else vLLM's)."""
    names = names or _table_of(samples)
    summary = ServerMetricsSummary(available=True, scrapes=len(samples), samples=samples, engine=names.engine)
    if not samples:
        return summary
    summary.peak_running = _peak(samples, names.running)
    summary.peak_waiting = _peak(samples, names.waiting)
    summary.peak_kv_cache_usage_perc = _peak(samples, names.kv_cache_usage)
    summary.prefix_cache_queries = _growth(samples, names.prefix_cache_queries)
    summary.prefix_cache_hits = _growth(samples, names.prefix_cache_hits)
    summary.preemptions = _growth(samples, names.preemptions)
    if summary.prefix_cache_queries and summary.prefix_cache_hits is not None:
        summary.prefix_cache_hit_rate = summary.prefix_cache_hits / summary.prefix_cache_queries
    elif summary.prefix_cache_queries is None:
        summary.prefix_cache_hit_rate = _mean(samples, names.prefix_cache_hit_rate)
    summary.spec_decode = spec_decode_summary(samples, names)
    if not any(series_name(key) in names.all_names() for sample in samples for key in sample):
        engine = ENGINE_TITLES.get(names.engine, "engine")
        summary.note = f"the server's /metrics has none of the {engine} series we report"
    return summary


def spec_decode_summary(samples: list[dict[str, float]], names: MetricNames) -> SpecDecodeSummary | None:
    """Speculative decoding over the run: from counters where the engine has them, else from its gauges; None when
    it reports none (speculative decoding off)."""
    drafts = _growth(samples, names.spec_drafts)
    if drafts is not None:
        return spec_decode_from_counters(
            drafts,
            _growth(samples, names.spec_draft_tokens) or 0.0,
            _growth(samples, names.spec_accepted_tokens) or 0.0,
            _growth_by_position(samples, names.spec_accepted_tokens_per_position),
        )
    length = _mean(samples, names.spec_acceptance_length)
    rate = _mean(samples, names.spec_acceptance_rate)
    if length is None and rate is None:
        return None
    counted = sum(1 for sample in samples if any(name in sample for name in names.spec_acceptance_length))
    return SpecDecodeSummary(
        source=f"gauges (the engine's windowed averages; mean of {counted} samples)",
        acceptance_rate=rate,
        mean_acceptance_length=length,
    )


def _table_of(samples: list[dict[str, float]]) -> MetricNames:
    seen = {series_name(key) for sample in samples for key in sample}
    return next((names for names in ENGINE_METRICS.values() if seen & set(names.all_names())), VLLM_METRICS)


def _peak(samples: list[dict[str, float]], names: tuple[str, ...]) -> float | None:
    seen = [sample[name] for sample in samples for name in names if name in sample]
    return max(seen) if seen else None


def _mean(samples: list[dict[str, float]], names: tuple[str, ...]) -> float | None:
    seen = [sample[name] for sample in samples for name in names if name in sample]
    return sum(seen) / len(seen) if seen else None


def _counter_series(samples: list[dict[str, float]], names: tuple[str, ...]) -> set[str]:
    """The series of the first of NAMES that any sample has (a renamed counter is not counted twice)."""
    for name in names:
        series = {key for sample in samples for key in sample if series_name(key) == name}
        if series:
            return series
    return set()


def _growth(samples: list[dict[str, float]], names: tuple[str, ...]) -> float | None:
    series = _counter_series(samples, names)
    if not series:
        return None
    return sum(series_growth([sample[key] for sample in samples if key in sample]) for key in series)


def _growth_by_position(samples: list[dict[str, float]], names: tuple[str, ...]) -> list[float]:
    """Per draft position (the `position` label, from 0), the growth of its series summed over the others."""
    grown: dict[int, float] = {}
    for key in _counter_series(samples, names):
        position = label_value(series_labels(key), vllm.SPEC_DECODE_POSITION_LABEL)
        if position is None or not position.isdigit():
            continue
        values = [sample[key] for sample in samples if key in sample]
        grown[int(position)] = grown.get(int(position), 0.0) + series_growth(values)
    return [grown.get(position, 0.0) for position in range(max(grown) + 1)] if grown else []


def series_growth(values: list[float]) -> float:
    """How much one counter series grew over its scrapes (from its first one: a series that appears late is counted
    from then, not over its lifetime). A drop is a restart of the counter: it counts again from zero."""
    grown = 0.0
    for previous, value in itertools.pairwise(values):
        grown += value - previous if value >= previous else value
    return grown


class ServerMetricsScraper:
    """Samples URL from `start()` until `stop()`: once before and once after the run, and in between every
    INTERVAL_S (None: the automatic schedule, `auto_interval_s`) and whenever `client_in_flight` reports a new high.
    FALLBACK_URL (a gateway's /metrics/engines) replaces URL when URL answers without any engine series and the
    fallback has some."""

    def __init__(
        self,
        url: str,
        interval_s: float | None = None,
        headers: dict[str, str] | None = None,
        fallback_url: str | None = None,
        verify: bool = True,
    ) -> None:
        self.url = url
        self.fallback_url = fallback_url
        self.interval_s = interval_s
        self._client = httpx.AsyncClient(timeout=5.0, headers=headers or {}, verify=verify)
        self._names: MetricNames | None = None
        self._samples: list[dict[str, float]] = []
        self._task: asyncio.Task[None] | None = None
        self._unavailable: str | None = None
        self._fallback_note = ""
        self._client_peak = 0
        self._new_peak = asyncio.Event()
        self._stopping = False
        self._peak_scrapes = 0
        self._client_now: int | None = None  # None until the driver reports: samples_in_run is then unknown
        self._samples_in_run = 0
        self._left_out: dict[str, tuple[int, str]] = {}  # replica: (samples that lacked it, the last reason)
        self._started: tuple[float, float | None] = (time.monotonic(), None)  # start() reads the run-queue wait

    async def start(self) -> None:
        self._started = (time.monotonic(), run_queue_wait_s())
        await self._scrape_fresh()  # the baseline for counters
        if self.fallback_url and not any(self._samples[-1:]):
            await self._try_fallback()
        if self._unavailable is None:
            self._task = asyncio.create_task(self._loop())

    def client_in_flight(self, count: int) -> None:
        """The client's requests in flight (called by the driver as each is sent and as each ends): a new high asks
        for a sample."""
        self._client_now = count
        if count > self._client_peak:
            self._client_peak = count
            self._new_peak.set()

    async def _try_fallback(self) -> None:
        assert self.fallback_url is not None
        await asyncio.sleep(_fresh_wait_s(self.fallback_url))  # the baseline: no older than the run
        try:
            response = await self._client.get(self.fallback_url)
        except httpx.HTTPError:
            return
        sample = self._parse(response.text) if response.status_code == 200 else {}
        self._fallback_note = f" (nor has {self.fallback_url})"
        if sample:
            self.url, self._samples, self._unavailable = self.fallback_url, [], None
            self._record(response.text, sample)

    async def _loop(self) -> None:
        started = time.monotonic()
        while not self._stopping:
            wait_s = self.interval_s or auto_interval_s(time.monotonic() - started)
            await wait_for_event(self._new_peak, wait_s)
            if self._stopping:
                return
            if self._new_peak.is_set():  # sample once the server has read and scheduled the new requests
                self._new_peak.clear()
                self._peak_scrapes += 1
                await asyncio.sleep(PEAK_SETTLE_S)
            await self._scrape()

    async def _scrape_fresh(self) -> None:
        """A sample of the server as it is now (at the run's start and end): through the gateway's cached merge,
        once the answer it may hold is younger than this moment."""
        await asyncio.sleep(_fresh_wait_s(self.url))
        await self._scrape()

    async def _scrape(self) -> None:
        in_flight_before = self._client_now or 0
        try:
            response = await self._client.get(self.url)
        except httpx.HTTPError as exc:
            if not self._samples:
                self._unavailable = f"no metrics endpoint at {self.url} ({exc.__class__.__name__})"
            return
        if response.status_code != 200:
            if not self._samples:
                self._unavailable = f"no metrics endpoint at {self.url} (HTTP {response.status_code})"
            return
        self._record(response.text, self._parse(response.text))
        if in_flight_before and self._client_now:
            self._samples_in_run += 1

    def _record(self, text: str, sample: dict[str, float]) -> None:
        """Keep SAMPLE (parsed from TEXT), and count the replicas the gateway's TEXT says it lacks."""
        self._samples.append(sample)
        for replica, reason in read_left_out(text).items():
            self._left_out[replica] = (self._left_out.get(replica, (0, ""))[0] + 1, reason)

    def _parse(self, text: str) -> dict[str, float]:
        """One scrape, read with the table of the engine found in the first scrape that had any."""
        if self._names is None:
            self._names = detect_engine(text)
        return parse_metrics(text, self._names)

    async def stop(self) -> ServerMetricsSummary:
        if self._task is not None:
            self._stopping = True  # the loop ends at its next turn even where a cancellation is lost
            self._new_peak.set()
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            await self._scrape_fresh()  # after the last request: what the engine counted for it
        await self._client.aclose()
        if self._unavailable is not None:
            return ServerMetricsSummary(available=False, note=self._unavailable, url=self.url)
        summary = summarize_samples(self._samples, self._names)
        summary.url = self.url
        summary.sampling = self._sampling_words()
        summary.samples_in_run = None if self._client_now is None else self._samples_in_run
        summary.client_cpu_wait_s = self._client_wait_s()
        summary.replicas_left_out = {
            replica: f"missing from {count} of {len(self._samples)} samples (last: {reason})"
            for replica, (count, reason) in self._left_out.items()
        }
        summary.note = self._note(summary)
        return summary

    def _note(self, summary: ServerMetricsSummary) -> str:
        """SUMMARY's note with what this scraper saw: series missing at the fallback URL too, no sample in the run
        or only samples of an idle engine, replicas the gateway left out."""
        missing_series = summary.note + self._fallback_note if summary.note else ""
        no_sample = NO_SAMPLE_IN_RUN if summary.samples_in_run == 0 else ""
        idle = ENGINE_IDLE_IN_EVERY_SAMPLE if self._saw_only_an_idle_engine(summary) else ""
        left_out = [f"{replica} {why}" for replica, why in summary.replicas_left_out.items()]
        return "; ".join(filter(None, [missing_series, no_sample, idle, self._client_wait_note(summary), *left_out]))

    def _client_wait_s(self) -> float | None:
        now = run_queue_wait_s()
        return None if now is None or self._started[1] is None else now - self._started[1]

    def _client_wait_note(self, summary: ServerMetricsSummary) -> str:
        """Words for a client that spent a good share of the run waiting for a CPU."""
        waited_s, elapsed_s = summary.client_cpu_wait_s, time.monotonic() - self._started[0]
        if waited_s is None or waited_s < max(CLIENT_WAIT_NOTE_MIN_S, CLIENT_WAIT_NOTE_SHARE * elapsed_s):
            return ""
        return (
            f"this client waited {waited_s:.1f} s of {elapsed_s:.1f} s for a CPU, so its samples, its requests' send"
            " times and its reads fell where it got one (tokens read together share one arrival time: ITLs of 0,"
            " answers in one write): the machine is short of CPU for it beside the server (where the kernel"
            " groups processes by session, a bench started from another terminal than the server gets a share of its"
            " own and may wait like this; start both from one shell, or the bench on another machine)"
        )

    def _saw_only_an_idle_engine(self, summary: ServerMetricsSummary) -> bool:
        """Samples taken while the client's requests were in flight, all showing an engine with nothing running or
        waiting: the engine did work that no sample caught (its peaks of 0 would be taken for the run's)."""
        return bool(summary.samples_in_run) and summary.peak_running == 0 and not summary.peak_waiting

    def _sampling_words(self) -> str:
        every = (
            f"every {self.interval_s:g} s"
            if self.interval_s
            else f"every {AUTO_MIN_INTERVAL_S * 1000:.0f} ms at first, then elapsed/{AUTO_SAMPLES_PER_ELAPSED} "
            f"(at most {AUTO_MAX_INTERVAL_S:g} s)"
        )
        return f"{every}, and {self._peak_scrapes} times at a new high of the client's requests in flight"


def run_queue_wait_s() -> float | None:
    """Seconds the calling thread has spent runnable but not running (Linux's schedstat); None elsewhere."""
    try:
        with open("/proc/thread-self/schedstat") as stat:
            return int(stat.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def _fresh_wait_s(url: str) -> float:
    """How long to wait before a sample of URL must show the server as it is now: deepserve's gateway's merged
    engines' metrics may be GATEWAY_ENGINES_MAX_AGE_S old; an engine's own /metrics is live."""
    return GATEWAY_FRESH_WAIT_S if httpx.URL(url).path.endswith(GATEWAY_ENGINES_PATH) else 0.0


def scraper_for(config: BenchConfig) -> ServerMetricsScraper | None:
    """The scraper CONFIG asks for (None with --no-server-metrics): --server-metrics-url, else the server's /metrics
    with deepserve's gateway's /metrics/engines as the fallback."""
    metrics = config.metrics
    if not metrics.server_metrics:
        return None
    root = config.target.root_url
    url = metrics.server_metrics_url or root + "/metrics"
    fallback = None if metrics.server_metrics_url else root + GATEWAY_ENGINES_PATH  # behind deepserve's gateway
    headers = config.target.request_headers()
    verify = not config.target.insecure
    return ServerMetricsScraper(url, metrics.server_metrics_interval_s, headers, fallback, verify)
