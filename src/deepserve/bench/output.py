"""What a run leaves behind: the console block in vLLM's layout, the result JSON under vLLM's key names (plus
ours), and per-request records as CSV or JSONL."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from deepserve import __version__
from deepserve.bench import metrics as m
from deepserve.bench.arrivals import describe_arrivals
from deepserve.bench.attribution import ESTIMATED, EXACT, ONE_PER_CHUNK
from deepserve.bench.config import BenchConfig
from deepserve.bench.repeats import combine_runs, interval_words
from deepserve.bench.server_metrics import ServerMetricsSummary, SpecDecodeSummary
from deepserve.bench.token_ids import TokenIdsDecision
from deepserve.bench.types import RequestRecord

WIDTH = 50
METRIC_TITLES = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
    "client_queue_time": ("Client Queue Time", "Client-side Queue Time"),
    "reasoning_ttft": ("Reasoning TTFT", "Time to First Reasoning Token"),
    "answer_ttft": ("Answer TTFT", "Time to First Answer Token"),
    "tool_call_start": ("Tool Call Start", "Time to the First Tool-Call Delta"),
    "tool_call_end": ("Tool Call End", "Time to the Complete Tool Call"),
}


@dataclass
class BenchResult:
    """One benchmark run: its config, the records, and the summary computed from them."""

    config: BenchConfig
    model_id: str
    records: list[RequestRecord]
    duration_s: float
    server: ServerMetricsSummary
    workload_definition: dict[str, Any] = field(default_factory=dict)
    tokenizer_source: str = ""
    output_tokens_source: str = "usage"  # "usage", "token_ids", "tokenizer", "chunks" or "mixed"
    token_attribution: str = EXACT  # how each chunk's tokens are known: exact, estimated, one-per-chunk or mixed
    token_attribution_requests: dict[str, int] = field(default_factory=dict)  # completed requests per attribution
    token_ids: TokenIdsDecision | None = None  # whether the requests asked for their chunks' token ids, and why
    turns_not_sent: int = 0  # multi-turn: turns after a failed turn of their conversation
    incomplete: bool = False  # interrupted (Ctrl-C): partial results
    warmups_done: int = 0
    started_at: datetime = field(default_factory=datetime.now)
    clock_origin_s: float = 0.0  # t = 0 of the record times, as time.perf_counter() (system-wide monotonic)
    profile: str | None = None  # --profile: what happened to the server's profiler
    runs: list[BenchResult] = field(default_factory=list)  # --num-runs: each run (this result holds their means)

    @classmethod
    def of_runs(cls, config: BenchConfig, runs: list[BenchResult]) -> BenchResult:
        """The result of --num-runs: every run's records (tagged with their run), the last run's facts, and (in
        `summary`) each metric's mean over the runs."""
        last = runs[-1]
        combined = dataclasses.replace(last, config=config, runs=runs, incomplete=any(run.incomplete for run in runs))
        combined.records = [record for run in runs for record in run.records]
        combined.duration_s = sum(run.duration_s for run in runs) / len(runs)
        combined.started_at = runs[0].started_at
        return combined

    def summary(self) -> dict[str, Any]:
        if self.runs:
            return self._repeated_summary()
        metrics_config = self.config.metrics
        return m.summarize(
            self.records,
            self.duration_s,
            metrics_config.selected_metrics,
            metrics_config.percentiles,
            metrics_config.slos_ms or None,
        )

    def _repeated_summary(self) -> dict[str, Any]:
        """The runs' summaries combined: measurements as means, with their confidence intervals and every run's
        own values (repeats.py)."""
        per_run = [run.summary() for run in self.runs]
        combined, intervals = combine_runs(per_run)
        combined["num_runs"] = len(self.runs)
        combined["confidence_intervals"] = {key: interval.to_json() for key, interval in intervals.items()}
        combined["runs"] = [{key: summary[key] for key in intervals} for summary in per_run]
        return combined

    def to_json(self) -> dict[str, Any]:
        """vLLM's result keys (date, backend, model_id, …, completed, mean_ttft_ms, p99_itl_ms, …) and ours."""
        config = self.config
        load = config.load
        data: dict[str, Any] = {
            "date": self.started_at.strftime("%Y%m%d-%H%M%S"),
            "endpoint_type": "openai-chat" if config.target.chat else "openai",
            "backend": "openai-chat" if config.target.chat else "openai",
            "label": config.output.label,
            "model_id": self.model_id,
            "tokenizer_id": self.tokenizer_source,
            "num_prompts": len(self.records),
            "request_rate": load.request_rate if math.isfinite(load.request_rate) else "inf",
            "burstiness": load.burstiness,
            "max_concurrency": load.max_concurrency,
        }
        if load.ramp_up_strategy is not None:  # vLLM's keys
            data["ramp_up_strategy"] = load.ramp_up_strategy
            data["ramp_up_start_rps"] = load.ramp_up_start_rps
            data["ramp_up_end_rps"] = load.ramp_up_end_rps
        data.update(_metadata(config.output.metadata))
        data.update(self.summary())
        data.update(
            {
                "deepserve_version": __version__,
                "command_line": config.command_line,
                "incomplete": self.incomplete,
                "base_url": config.target.root_url,
                "endpoint": config.target.endpoint,
                "num_warmups": self.warmups_done,
                "num_workers": load.num_workers,
                "duration_limit_s": load.duration_s,
                "ramp_up_s": load.ramp_up_s,
                "goodput_slos_ms": config.metrics.slos_ms or None,
                "workload": self.workload_definition,
                "tokenizer_source": self.tokenizer_source,
                "token_counting": self.workload_definition.get("token_counting"),
                "output_tokens_source": self.output_tokens_source,
                "token_attribution": self.token_attribution,
                "token_attribution_requests": self.token_attribution_requests,
                "return_token_ids": self.token_ids.to_json() if self.token_ids is not None else None,
                "clock_origin_perf_counter_s": self.clock_origin_s,
                "server_metrics": self.server.to_json(),
                "served_model_name": config.target.served_model_name,
                "lora_modules": config.target.lora_modules or None,
                "profile": self.profile,
            }
        )
        if any(record.turn is not None for record in self.records):
            data["num_conversations"] = len({record.conversation for record in self.records})
            data["turns_not_sent"] = self.turns_not_sent
        if config.output.save_detailed:
            data.update(detailed_lists(self.records))
        return data


def _metadata(items: list[str]) -> dict[str, str]:
    return {key.strip(): value.strip() for key, _, value in (item.partition("=") for item in items)}


def detailed_lists(records: list[RequestRecord]) -> dict[str, list[Any]]:
    """vLLM's --save-detailed lists (seconds, one entry per request, in index order)."""
    ordered = sorted(records, key=lambda record: record.index)
    return {
        "input_lens": [record.prompt_len for record in ordered],
        "output_lens": [record.output_len if record.success else 0 for record in ordered],
        "ttfts": [
            (record.first_token_s - record.sent_s) if record.first_token_s is not None else 0.0 for record in ordered
        ],
        "itls": [[sample / 1000.0 for sample in m.itl_ms(record)] for record in ordered],
        "latencies": [(record.end_s - record.sent_s) if record.end_s is not None else 0.0 for record in ordered],
        "start_times": [record.sent_s for record in ordered],
        "queue_times": [record.sent_s - record.scheduled_s for record in ordered],
        "errors": [record.error or "" for record in ordered],
    }


def console_block(result: BenchResult) -> str:
    """The result block as `vllm bench serve` prints it, with P25/P75 rows and our server-side lines."""
    data = result.to_json()
    config = result.config
    lines = [_title(" Serving Benchmark Result ", "=")]
    lines.append(_row("Successful requests:", data["completed"]))
    lines.append(_row("Failed requests:", data["failed"]))
    if config.load.max_concurrency is not None:
        lines.append(_row("Maximum request concurrency:", config.load.max_concurrency))
    if math.isfinite(config.load.request_rate):
        lines.append(_row("Request rate configured (RPS):", config.load.request_rate))
    load = config.load
    if load.rate_ramp() is not None or load.ramp_up_s:  # vLLM prints its ramp; a ramped rate is no single number
        lines.append(
            "Traffic: " + describe_arrivals(load.request_rate, load.burstiness, load.ramp_up_s, load.rate_ramp())
        )
    lines += _counting_rows(data.get("token_counting"))
    lines.append(_row("Benchmark duration (s):", data["duration"]))
    lines.append(_row("Total input tokens:", data["total_input_tokens"]))
    lines.append(_row("Total generated tokens:", data["total_output_tokens"]))
    lines.append(_row("Request throughput (req/s):", data["request_throughput"]))
    if data["goodput_req_s"] is not None:
        lines.append(_row("Request goodput (req/s):", data["goodput_req_s"]))
    lines.append(_row("Output token throughput (tok/s):", data["output_throughput"]))
    lines.append(_row("Peak output token throughput (tok/s):", data["max_output_tokens_per_s"]))
    lines.append(_row("Peak concurrent requests:", data["max_concurrent_requests"]))
    lines.append(_row("Total token throughput (tok/s):", data["total_token_throughput"]))
    for metric in config.metrics.selected_metrics:
        lines += _metric_rows(data, metric, config.metrics.percentiles)
        if metric == "itl":
            lines += _attribution_note(data)
    lines += _phase_rows(data, config.metrics.selected_metrics, config.metrics.percentiles)
    if "ttft_by_turn_ms" in data:
        lines += _turn_rows(data)
    lines += _server_rows(result.server, data.get("mean_tokens_per_chunk"))
    if data["errors_by_message"]:
        lines.append(_title("Failures by Error", "-"))
        lines += [f"{count:>6}  {message[: WIDTH * 2]}" for message, count in data["errors_by_message"].items()]
    lines += _runs_rows(data)
    if result.incomplete:
        lines.append("INCOMPLETE: interrupted; partial results (in-flight requests were dropped)")
    lines.append("=" * WIDTH)
    return "\n".join(lines)


COUNTING_WORDS = {
    "server": "exact, by the server's /tokenize and /detokenize",
    "server-tokenize-only": "exact, by the server's /tokenize (it has no /detokenize: prompts cut at words)",
    "local": "exact, by a local tokenizer",
    "approximate": "APPROXIMATE: one token per common English word (no /tokenize, no --tokenizer)",
}


def _counting_rows(counting: dict[str, Any] | None) -> list[str]:
    """How the prompts' lengths were counted: exact (which tokenizer) or the stated approximation (and its check)."""
    if not counting:
        return []
    rows = [f"Prompt lengths: {COUNTING_WORDS.get(counting['method'], counting['method'])}"]
    if counting["method"] == "approximate" and counting.get("check"):
        rows.append(f"  {counting['check']}")
    return rows


RUNS_SHOWN = (
    ("request_throughput", "Request throughput (req/s)"),
    ("output_throughput", "Output token throughput (tok/s)"),
    ("median_ttft_ms", "Median TTFT (ms)"),
    ("p99_ttft_ms", "P99 TTFT (ms)"),
    ("median_tpot_ms", "Median TPOT (ms)"),
    ("median_itl_ms", "Median ITL (ms)"),
    ("p99_itl_ms", "P99 ITL (ms)"),
    ("median_e2el_ms", "Median E2EL (ms)"),
)


def _runs_rows(data: dict[str, Any]) -> list[str]:
    """--num-runs: the main metrics' mean ± the half-width of their 95% confidence interval, and their range."""
    intervals = data.get("confidence_intervals")
    if not intervals:
        return []
    rows = [_title(f" {data['num_runs']} Runs: Mean ± 95% CI ", "-")]
    for key, label in RUNS_SHOWN:
        interval = intervals.get(key)
        if interval is None:
            continue
        spread = interval_words(interval)
        values = [run[key] for run in data["runs"] if key in run]
        rows.append(f"{label:<32} {interval['mean']:,.2f}{spread}  (runs {min(values):,.2f} to {max(values):,.2f})")
    rows.append("(every value above is the mean over the runs; the JSON has each run's and every interval)")
    return rows


def _metric_rows(data: dict[str, Any], metric: str, asked: tuple[float, ...]) -> list[str]:
    short, header = METRIC_TITLES[metric]
    rows = [_title(header, "-")]
    rows.append(_row(f"Mean {short} (ms):", _or_na(data[f"mean_{metric}_ms"])))
    rows.append(_row(f"Median {short} (ms):", _or_na(data[f"median_{metric}_ms"])))
    for point in sorted(set(m.STANDARD_PERCENTILES) | set(asked)):
        word = m.percentile_word(point)
        rows.append(_row(f"P{word} {short} (ms):", _or_na(data[f"p{word}_{metric}_ms"])))
    if metric in m.PER_TOKEN_METRICS and data.get("one_write_requests"):
        rows.append(
            f"{data['one_write_requests']} of {data['completed']} requests arrived in one write (every token at "
            f"once): no {short} for them"
        )
    return rows


def _or_na(value: Any) -> Any:
    return "n/a" if value is None else value


def _phase_rows(data: dict[str, Any], shown: tuple[str, ...], asked: tuple[float, ...]) -> list[str]:
    """Reasoning (tokens, time to the first reasoning and answer tokens) and tool calls, when the run had any."""
    rows: list[str] = []
    if "reasoning_requests" in data:
        rows.append(_title("Reasoning", "-"))
        rows.append(_row("Requests that reasoned:", data["reasoning_requests"]))
        rows.append(_row("Mean reasoning tokens:", data["mean_reasoning_tokens"]))
        rows.append(_row("Mean answer tokens:", data["mean_answer_tokens"]))
        rows += [
            row for metric in m.REASONING_METRICS if metric not in shown for row in _metric_rows(data, metric, asked)
        ]
    if "tool_call_requests" in data:
        rows.append(_title("Tool Calls", "-"))
        rows.append(_row("Requests with tool calls:", data["tool_call_requests"]))
        rows.append(_row("Tool calls:", data["total_tool_calls"]))
        rows += [
            row for metric in m.TOOL_CALL_METRICS if metric not in shown for row in _metric_rows(data, metric, asked)
        ]
    return rows


def _attribution_note(data: dict[str, Any]) -> list[str]:
    """Say when ITL rests on estimated token counts (chunks of several tokens without the server's token ids)."""
    counts: dict[str, int] = data.get("token_attribution_requests") or {}
    total = sum(counts.values())
    notes = []
    if counts.get(ESTIMATED):
        notes.append(
            f"ITL is estimated for {counts[ESTIMATED]} of {total} requests: their chunks listed no token ids, so "
            "each one's total was spread over its chunks by text length"
        )
    if counts.get(ONE_PER_CHUNK):
        notes.append(
            f"ITL assumes one token per chunk for {counts[ONE_PER_CHUNK]} of {total} requests (no usage, no tokenizer)"
        )
    return notes


def _turn_rows(data: dict[str, Any]) -> list[str]:
    """TTFT per turn of multi-turn conversations: later turns carry the history, which a prefix cache reuses."""
    rows = [_title("TTFT by Turn", "-")]
    rows.append(_row("Conversations:", data.get("num_conversations", "n/a")))
    if data.get("turns_not_sent"):
        rows.append(_row("Turns not sent (after a failed turn):", data["turns_not_sent"]))
    rows.append(f"{'turn':>4} {'requests':>8} {'input tok':>9} {'mean ms':>9} {'median ms':>9} {'P99 ms':>9}")
    inputs = data.get("mean_input_tokens_by_turn", {})
    for turn, stats in data["ttft_by_turn_ms"].items():
        rows.append(
            f"{turn:>4} {stats['count']:>8} {inputs.get(turn, 0):>9.0f} {stats['mean']:>9.2f} "
            f"{stats['median']:>9.2f} {stats.get('p99', 0.0):>9.2f}"
        )
    return rows


def _server_rows(server: ServerMetricsSummary, tokens_per_chunk: float | None = None) -> list[str]:
    rows = [_title("Server Metrics (Prometheus)", "-")]
    if server.url:
        rows.append(f"from {server.url}")
    if not server.available:
        return [*rows, f"not collected: {server.note}"]
    if server.note:
        rows.append(server.note)
    if server.sampling:
        during = "" if server.samples_in_run is None else f" ({server.samples_in_run} while requests ran)"
        rows.append(f"sampled {server.scrapes} times{during}: {server.sampling}")
    values = [
        ("Peak running requests:", server.peak_running),
        ("Peak waiting requests:", server.peak_waiting),
        (
            "Peak KV-cache usage (%):",
            None if server.peak_kv_cache_usage_perc is None else server.peak_kv_cache_usage_perc * 100,
        ),
        (
            "Prefix-cache hit rate (%):",
            None if server.prefix_cache_hit_rate is None else server.prefix_cache_hit_rate * 100,
        ),
        ("Preemptions:", server.preemptions),
    ]
    rows += [_row(label, "n/a" if value is None else value) for label, value in values]
    return rows + _spec_decode_rows(server.spec_decode, tokens_per_chunk)


def _spec_decode_rows(spec: SpecDecodeSummary | None, tokens_per_chunk: float | None) -> list[str]:
    """Speculative decoding as the engine counted it over the run (nothing when it reported none), and the tokens
    per chunk the client saw (per request, with the server's token ids)."""
    if spec is None:
        return []
    rows = [_title("Speculative Decoding (server)", "-"), f"from {spec.source}"]
    if spec.drafts is not None:
        rows += [_row("Drafts:", spec.drafts), _row("Draft tokens:", spec.draft_tokens)]
        rows.append(_row("Accepted tokens:", spec.accepted_tokens))
    rate = None if spec.acceptance_rate is None else spec.acceptance_rate * 100
    rows.append(_row("Acceptance rate (%):", "n/a" if rate is None else rate))
    length = spec.mean_acceptance_length
    rows.append(_row("Mean acceptance length (tokens):", "n/a" if length is None else length))
    for position, value in enumerate(spec.acceptance_by_position):
        rows.append(_row(f"Acceptance at draft position {position} (%):", value * 100))
    if tokens_per_chunk is not None:
        rows.append(_row("Client: mean tokens per chunk:", tokens_per_chunk))
    return rows


def _title(text: str, fill: str) -> str:
    return f"{text:{fill}^{WIDTH}}"


def _row(label: str, value: Any) -> str:
    if isinstance(value, float):
        return f"{label:<40} {value:<10.2f}"
    return f"{label:<40} {value!s:<10}"


def default_result_filename(result: BenchResult) -> str:
    """vLLM's naming: {label}-{rate}qps[-concurrency{N}]-{model}-{date}.json."""
    config = result.config
    label = config.output.label or ("openai-chat" if config.target.chat else "openai")
    load = config.load
    rate_text = "inf" if math.isinf(load.request_rate) else f"{load.request_rate:g}"
    if load.ramp_up_strategy is not None:  # vLLM: {label}-ramp-up-{strategy}-{start}qps-{end}qps…
        rate_text = f"ramp-up-{load.ramp_up_strategy}-{load.ramp_up_start_rps:g}qps-{load.ramp_up_end_rps:g}"
    concurrency = f"-concurrency{load.max_concurrency}" if load.max_concurrency is not None else ""
    model = result.model_id.rstrip("/").split("/")[-1]
    return f"{label}-{rate_text}qps{concurrency}-{model}-{result.started_at.strftime('%Y%m%d-%H%M%S')}.json"


def result_path(result: BenchResult) -> Path:
    output = result.config.output
    name = output.result_filename or default_result_filename(result)
    return Path(output.result_dir or ".") / name


def save_result(result: BenchResult, path: Path, append: bool = False) -> Path:
    """Write the result JSON to PATH (directories created); returns PATH. APPEND (vLLM's --append-result) adds it
    as one line after what the file holds, so a series of runs reads back as JSON lines."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not append:
        path.write_text(json.dumps(result.to_json(), indent=2, default=str) + "\n")
        return path
    with path.open("a+", encoding="utf-8") as handle:
        if handle.tell() != 0:
            handle.write("\n")
        handle.write(json.dumps(result.to_json(), default=str))
    return path


RECORD_COLUMNS = (
    "index",
    "request_id",
    "success",
    "error",
    "status_code",
    "prompt_len",
    "output_len",
    "output_len_source",
    "scheduled_s",
    "sent_s",
    "first_token_s",
    "end_s",
    "ttft_ms",
    "tpot_ms",
    "e2el_ms",
    "client_queue_time_ms",
    "num_chunks",
    "one_write",
    "tokens_per_chunk",
    "token_attribution",
    "conversation",
    "turn",
    "reasoning_tokens",
    "answer_tokens",
    "reasoning_ttft_ms",
    "answer_ttft_ms",
    "tool_calls",
    "tool_call_start_ms",
    "tool_call_end_ms",
    "run",
)


def record_row(record: RequestRecord) -> dict[str, Any]:
    return {
        "index": record.index,
        "request_id": record.request_id,
        "success": record.success,
        "error": record.error,
        "status_code": record.status_code,
        "prompt_len": record.prompt_len,
        "output_len": record.output_len,
        "output_len_source": record.output_len_source,
        "scheduled_s": record.scheduled_s,
        "sent_s": record.sent_s,
        "first_token_s": record.first_token_s,
        "end_s": record.end_s,
        "ttft_ms": m.ttft_ms(record),
        "tpot_ms": m.tpot_ms(record),
        "e2el_ms": m.e2el_ms(record),
        "client_queue_time_ms": m.client_queue_time_ms(record),
        "num_chunks": len(record.chunk_times_s),
        "one_write": m.arrived_in_one_write(record),
        "tokens_per_chunk": m.tokens_per_chunk(record),
        "token_attribution": record.token_attribution,
        "conversation": record.conversation,
        "turn": record.turn,
        "reasoning_tokens": record.reasoning_tokens,
        "answer_tokens": record.answer_tokens,
        "reasoning_ttft_ms": m.reasoning_ttft_ms(record),
        "answer_ttft_ms": m.answer_ttft_ms(record),
        "tool_calls": record.tool_calls,
        "tool_call_start_ms": m.tool_call_start_ms(record),
        "tool_call_end_ms": m.tool_call_end_ms(record),
        "run": record.run,
    }


def save_records(records: list[RequestRecord], path: Path, fmt: str) -> Path:
    """One row per request. CSV has the scalar columns; JSONL adds chunk_times_s and chunk_tokens."""
    path.parent.mkdir(parents=True, exist_ok=True)
    ordered = sorted(records, key=lambda record: record.index)
    with path.open("w", newline="") as handle:
        if fmt == "csv":
            writer = csv.DictWriter(handle, fieldnames=RECORD_COLUMNS)
            writer.writeheader()
            writer.writerows(record_row(record) for record in ordered)
        else:
            for record in ordered:
                row = record_row(record) | {"chunk_times_s": record.chunk_times_s, "chunk_tokens": record.chunk_tokens}
                handle.write(json.dumps(row) + "\n")
    return path
