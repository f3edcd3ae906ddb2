"""`deepserve plan validate` and `plan fit`: the planner against the published figures, printed for people (rich
tables), for docs (Markdown) and for programs (JSON)."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

from deepserve.errors import ConfigError
from deepserve.plan.fit import fit_profiles, fit_to_json, row_cases, write_fits
from deepserve.plan.track_record import TRACK_RECORD_PATH, summarise
from deepserve.plan.validate import (
    GROUPS,
    MAX_RATIO,
    TARGET_MAPE_PCT,
    RowResult,
    Score,
    Validation,
    track_record_figures,
    validate,
)
from deepserve.simulate.forecast import SimulatorForecaster

SHAPE_APART = 1.25  # a forecast and a steady figure further apart than this are worth a look
SHAPE_GROUPS = ("throughput", "tpot", "e2el")

BREAKDOWNS: dict[str, Callable[[RowResult], str]] = {
    "source": lambda r: r.row.source_id or r.row.source,
    "layout kind": lambda r: r.row.layout_kind,
    "run": lambda r: r.row.scored_as,
}


def register(actions: argparse._SubParsersAction) -> None:
    check = actions.add_parser(
        "validate", help="predicted vs published figures: leave-one-source-out first, in-sample second"
    )
    check.add_argument("--json", action="store_true", help="print JSON instead of tables")
    check.add_argument("--in-sample", action="store_true", help="also print the in-sample table row by row")
    check.add_argument("--rows", action="store_true", help="print every held-out row, not only those beyond 2x")
    check.add_argument("--markdown", action="store_true", help="print the tables as Markdown (for docs)")
    check.add_argument(
        "--steady",
        action="store_true",
        help="predict every run by the steady formula (seconds, not minutes): finite runs are then not scored",
    )
    check.add_argument(
        "--calibration",
        type=Path,
        default=None,
        help="kernel figures measured by benchmarks/calibrate_gpu.py: used for the rows on that GPU class",
    )
    check.add_argument(
        "--write-track-record",
        action="store_true",
        help="store the held-out ratios by layout kind in the package (data/track_record.json), which plan prints",
    )
    # Accepted for scripts written against the earlier validation; leave-one-source-out is now always shown.
    check.add_argument("--cross-validate", action="store_true", help=argparse.SUPPRESS)
    check.set_defaults(handler=_validate)

    fit = actions.add_parser("fit", help="refit the engine profiles' overhead parameters to the published figures")
    fit.add_argument("--write", action="store_true", help="store them in the package (data/engine_profiles.json)")
    fit.set_defaults(handler=_fit)


def _validate(args: argparse.Namespace) -> int:
    calibration = args.calibration
    if args.write_track_record and (args.steady or calibration is not None):
        raise ConfigError(
            "--write-track-record stores what `plan validate` gives by default (finite runs forecast, the kernel "
            "table's figures): drop --steady and --calibration"
        )
    forecaster = None if args.steady else SimulatorForecaster()
    started = time.monotonic()
    result = validate(calibration=calibration, forecaster=forecaster)
    seconds = time.monotonic() - started
    if args.write_track_record:
        write_track_record(result)
    if args.json:
        data = result.to_json()
        data["seconds"] = round(seconds, 1)
        print(json.dumps(data, indent=2))
    elif args.markdown:
        print(validation_markdown(result))
    else:
        print_validation(Console(soft_wrap=True), result, in_sample_rows=args.in_sample, all_rows=args.rows)
        print(f"validated in {seconds:.0f} s", flush=True)
    return 0


def write_track_record(result: Validation, path: Path = TRACK_RECORD_PATH) -> None:
    data = {
        "generated_by": "deepserve plan validate --write-track-record",
        "generated_on": time.strftime("%Y-%m-%d", time.gmtime()),
        "about": "leave-one-source-out predicted / published ratios by layout kind and GPU vendor "
        "(plan/track_record.py); regenerate after changing the model, the profiles or the published rows",
        **summarise(track_record_figures(result.held_out)),
    }
    path.write_text(json.dumps(data, indent=1) + "\n")


def validation_markdown(result: Validation) -> str:
    """The leave-one-source-out breakdowns (by source, layout kind, run) and each held-out row with its in-sample
    prediction, then both summaries, as docs quote them."""
    held = result.held_out
    lines = [_score_summary("leave-one-source-out", held), "", _score_summary("in-sample", result.in_sample), ""]
    lines += [_shape_summary(held), ""]
    for name, key in BREAKDOWNS.items():
        lines += [*_breakdown_markdown(name, held.breakdown(key), held.groups()), ""]
    in_sample = {r.row.number: r for r in result.in_sample.results}
    lines += [
        "| row | source | setup | published | leave-one-source-out | ratio | steady formula | ratio | in-sample "
        "| ratio |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in held.results:
        own = in_sample.get(r.row.number)
        own_text = f"{own.predicted:,.4g} | {own.ratio:.2f}" if own else "- | -"
        lines.append(
            f"| {r.row.number} | {r.row.source_id} | {r.row.label().split(' ', 1)[1]} | {r.row.value:,.4g} "
            f"{r.row.unit} | {r.predicted:,.4g} | {r.ratio:.2f} | {_steady_text(r, ' | ', '- | -')} | {own_text} |"
        )
    return "\n".join(lines)


def _breakdown_markdown(name: str, table: dict[str, dict[str, tuple[float, int]]], groups: list[str]) -> list[str]:
    lines = [f"| {name} | " + " | ".join(f"{g} MAPE % (rows)" for g in groups) + " |"]
    lines.append("|---|" + "---:|" * len(groups))
    for key, by_group in table.items():
        cells = [f"{by_group[g][0]:.1f} ({by_group[g][1]})" if g in by_group else "" for g in groups]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return lines


def print_validation(
    console: Console, result: Validation, in_sample_rows: bool = False, all_rows: bool = False
) -> None:
    held = result.held_out
    console.print(_score_summary("leave-one-source-out", held), highlight=False)
    console.print(_score_summary("in-sample (fitted on every row)", result.in_sample), highlight=False)
    console.print(_shape_summary(held), highlight=False)
    for name, key in BREAKDOWNS.items():
        console.print(_breakdown_table(f"leave-one-source-out MAPE by {name}", held.breakdown(key), held.groups()))
    shown = held if all_rows else Score(tuple(held.off_by_more_than_2x))
    title = "leave-one-source-out, every row" if all_rows else f"held-out rows beyond {MAX_RATIO:g}x"
    console.print(_score_table(title, shown))
    if in_sample_rows:
        console.print(_score_table("in-sample", result.in_sample))
    for name, parameters in result.parameters.items():
        values = ", ".join(f"{key} {value:g}" for key, value in parameters.to_json().items())
        console.print(f"profile {name} fitted on every row: {values}", highlight=False)
    if result.not_held_out:
        console.print("[bold]rows not predicted held-out[/]")
        for skipped in result.not_held_out:
            console.print(f"  {skipped.row.label()}: {skipped.reason}", highlight=False)
    console.print("[bold]rows the model cannot predict[/]")
    for skipped in result.skipped:
        console.print(f"  {skipped.row.label()}: {skipped.reason}", highlight=False)
        if (t := skipped.transferred) is not None:
            console.print(
                f"    for information, not scored: with the carried-over figures the model predicts "
                f"{t.predicted:,.2f} {t.row.unit} (ratio {t.ratio:.2f})",
                highlight=False,
            )


def _breakdown_table(title: str, table: dict[str, dict[str, tuple[float, int]]], groups: list[str]) -> Table:
    view = Table(title=title)
    view.add_column("")
    for group in groups:
        view.add_column(f"{group} % (rows)", justify="right")
    for key, by_group in table.items():
        view.add_row(key, *(f"{by_group[g][0]:.1f} ({by_group[g][1]})" if g in by_group else "" for g in groups))
    return view


def _score_table(title: str, score: Score) -> Table:
    table = Table(title=title)
    for column in ("row", "setup", "predicted", "published", "ratio", "steady formula (ratio)"):
        table.add_column(column, justify="left" if column == "setup" else "right")
    for r in score.results:
        label = r.row.label().split(" ", 1)[1]
        table.add_row(
            str(r.row.number),
            label,
            f"{r.predicted:,.2f}",
            f"{r.row.value:,.2f} {r.row.unit}",
            f"{r.ratio:.2f}",
            _steady_text(r, " (", "", ")"),
        )
    return table


def _shape_summary(score: Score, apart: float = SHAPE_APART) -> str:
    """The held-out closed loops whose forecast run and steady formula part by more than APART on a rate or a
    mean latency past the first token: there the run's shape (waves of equal requests, the first burst, the tail)
    sets the figure. First-token times are left out: beyond one client only the forecast describes them."""
    if all(r.steady is None for r in score.results):
        return "closed loops: none was forecast as its run (--steady), so none has a second figure to compare"
    parted = [r for r in score.results if r.group in SHAPE_GROUPS and _parting(r) > apart]
    what = f"forecast closed loops whose throughput, TPOT or E2E latency part from the steady formula by > {apart:g}x"
    if not parted:
        return f"{what}: none"
    rows = ", ".join(f"row {r.row.number} ({r.ratio:.2f} forecast, {r.steady_ratio:.2f} steady)" for r in parted)
    return f"{what}: {rows}"


def _parting(r: RowResult) -> float:
    """How far apart R's forecast and steady figures are (1.0: equal, or no steady figure)."""
    if r.steady is None:
        return 1.0
    return max(r.steady / r.predicted, r.predicted / r.steady)


def _steady_text(r: RowResult, between: str, absent: str, after: str = "") -> str:
    """The steady formula's value and ratio beside a forecast closed loop: where they part, the run's shape (its
    waves, first burst or tail) sets the figure, not the engine's steady state."""
    if r.steady is None or r.steady_ratio is None:
        return absent
    return f"{r.steady:,.4g}{between}{r.steady_ratio:.2f}{after}"


def _score_summary(name: str, score: Score) -> str:
    if not score.results:
        return f"{name}: no predictable rows"
    headline = score.headline
    targets = "; ".join(
        f"{group} {headline.mape_pct(group):.1f}% (target <= {TARGET_MAPE_PCT[group]:g}%)"
        for group in headline.groups()
        if group in TARGET_MAPE_PCT
    )
    others = "; ".join(f"{group} {score.mape_pct(group):.1f}%" for group in GROUPS if group in score.groups())
    worst = score.worst
    assert worst is not None
    off = ", ".join(f"row {r.row.number}" for r in score.off_by_more_than_2x) or "none"
    verdict = "meets the targets" if score.meets_targets() else "MISSES the targets"
    return (
        f"{name} over {len(score.results)} rows: closed-loop NVIDIA rows ({len(headline.results)}): MAPE {targets}; "
        f"all rows: MAPE {others}; worst ratio {worst.ratio:.2f} (row {worst.row.number}); off by more than "
        f"{MAX_RATIO:g}x: {off}; {verdict}"
    )


def _fit(args: argparse.Namespace) -> int:
    cases = row_cases()[0]
    fits = fit_profiles(cases)
    if not fits:
        raise ConfigError("no engine profile has enough predictable published rows to fit")
    if args.write:
        print(f"wrote {write_fits(fits, cases)}")
    print(json.dumps({fit.profile: fit_to_json(fit, cases) for fit in fits}, indent=1))
    return 0
