"""The seeds' charts, drawn from result sets. Each chart function returns None when the sets hold no points for it.

Colours tell result sets (and their lines) apart; line styles tell metrics apart (solid: output throughput, median;
dashed: total throughput, P99, time to last token). Every chart has a title, axis labels with units and a legend.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import matplotlib

matplotlib.use("Agg")  # files only: no display, no GUI toolkit
import matplotlib.pyplot as plt
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter

from deepserve.report import derived as dv
from deepserve.results import series as sr
from deepserve.results.points import ResultSet
from deepserve.results.slo import Slo, metric_words

COLORS: list[tuple[float, float, float]] = [tuple(rgb) for rgb in plt.get_cmap("tab10")(range(10))[:, :3]]
SOLID: Literal["-"] = "-"
DASHED: Literal["--"] = "--"
FIGSIZE = (9.0, 5.2)
DPI = 110


@dataclass(frozen=True)
class Chart:
    name: str  # file stem: NAME.png
    title: str
    path: Path
    caption: str


LineStyle = Literal["-", "--"]


@dataclass(frozen=True)
class Metric:
    key: str
    words: str
    style: LineStyle


ChartFunction = Callable[[list[ResultSet], Sequence[Slo], Path], Chart | None]

THROUGHPUT = (Metric("output_throughput", "output", SOLID), Metric("total_token_throughput", "total", DASHED))
ITL = (Metric("median_itl_ms", "median ITL", SOLID), Metric("p99_itl_ms", "P99 ITL", DASHED))
TTFT_TTLT = (
    Metric("median_ttft_ms", "median TTFT", SOLID),
    Metric("median_e2el_ms", "median time to last token", DASHED),
)


def throughput_vs_concurrency(sets: list[ResultSet], slos: Sequence[Slo], out_dir: Path) -> Chart | None:
    lines = sr.build_series(sets, sr.is_concurrency_point, sr.concurrency_x, "max_concurrency")
    return _line_chart(
        "throughput_vs_concurrency",
        "Throughput vs concurrency",
        lines,
        THROUGHPUT,
        "max concurrency (requests in flight)",
        "throughput (tokens/s)",
        out_dir,
        caption="Output and total (input + output) tokens per second at each concurrency limit.",
    )


def itl_vs_concurrency(sets: list[ResultSet], slos: Sequence[Slo], out_dir: Path) -> Chart | None:
    lines = sr.build_series(sets, sr.is_concurrency_point, sr.concurrency_x, "max_concurrency")
    return _line_chart(
        "itl_vs_concurrency",
        "Inter-token latency vs concurrency",
        lines,
        ITL,
        "max concurrency (requests in flight)",
        "inter-token latency (ms)",
        out_dir,
        slos=[slo for slo in slos if "_itl_" in slo.metric or "_tpot_" in slo.metric],
        caption="Median and P99 time between streamed tokens; the red line is the SLO.",
    )


def ttft_ttlt_vs_concurrency(sets: list[ResultSet], slos: Sequence[Slo], out_dir: Path) -> Chart | None:
    lines = sr.build_series(sets, sr.is_concurrency_point, sr.concurrency_x, "max_concurrency")
    return _line_chart(
        "ttft_ttlt_vs_concurrency",
        "Time to first and last token vs concurrency",
        lines,
        TTFT_TTLT,
        "max concurrency (requests in flight)",
        "latency (ms)",
        out_dir,
        slos=[slo for slo in slos if "_ttft_" in slo.metric],
        caption="Median TTFT and median end-to-end latency (time to last token) of each request.",
    )


def completed_vs_offered_rate(sets: list[ResultSet], slos: Sequence[Slo], out_dir: Path) -> Chart | None:
    lines = sr.build_series(sets, sr.is_rate_point, sr.rate_x, "request_rate")
    if not lines:
        return None
    fig, ax = _figure("Server completed rate vs client offered rate")
    top = max(max(line.xs) for line in lines)
    ax.plot([0, top], [0, top], color="grey", linestyle=":", linewidth=1, label="completed = offered")
    for color, line in zip(_colors(), lines, strict=False):
        ax.plot(line.xs, line.ys("request_throughput"), color=color, marker="o", label=line.label)
    _labels(ax, "offered request rate (requests/s)", "completed request rate (requests/s)")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    return _save(
        fig,
        ax,
        out_dir,
        "completed_vs_offered_rate",
        "Server completed rate vs client offered rate",
        "Requests per second the server completed against the rate the client offered (Poisson arrivals); where "
        "the line leaves the dotted diagonal, the server saturates.",
    )


def ttft_ttlt_vs_rate(sets: list[ResultSet], slos: Sequence[Slo], out_dir: Path) -> Chart | None:
    lines = sr.build_series(sets, sr.is_rate_point, sr.rate_x, "request_rate")
    return _line_chart(
        "ttft_ttlt_vs_rate",
        "Time to first and last token vs request rate",
        lines,
        TTFT_TTLT,
        "offered request rate (requests/s)",
        "latency (ms)",
        out_dir,
        slos=[slo for slo in slos if "_ttft_" in slo.metric],
        caption="Median TTFT and time to last token at each offered request rate.",
    )


def throughput_vs_completed_rate(sets: list[ResultSet], slos: Sequence[Slo], out_dir: Path) -> Chart | None:
    lines = sr.build_series(sets, sr.is_rate_point, sr.rate_x, "request_rate")
    if not lines:
        return None
    fig, ax = _figure("Token throughput vs server completed rate")
    handles = []
    for color, line in zip(_colors(), lines, strict=False):
        completed = line.ys("request_throughput")
        for metric in THROUGHPUT:
            ax.plot(completed, line.ys(metric.key), color=color, linestyle=metric.style, marker="o")
        handles.append(Line2D([], [], color=color, marker="o", label=line.label))
    handles += [Line2D([], [], color="black", linestyle=metric.style, label=metric.words) for metric in THROUGHPUT]
    _labels(ax, "completed request rate (requests/s)", "throughput (tokens/s)")
    ax.set_ylim(bottom=0)
    return _save(
        fig,
        ax,
        out_dir,
        "throughput_vs_completed_rate",
        "Token throughput vs server completed rate",
        "Output and total tokens per second against the requests per second the server completed.",
        handles,
    )


def throughput_vs_output_len(sets: list[ResultSet], slos: Sequence[Slo], out_dir: Path) -> Chart | None:
    lines = sr.build_series(sets, sr.is_closed_loop, sr.output_len_x, "output_len")
    return _line_chart(
        "throughput_vs_output_len",
        "Throughput vs output length",
        lines,
        THROUGHPUT,
        "output length (tokens per request)",
        "throughput (tokens/s)",
        out_dir,
        caption="Output and total tokens per second as each request generates more tokens.",
    )


def latency_vs_output_len(sets: list[ResultSet], slos: Sequence[Slo], out_dir: Path) -> Chart | None:
    lines = sr.build_series(sets, sr.is_closed_loop, sr.output_len_x, "output_len")
    return _line_chart(
        "latency_vs_output_len",
        "Time to first and last token vs output length",
        lines,
        TTFT_TTLT,
        "output length (tokens per request)",
        "latency (ms)",
        out_dir,
        caption="Median TTFT and time to last token as each request generates more tokens: TTFT should stay flat "
        "unless the longer outputs crowd the KV cache.",
    )


def throughput_vs_latency(sets: list[ResultSet], slos: Sequence[Slo], out_dir: Path) -> Chart | None:
    """Seed 004's headline view: what each concurrency level gives (throughput) against what it costs each request
    (end-to-end latency); up and to the left is better."""
    lines = sr.build_series(sets, sr.is_concurrency_point, _median_e2el_x, "max_concurrency")
    return _line_chart(
        "throughput_vs_latency",
        "Throughput vs end-to-end latency",
        lines,
        THROUGHPUT,
        "median end-to-end latency (ms), one point per concurrency level",
        "throughput (tokens/s)",
        out_dir,
        caption="Output and total tokens per second against the median time to last token, one point per "
        "concurrency level: a line further up and to the left serves more for the same wait.",
    )


def _median_e2el_x(point: sr.ResultPoint) -> float | None:
    return point.metric("median_e2el_ms")


def latency_vs_input_len(sets: list[ResultSet], slos: Sequence[Slo], out_dir: Path) -> Chart | None:
    lines = sr.build_series(sets, sr.is_closed_loop, sr.input_len_x, "input_len")
    return _line_chart(
        "latency_vs_input_len",
        "Time to first and last token vs input length",
        lines,
        TTFT_TTLT,
        "input length (tokens per request)",
        "latency (ms)",
        out_dir,
        caption="Median TTFT and time to last token for longer prompts (the prefill cost of long inputs).",
    )


def throughput_vs_batch_size(sets: list[ResultSet], slos: Sequence[Slo], out_dir: Path) -> Chart | None:
    lines = sr.build_series(sets, sr.is_offline_point, sr.batch_x, "num_prompts")
    return _line_chart(
        "throughput_vs_batch_size",
        "Offline throughput vs batch size",
        lines,
        THROUGHPUT,
        "batch size (requests submitted at once)",
        "throughput (tokens/s)",
        out_dir,
        caption="A whole batch submitted at once, no concurrency limit: the server's offline throughput.",
    )


def prefix_sharing(sets: list[ResultSet], slos: Sequence[Slo], out_dir: Path) -> Chart | None:
    """Bars: prefix sharing on against off, for each set that has both variants."""
    pairs = _prefix_pairs(sets)
    if not pairs:
        return None
    panels = (
        ("total_token_throughput", "total throughput (tokens/s)"),
        ("median_ttft_ms", "median TTFT (ms)"),
        ("median_tpot_ms", "median TPOT (ms)"),
        ("median_e2el_ms", "median end-to-end latency (ms)"),
    )
    fig, axes = plt.subplots(2, 2, figsize=(FIGSIZE[0], FIGSIZE[1] * 1.35), dpi=DPI)
    fig.suptitle("Prefix sharing on vs off", fontsize=13, fontweight="bold")
    width = 0.8 / len(pairs)
    for ax, (metric, words) in zip(axes.flat, panels, strict=True):
        for index, (label, off, on) in enumerate(pairs):
            values = [_or_nan(off.metric(metric)), _or_nan(on.metric(metric))]
            positions = [slot + (index - (len(pairs) - 1) / 2) * width for slot in (0, 1)]
            ax.bar(positions, values, width=width * 0.95, color=COLORS[index % len(COLORS)], label=label)
        ax.set_xticks([0, 1], [sr.PREFIX_NONE, sr.PREFIX_SHARED])
        ax.set_ylabel(words)
        ax.grid(axis="y", alpha=0.3)
        ax.yaxis.set_major_formatter(FuncFormatter(_thousands))
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "prefix_sharing.png"
    fig.savefig(path)
    plt.close(fig)
    return Chart(
        "prefix_sharing",
        "Prefix sharing on vs off",
        path,
        "The same input length with and without a shared prompt prefix, at the same concurrency.",
    )


def _prefix_pairs(sets: list[ResultSet]) -> list[tuple[str, sr.ResultPoint, sr.ResultPoint]]:
    pairs = []
    for result_set in sets:
        by_variant = {point.params.variant: point for point in result_set.points}
        if sr.PREFIX_NONE in by_variant and sr.PREFIX_SHARED in by_variant:
            pairs.append((result_set.label, by_variant[sr.PREFIX_NONE], by_variant[sr.PREFIX_SHARED]))
    return pairs


def pareto(sets: list[ResultSet], slos: Sequence[Slo], out_dir: Path) -> Chart | None:
    """Throughput per GPU against speed per user: the trade every deployment makes. Up and to the right is
    better; the frontier joins the points no other point of the line beats on both."""
    lines = sr.build_workload_series(sets, _per_user_x, dv.PER_GPU)
    return _frontier_chart(
        "pareto",
        "Throughput per GPU vs speed per user (Pareto frontier)",
        lines,
        dv.PER_GPU,
        "output tokens/s per GPU",
        out_dir,
        caption="Every point: output tokens/s per GPU against output tokens/s per user (1000 / median TPOT). The "
        "thick line joins the points that no other point of its line beats on both axes (the Pareto frontier); up "
        "and to the right is better.",
    )


def cost_per_million_tokens(sets: list[ResultSet], slos: Sequence[Slo], out_dir: Path) -> Chart | None:
    """What a million output tokens cost at each speed per user; down and to the right is better."""
    lines = sr.build_workload_series(sets, _per_user_x, dv.COST)
    return _frontier_chart(
        "cost_per_million_tokens",
        "Cost per million output tokens vs speed per user",
        lines,
        dv.COST,
        "USD per million output tokens",
        out_dir,
        caption="GPUs x price per GPU-hour / output tokens per hour, for every point, against output tokens/s per "
        "user. The thick line joins the cheapest points at each speed (the frontier); down and to the right is "
        "better.",
        lower_is_better=True,
    )


def decode_vs_hardware_limit(sets: list[ResultSet], slos: Sequence[Slo], out_dir: Path) -> Chart | None:
    lines = sr.build_workload_series(sets, lambda point: point.metric(dv.DECODE_BATCH), dv.LIMIT_TOK_S)
    if sum(len(line.points) for line in lines) < 2:
        return None
    return _line_chart(
        "decode_vs_hardware_limit",
        "Decode vs the memory-bandwidth limit",
        lines,
        (
            Metric(dv.DECODE_TOK_S, "achieved decode", SOLID),
            Metric(dv.LIMIT_TOK_S, "limit: bytes per step / memory bandwidth", DASHED),
        ),
        "decode batch (mean sequences decoding)",
        "decode tokens/s",
        out_dir,
        caption="Achieved decode tokens/s (decode batch x 1000 / mean TPOT) against the most the hardware allows at "
        "that batch: every step reads the weights (for MoE, the experts the batch touches) and each sequence's KV "
        "cache once, at the full memory bandwidth.",
    )


def _per_user_x(point: sr.ResultPoint) -> float | None:
    return point.metric(dv.PER_USER)


def _frontier_chart(
    name: str,
    title: str,
    lines: list[sr.Series],
    y_key: str,
    y_label: str,
    out_dir: Path,
    *,
    caption: str,
    lower_is_better: bool = False,
) -> Chart | None:
    """Every point of every line as a faint dot, and each line's frontier as a thick line in its colour."""
    if sum(len(line.points) for line in lines) < 2:
        return None
    fig, ax = _figure(title)
    handles: list[Line2D] = []
    for color, line in zip(_colors(), lines, strict=False):
        ys = line.ys(y_key)
        ax.scatter(line.xs, ys, color=color, alpha=0.35, s=26, linewidths=0)
        sign = -1.0 if lower_is_better else 1.0
        front = dv.pareto_frontier([(x, sign * y) for x, y in zip(line.xs, ys, strict=True)])
        ax.plot([line.xs[i] for i in front], [ys[i] for i in front], color=color, linewidth=2.2, marker="o")
        handles.append(Line2D([], [], color=color, linewidth=2.2, marker="o", label=line.label))
    handles.append(Line2D([], [], color="black", linewidth=2.2, marker="o", label="frontier"))
    handles.append(Line2D([], [], color="black", alpha=0.35, linestyle="", marker="o", label="other points"))
    _labels(ax, "output tokens/s per user (1000 / median TPOT)", y_label)
    _scale_axes(ax, lines, (Metric(y_key, "", SOLID),))
    return _save(fig, ax, out_dir, name, title, caption, handles)


# In the order the report shows them.
CHARTS: tuple[ChartFunction, ...] = (
    throughput_vs_concurrency,
    itl_vs_concurrency,
    ttft_ttlt_vs_concurrency,
    completed_vs_offered_rate,
    ttft_ttlt_vs_rate,
    throughput_vs_completed_rate,
    throughput_vs_latency,
    throughput_vs_output_len,
    latency_vs_output_len,
    latency_vs_input_len,
    throughput_vs_batch_size,
    prefix_sharing,
    pareto,
    cost_per_million_tokens,
    decode_vs_hardware_limit,
)


def draw_charts(sets: list[ResultSet], slos: Sequence[Slo], out_dir: Path) -> list[Chart]:
    """Every chart the sets have data for, as PNG files in OUT_DIR."""
    out_dir.mkdir(parents=True, exist_ok=True)
    charts = [chart(sets, slos, out_dir) for chart in CHARTS]
    return [chart for chart in charts if chart is not None]


def _line_chart(
    name: str,
    title: str,
    lines: list[sr.Series],
    metrics: Sequence[Metric],
    x_label: str,
    y_label: str,
    out_dir: Path,
    *,
    caption: str,
    slos: Sequence[Slo] = (),
) -> Chart | None:
    if not lines:
        return None
    fig, ax = _figure(title + _workload_words(lines))
    handles: list[Line2D] = []
    for color, line in zip(_colors(), lines, strict=False):
        for metric in metrics:
            ax.plot(line.xs, line.ys(metric.key), color=color, linestyle=metric.style, marker="o")
        handles.append(Line2D([], [], color=color, marker="o", label=line.label))
    # One legend entry per line colour and one per metric style, instead of one per (line, metric) pair.
    handles += [Line2D([], [], color="black", linestyle=metric.style, label=metric.words) for metric in metrics]
    for slo in slos:
        handles.append(ax.axhline(slo.max_ms, color="red", linewidth=1.4, linestyle="-.", label=f"SLO: {slo.words}"))
    _labels(ax, x_label, y_label)
    _scale_axes(ax, lines, metrics)
    return _save(fig, ax, out_dir, name, title, caption, handles)


def _workload_words(lines: list[sr.Series]) -> str:
    """ " (input 1024, output 256 tokens)": the lengths every point of the chart shares, so the title says what
    was measured."""
    points = [point for line in lines for point in line.points]
    words = []
    for name, values in (
        ("input", {point.params.input_len for point in points}),
        ("output", {point.params.output_len for point in points}),
    ):
        if len(values) == 1 and None not in values:
            words.append(f"{name} {values.pop()}")
    return f" ({', '.join(words)} tokens)" if words else ""


def _figure(title: str) -> tuple[Figure, Axes]:
    fig, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI)
    ax.set_title(title, fontsize=13, fontweight="bold")
    ax.grid(alpha=0.3)
    return fig, ax


def _labels(ax: Axes, x_label: str, y_label: str) -> None:
    ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    ax.yaxis.set_major_formatter(FuncFormatter(_thousands))
    ax.xaxis.set_major_formatter(FuncFormatter(_thousands))


def _scale_axes(ax: Axes, lines: list[sr.Series], metrics: Sequence[Metric]) -> None:
    """Logarithmic axes where values span more than two orders of magnitude (concurrency 1 to 1,024, TTFT 90 ms to
    58 s), so that the low end is not squashed into the corner."""
    xs = [x for line in lines for x in line.xs if x > 0]
    if xs and max(xs) / min(xs) >= 64:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(_thousands))
    else:
        ax.set_xlim(left=0)
    ys = [y for line in lines for metric in metrics for y in line.ys(metric.key) if y > 0 and not math.isnan(y)]
    if ys and max(ys) / min(ys) >= 200:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(_thousands))
    else:
        ax.set_ylim(bottom=0)


def _save(
    fig: Figure, ax: Axes, out_dir: Path, name: str, title: str, caption: str, handles: list[Line2D] | None = None
) -> Chart:
    entries: list[Artist] = list(handles) if handles is not None else ax.get_legend_handles_labels()[0]
    # Many entries: the legend goes beside the plot so it never hides data.
    if len(entries) > 5:
        ax.legend(handles=entries, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    else:
        ax.legend(handles=entries, fontsize=9, loc="best")
    fig.tight_layout()
    path = out_dir / f"{name}.png"
    fig.savefig(path)
    plt.close(fig)
    return Chart(name, title, path, caption)


def _colors() -> list[tuple[float, float, float]]:
    return [COLORS[index % len(COLORS)] for index in range(64)]


def _thousands(value: float, _position: object) -> str:
    if value >= 1000:
        return f"{value:,.0f}"
    return f"{value:g}"


def _or_nan(value: float | None) -> float:
    return math.nan if value is None else value


def describe_metric(key: str) -> str:
    return metric_words(key)
