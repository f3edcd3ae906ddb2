"""`deepserve runs list | show | compare | rm`: the results store, where every bench run and sweep point lands."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from deepserve.errors import ConfigError
from deepserve.results.compare import gate, load_subject, parse_fail_on
from deepserve.results.points import SUMMARY_COLUMNS, format_rate
from deepserve.results.store import DB_ENV, ResultsStore, RunRecord

LIST_METRICS = ("completed", "failed", "output_throughput", "median_ttft_ms", "p99_itl_ms")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "runs",
        help="list, show, compare and remove recorded benchmark runs",
        description=f"The results store: SQLite at --db, else ${DB_ENV}, else DEEPSERVE_HOME/results/results.db.",
    )
    parser.add_argument("--db", type=Path, default=None, help="results store file")
    commands = parser.add_subparsers(dest="runs_command", metavar="ACTION", required=True)

    listing = commands.add_parser("list", help="recorded runs, newest first")
    listing.add_argument("--label", default=None, help="only runs with this label")
    listing.add_argument("--model", default=None, help="only runs of this model")
    listing.add_argument("--suite", default=None, help="only points of this suite")
    listing.add_argument("--limit", type=int, default=50, help="at most this many (default 50; 0: all)")
    listing.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    listing.set_defaults(handler=_list)

    show = commands.add_parser("show", help="one run's metrics and metadata")
    show.add_argument("run_id", type=int)
    show.add_argument("--json", action="store_true", help="print the full result JSON")
    show.set_defaults(handler=_show)

    compare = commands.add_parser(
        "compare",
        help="runs side by side, with the ratio to the first; with --fail-on, a regression gate for CI",
        description="Without --fail-on: stored runs side by side. With --fail-on: BASELINE CANDIDATE (each a run id, "
        "a result JSON file, or a sweep directory, compared point by point) and exit 1 when a metric regressed "
        "beyond its threshold and beyond the runs' 95% confidence intervals (docs/REPORTS.md).",
    )
    compare.add_argument("refs", nargs="+", metavar="RUN", help="run ids; with --fail-on: BASELINE CANDIDATE")
    compare.add_argument(
        "--fail-on",
        action="append",
        default=None,
        metavar="METRIC=±N%",
        help="fail when METRIC moves the worse way by more than N%%: p99_ttft_ms=+10%% (a latency rising), "
        "output_throughput=-5%% (a throughput falling); repeatable",
    )
    compare.set_defaults(handler=_compare)

    remove = commands.add_parser("rm", help="delete runs")
    remove.add_argument("run_ids", type=int, nargs="+")
    remove.set_defaults(handler=_rm)


def _store(args: argparse.Namespace) -> ResultsStore:
    return ResultsStore(args.db)


def _list(args: argparse.Namespace) -> int:
    store = _store(args)
    runs = store.list_runs(label=args.label, model=args.model, suite=args.suite, limit=args.limit or None)
    if args.json:
        for run in runs:
            print(json.dumps(_summary(run)))
        return 0
    table = Table("id", "date", "label", "model", "point", *(_heading(key) for key in LIST_METRICS))
    for run in runs:
        table.add_row(
            str(run.run_id),
            run.created_at[:19].replace("T", " "),
            run.label or "",
            run.model or "",
            run.params.describe(),
            *(_cell(run.metric(key)) for key in LIST_METRICS),
        )
    _console().print(table)
    if not runs:
        print(f"no runs recorded in {store.path}")
    return 0


def _show(args: argparse.Namespace) -> int:
    run = _store(args).get(args.run_id)
    if args.json:
        print(json.dumps(run.result, indent=2))
        return 0
    table = Table(title=f"run {run.run_id}", show_header=False)
    facts = [
        ("date", run.created_at),
        ("label", run.label or ""),
        ("model", run.model or ""),
        ("server", run.base_url or ""),
        ("point", run.params.describe()),
        ("suite", run.suite or ""),
        ("sweep", f"{run.sweep_dir} ({run.point_id})" if run.sweep_dir else ""),
        ("command", " ".join(run.result.get("command_line") or []) or str(run.metadata.get("command", ""))),
    ]
    for key, value in facts:
        if value:
            table.add_row(key, value)
    for key, heading in SUMMARY_COLUMNS:
        table.add_row(heading, _cell(run.metric(key)))
    _console().print(table)
    return 0


def _compare(args: argparse.Namespace) -> int:
    if args.fail_on:
        return _gate(args)
    if not all(ref.isdigit() for ref in args.refs):
        raise ConfigError("runs compare without --fail-on takes run ids (see `deepserve runs list`)")
    runs = _store(args).get_many([int(ref) for ref in args.refs])
    table = Table("metric", *(f"run {run.run_id}" for run in runs), title="compare (ratio to the first run)")
    table.add_row("label", *(run.label or "" for run in runs))
    table.add_row("point", *(run.params.describe() for run in runs))
    table.add_row("rate", *(format_rate(run.params.request_rate) for run in runs))
    first = runs[0]
    for key, heading in SUMMARY_COLUMNS:
        base = first.metric(key)
        cells = [_cell(base)]
        for run in runs[1:]:
            value = run.metric(key)
            ratio = f" ({value / base:.2f}×)" if value is not None and base else ""
            cells.append(_cell(value) + ratio)
        table.add_row(heading, *cells)
    _console().print(table)
    return 0


def _gate(args: argparse.Namespace) -> int:
    """BASELINE CANDIDATE --fail-on …: one line per metric (and per point of a sweep), then the verdict; exit 1
    on a regression beyond noise."""
    if len(args.refs) != 2:
        raise ConfigError(f"--fail-on compares two results, BASELINE CANDIDATE; got {len(args.refs)}")
    thresholds = [parse_fail_on(text) for text in args.fail_on]
    baseline, candidate = (load_subject(ref, _store(args)) for ref in args.refs)
    verdicts = gate(baseline, candidate, thresholds)
    for verdict in verdicts:
        print(f"{verdict.where + ': ' if verdict.where else ''}{verdict.why}")
    failed = [verdict for verdict in verdicts if verdict.regressed]
    if failed:
        print(f"FAIL: {len(failed)} of {len(verdicts)} checks regressed ({baseline.label} → {candidate.label})")
        return 1
    print(f"PASS: {len(verdicts)} checks, no regression beyond the thresholds and the noise")
    return 0


def _rm(args: argparse.Namespace) -> int:
    store = _store(args)
    removed = store.remove(args.run_ids)
    print(f"removed {removed} run(s) from {store.path}")
    return 0


def _summary(run: RunRecord) -> dict[str, object]:
    return {
        "id": run.run_id,
        "created_at": run.created_at,
        "label": run.label,
        "model": run.model,
        "suite": run.suite,
        **run.params.as_dict(),
        **{key: run.metric(key) for key, _ in SUMMARY_COLUMNS},
    }


def _heading(key: str) -> str:
    return dict(SUMMARY_COLUMNS).get(key, key)


def _cell(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:,.0f}" if value >= 100 or value.is_integer() else f"{value:,.2f}"


def _console() -> Console:
    """Tables keep their columns when piped (rich would otherwise squeeze them into 80 characters)."""
    return Console() if sys.stdout.isatty() else Console(width=200)
