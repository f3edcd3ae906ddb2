"""`deepserve plan search`: the layouts the engines support for a model on so many GPUs, ranked for an objective,
the frontier as a table and as a chart, and the chosen one's command lines."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

from deepserve.cli.flags import add_section_flags, section_overrides
from deepserve.config import load_section
from deepserve.hardware.catalog import get_accelerator
from deepserve.models.resolve import load_spec
from deepserve.plan.search import SearchConfig, SearchPoint, SearchResult, chosen_commands, search
from deepserve.plan.track_record import TrackRecord, record_for
from deepserve.report.search_chart import draw_search_frontier


def register(actions: argparse._SubParsersAction) -> None:
    parser = actions.add_parser(
        "search",
        help="every layout the engines support (TP, PP, DP attention, EP, formats, MTP, P/D pools), ranked",
        description=(
            "Enumerate the layouts vLLM and SGLang support for the model on the GPUs, predict each at concurrency "
            "1, 2, 4, ... and rank them for --objective within --slo-itl-ms/--slo-ttft-ms; print the frontier "
            "(tokens/s per GPU against tokens/s per user) and the chosen layout's `deepserve serve` and `deploy "
            "render` lines."
        ),
    )
    parser.add_argument("--config", type=Path, default=None, help="YAML or JSON config file (section `search`)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--markdown", action="store_true", help="print the frontier and the ranking as Markdown")
    parser.add_argument("--chart", type=Path, default=None, help="write the frontier chart to this PNG")
    add_section_flags(parser, SearchConfig)
    parser.set_defaults(handler=_search)


def _search(args: argparse.Namespace) -> int:
    config = load_section(SearchConfig, "search", args.config, section_overrides(args, SearchConfig))
    result = search(config)
    chart = draw_search_frontier(result, args.chart) if args.chart else None
    if args.json:
        data = result.to_json()
        commands = chosen_commands(result)
        data["commands"] = commands.__dict__ if commands else None
        data["chart"] = str(chart) if chart else None
        record = chosen_track_record(result)
        data["track_record"] = record.to_json() if record else None
        print(json.dumps(data, indent=2, default=list))
    elif args.markdown:
        print(search_markdown(result))
    else:
        print_search(Console(soft_wrap=True), result, chart)
    return 0


def print_search(console: Console, result: SearchResult, chart: Path | None) -> None:
    config = result.config
    console.print(
        f"[bold]{config.model}[/] on {config.gpus} x {config.gpu}, {config.input_len} in / {config.output_len} out: "
        f"{result.candidates} candidates ({len(result.refused)} do not fit or are refused) in {result.seconds:.1f} s; "
        f"objective {config.objective}, ITL <= {config.slo_itl_ms} ms, TTFT <= {config.slo_ttft_ms} ms",
        highlight=False,
    )
    past = _throughput_track_record(result)
    console.print(_points_table(f"best {config.top} for {config.objective}", result.ranked()[: config.top], past))
    console.print(_points_table("frontier: tokens/s per GPU against tokens/s per user", result.frontier, past))
    if chart:
        console.print(f"chart: {chart}", highlight=False)
    _print_chosen(console, result)


def _print_chosen(console: Console, result: SearchResult) -> None:
    commands = chosen_commands(result)
    if commands is None:
        console.print("[bold red]no candidate meets the objectives[/]: relax --slo-itl-ms / --slo-ttft-ms or add GPUs")
        return
    chosen = result.chosen
    assert chosen is not None
    console.print(
        f"[bold]chosen[/]: {chosen.candidate.describe()} at concurrency {chosen.concurrency}", highlight=False
    )
    record = chosen_track_record(result)
    if record is not None:
        console.print(f"  track record: {record.words()}", highlight=False)
    for line in commands.serve:
        console.print(f"  {line}", soft_wrap=True, highlight=False)
    if commands.deploy_render:
        console.print(f"  {commands.deploy_render}", soft_wrap=True, highlight=False)
    for note in commands.notes:
        console.print(f"  note: {note}", highlight=False)


def chosen_track_record(result: SearchResult) -> TrackRecord | None:
    """How far held-out forecasts of the chosen layout's kind on this GPU's vendor have been."""
    return None if result.chosen is None else _track_records(result)(result.chosen)


def _track_records(result: SearchResult) -> Callable[[SearchPoint], TrackRecord | None]:
    """A point's track record: its layout kind, for the searched model's generation on the searched GPU's vendor
    (both worked out once per search)."""
    vendor = get_accelerator(result.config.gpu).vendor
    attention = load_spec(result.config.model).attention_kind
    return lambda point: record_for(point.candidate.layout.kind, vendor, attention)


def _throughput_track_record(result: SearchResult) -> Callable[[SearchPoint], str]:
    """A point's column: the median held-out throughput ratio of its layout kind (its track record's)."""
    track_record = _track_records(result)

    def column(point: SearchPoint) -> str:
        record = track_record(point)
        metric = record.metric("throughput") if record else None
        if metric is None:
            return "-"
        return f"{'~' if record and record.instead_of else ''}{metric.median_ratio:.2f}x"

    return column


def _points_table(title: str, points: list[SearchPoint], past: Callable[[SearchPoint], str]) -> Table:
    table = Table(
        title=title,
        caption="past tput: the median predicted / published throughput of this layout kind for this model's "
        "generation on published runs the planner never saw (~: over a wider set, where those are too few; "
        "plan/track_record.py)",
    )
    columns = (
        "candidate", "kind", "clients", "tok/s/GPU", "tok/s/user", "TPOT ms", "TTFT ms", "$/1M", "SLO", "past tput"
    )  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column in ("candidate", "kind") else "right")
    for p in points:
        cost = "-" if p.usd_per_million is None else f"{p.usd_per_million:.3f}"
        table.add_row(
            p.candidate.describe(),
            p.candidate.kind,
            str(p.concurrency),
            f"{p.tok_s_per_gpu:,.0f}",
            f"{p.tok_s_per_user:,.1f}",
            f"{p.tpot_ms:,.1f}",
            f"{p.ttft_ms:,.0f}",
            cost,
            "yes" if p.meets_slo else "no",
            past(p),
        )
    return table


def search_markdown(result: SearchResult) -> str:
    config = result.config
    lines = [
        f"{config.model} on {config.gpus} x {config.gpu}, {config.input_len}/{config.output_len}, objective "
        f"{config.objective}, ITL <= {config.slo_itl_ms} ms: {result.candidates} candidates in {result.seconds:.1f} s",
        "",
        "| | candidate | clients | tok/s/GPU | tok/s/user | TPOT ms | TTFT ms | SLO | past tput |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    past = _throughput_track_record(result)
    for tag, points in (("best", result.ranked()[: config.top]), ("frontier", result.frontier)):
        for p in points:
            lines.append(
                f"| {tag} | {p.candidate.describe()} | {p.concurrency} | {p.tok_s_per_gpu:,.0f} | "
                f"{p.tok_s_per_user:.1f} | {p.tpot_ms:.1f} | {p.ttft_ms:,.0f} | {'yes' if p.meets_slo else 'no'} | "
                f"{past(p)} |"
            )
    return "\n".join(lines)
