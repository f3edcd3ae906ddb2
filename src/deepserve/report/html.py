"""One self-contained HTML file: every chart inlined as a data: URI, inline CSS, no script, no network fetch.
It opens the same from a laptop on a plane as from the machine that ran the benchmark."""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import Any

from deepserve.bench.repeats import interval_words
from deepserve.report import derived as dv
from deepserve.report.answers import EfficiencyAnswer, SaturationAnswer, SloAnswer
from deepserve.report.charts import Chart
from deepserve.report.deployment import SetDeployment
from deepserve.results.points import SUMMARY_COLUMNS, ResultPoint, ResultSet, format_rate
from deepserve.results.slo import Slo

Answers = tuple[Sequence[SloAnswer], Sequence[SaturationAnswer], Sequence[EfficiencyAnswer]]

# Derived columns of the points table: (key, heading, how many decimals; "%" for a fraction shown as a percentage).
# The cost and limit columns appear only when some point has them.
DERIVED_COLUMNS: tuple[tuple[str, str, str], ...] = (
    (dv.PER_GPU, "output tok/s per GPU", "1"),
    (dv.PER_USER, "tok/s per user", "1"),
    (dv.COST, "USD per M output tok", "2"),
    (dv.DECODE_BATCH, "decode batch", "1"),
    (dv.LIMIT_TOK_S, "limit decode tok/s", "0"),
    (dv.LIMIT_FRACTION, "% of limit", "%"),
)
_OPTIONAL_COLUMNS = {dv.COST, dv.DECODE_BATCH, dv.LIMIT_TOK_S, dv.LIMIT_FRACTION}

# Run facts shown per result set, in this order: (metadata key, heading).
METADATA_ROWS = (
    ("engine", "engine"),
    ("engine_version", "engine version"),
    ("model", "model"),
    ("model_id", "model"),
    ("hardware", "hardware"),
    ("flags", "engine flags"),
    ("command", "benchmark command"),
    ("base_url", "server"),
    ("suite", "suite"),
    ("scale", "suite scaling"),
    ("date", "date"),
    ("backend", "backend"),
    ("endpoint_type", "endpoint"),
)

_CSS = """
body { font-family: -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif; margin: 2em auto;
       max-width: 1200px; padding: 0 1em; color: #1a1a1a; }
h1 { margin-bottom: 0.2em; } .generated { color: #666; margin-top: 0; }
ul.answers li { margin: 0.4em 0; line-height: 1.4; }
figure { margin: 1.5em 0; } figure img { max-width: 100%; border: 1px solid #ddd; }
figcaption { color: #444; font-size: 0.9em; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0 1.5em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.5em; text-align: right; }
th { background: #f3f3f3; } td.text, th.text { text-align: left; }
table.meta td, table.meta th { text-align: left; }
div.wide { overflow-x: auto; }
"""


def render_html(
    sets: list[ResultSet],
    deployments: Sequence[SetDeployment],
    charts: Sequence[Chart],
    answers: Answers,
    slos: Sequence[Slo],
    title: str = "deepserve benchmark report",
    sections: Sequence[str] = (),
) -> str:
    """SECTIONS: more HTML blocks (e.g. a tune's predicted-against-measured table), shown before every point."""
    generated = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        # Belt and braces: even if someone edits the file, the browser may fetch nothing from the network.
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; img-src data:; '
        "style-src 'unsafe-inline'\">",
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{_e(title)}</h1>",
        f'<p class="generated">Generated {generated} from {len(sets)} result set(s): '
        f"{_e(', '.join(s.label for s in sets))}. SLOs: {_e(', '.join(slo.words for slo in slos) or 'none')}.</p>",
        _answers_html(answers),
        _charts_html(charts),
        *(section for section in sections if section),
        _points_html(sets),
        _metadata_html(sets, deployments),
        "</body></html>",
    ]
    return "\n".join(parts)


def _answers_html(answers: Answers) -> str:
    items = [answer.text for group in answers for answer in group]
    if not items:
        items = ["These results have no concurrency or request-rate sweep, so there is no SLO or saturation answer."]
    lines = "".join(f"<li>{_e(item)}</li>" for item in items)
    return f'<h2 id="answers">Answers</h2><ul class="answers">{lines}</ul>'


def _charts_html(charts: Sequence[Chart]) -> str:
    if not charts:
        return "<h2>Charts</h2><p>No chart: the results hold no sweep with two or more points along one axis.</p>"
    figures = []
    for chart in charts:
        data = base64.b64encode(chart.path.read_bytes()).decode("ascii")
        figures.append(
            f'<figure id="{_e(chart.name)}"><img src="data:image/png;base64,{data}" alt="{_e(chart.title)}">'
            f"<figcaption>{_e(chart.title)}. {_e(chart.caption)}</figcaption></figure>"
        )
    return "<h2>Charts</h2>" + "".join(figures)


def _points_html(sets: list[ResultSet]) -> str:
    headings = ["set", "point", "concurrency", "rate (req/s)", "input", "output", "prompts", "GPUs"]
    derived = _derived_columns(sets)
    head = "".join(f'<th class="text">{_e(h)}</th>' for h in headings[:2])
    head += "".join(f"<th>{_e(h)}</th>" for h in headings[2:]) + "".join(
        f"<th>{_e(h)}</th>" for _, h in SUMMARY_COLUMNS
    )
    head += "".join(f"<th>{_e(heading)}</th>" for _, heading, _ in derived)
    extra = _run_columns(sets)
    head += "".join(f"<th>{_e(heading)}</th>" for heading, _ in extra)
    rows = []
    for result_set in sets:
        for point in result_set.points:
            params = point.params
            cells = [
                f'<td class="text">{_e(result_set.label)}</td>',
                f'<td class="text">{_e(point.point_id)}</td>',
                _td(params.max_concurrency),
                f"<td>{format_rate(params.request_rate)}</td>",
                _td(params.input_len),
                _td(params.output_len),
                _td(params.num_prompts),
                _td(point.metric(dv.GPUS)),
            ]
            cells += [_measured_td(point, key) for key, _ in SUMMARY_COLUMNS]
            cells += [_derived_td(point, key, decimals) for key, _, decimals in derived]
            cells += [_td(value(point)) for _, value in extra]
            rows.append("<tr>" + "".join(cells) + "</tr>")
    table = f'<table class="points"><tr>{head}</tr>{"".join(rows)}</table>'
    return f'<h2 id="points">Every point</h2><div class="wide">{table}</div>'


def _measured_td(point: ResultPoint, key: str) -> str:
    """A measured value; with --num-runs, the mean ± the half-width of its 95% confidence interval."""
    value = point.metric(key)
    interval = (point.result.get("confidence_intervals") or {}).get(key) or {}
    spread = interval_words(interval | {"mean": value})
    if value is None or not spread:
        return _td(value)
    return f"<td>{value:,.2f}{html.escape(spread)}</td>"


def _spec_decode(key: str) -> Callable[[ResultPoint], float | None]:
    def value(point: ResultPoint) -> float | None:
        spec = (point.result.get("server_metrics") or {}).get("spec_decode") or {}
        number = spec.get(key)
        return float(number) if isinstance(number, int | float) else None

    return value


def _result_key(key: str) -> Callable[[ResultPoint], float | None]:
    return lambda point: point.metric(key)


# Columns a run adds when it has them: repeated runs, responses without gaps, reasoning, tool calls, speculative
# decoding (docs/METRICS.md). Each is shown when any point of the report has it.
RUN_COLUMNS: tuple[tuple[str, Callable[[ResultPoint], float | None]], ...] = (
    ("runs", _result_key("num_runs")),
    ("one-write requests", _result_key("one_write_requests")),
    ("mean reasoning tokens", _result_key("mean_reasoning_tokens")),
    ("median reasoning TTFT (ms)", _result_key("median_reasoning_ttft_ms")),
    ("median answer TTFT (ms)", _result_key("median_answer_ttft_ms")),
    ("median tool call start (ms)", _result_key("median_tool_call_start_ms")),
    ("median tool call end (ms)", _result_key("median_tool_call_end_ms")),
    ("spec. acceptance rate", _spec_decode("acceptance_rate")),
    ("spec. mean acceptance length", _spec_decode("mean_acceptance_length")),
)


def _run_columns(sets: list[ResultSet]) -> list[tuple[str, Callable[[ResultPoint], float | None]]]:
    points = [point for result_set in sets for point in result_set.points]
    return [(heading, value) for heading, value in RUN_COLUMNS if any(value(point) for point in points)]


def _derived_columns(sets: list[ResultSet]) -> list[tuple[str, str, str]]:
    points = [point for result_set in sets for point in result_set.points]
    return [
        column
        for column in DERIVED_COLUMNS
        if column[0] not in _OPTIONAL_COLUMNS or any(column[0] in point.derived for point in points)
    ]


def _derived_td(point: ResultPoint, key: str, decimals: str) -> str:
    value = point.derived.get(key)
    if value is None:
        return "<td>–</td>"
    if decimals == "%":
        return f"<td>{value:.1%}</td>"
    return f"<td>{value:,.{decimals}f}</td>"


def _metadata_html(sets: list[ResultSet], deployments: Sequence[SetDeployment]) -> str:
    blocks = ['<h2 id="metadata">Run metadata</h2>']
    for result_set, deployment in zip(sets, deployments, strict=True):
        rows = [f"<tr><th>source</th><td>{_e(result_set.source)}</td></tr>"]
        rows += [f"<tr><th>{_e(heading)}</th><td>{_e(words)}</td></tr>" for heading, words in deployment.facts()]
        shown: set[str] = set()
        for key, heading in METADATA_ROWS:
            value = result_set.metadata.get(key)
            if value in (None, "") or heading in shown:
                continue
            shown.add(heading)
            text = _scale_words(value) if key == "scale" and isinstance(value, dict) else _text(value)
            rows.append(f"<tr><th>{_e(heading)}</th><td>{_e(text)}</td></tr>")
        blocks.append(f'<h3>{_e(result_set.label)}</h3><table class="meta">{"".join(rows)}</table>')
    return "".join(blocks)


def _scale_words(scale: dict[str, Any]) -> str:
    """A suite's plan in words: "budget 900 s; lengths × 0.41; each point issues requests for 35 s; probe: …"."""
    parts = []
    if scale.get("time_budget_s"):
        parts.append(f"time budget {scale['time_budget_s']:g} s")
    parts.append(f"lengths × {scale.get('length_factor', 1):.3g}")
    if scale.get("point_duration_s"):
        parts.append(f"each concurrency/rate point issues requests for {scale['point_duration_s']:.0f} s")
    probe = scale.get("probe")
    if isinstance(probe, dict):
        parts.append(
            f"speed probe: prefill {probe.get('prefill_tok_s', 0):,.0f} tok/s, "
            f"{probe.get('tpot_s', 0) * 1000:.1f} ms/token alone, peak {probe.get('peak_output_tok_s', 0):,.0f} "
            "output tok/s"
        )
    return "; ".join(parts)


def _td(value: float | int | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "<td>–</td>"
    if isinstance(value, float) and not value.is_integer():
        return f"<td>{value:,.2f}</td>"
    return f"<td>{int(value):,}</td>"


def _text(value: object) -> str:
    if isinstance(value, list | tuple):
        return " ".join(str(item) for item in value)
    if isinstance(value, dict):
        return ", ".join(f"{key}={item}" for key, item in value.items())
    return str(value)


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)
