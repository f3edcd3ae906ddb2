"""`deepserve tune`: start the engine at each point of a grid of its flags, benchmark it, keep the best under the
SLOs (DIR/best.yaml for `deepserve serve --config`). See docs/TUNE.md."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from deepserve.cli.bench import add_bench_flags, config_from_args
from deepserve.config import load_section
from deepserve.engines.config import EngineConfig
from deepserve.errors import ConfigError
from deepserve.plan.speculative import parse_acceptance
from deepserve.results.slo import DEFAULT_SLOS, parse_slos
from deepserve.serve.run import stop_on_sigterm
from deepserve.serve.service_plan import check_can_run
from deepserve.tune.engine import EnginePointRunner, service_plan
from deepserve.tune.grid import engine_fields, parse_axis, parse_setting
from deepserve.tune.run import TuneOptions, TuneOutcome, extra, run_tune
from deepserve.tune.search import SearchOptions
from deepserve.tune.select import JUDGED_AT_LOAD
from deepserve.tune.spec import TuneRequest, TuneSpec, build_spec

# Bench flags that name the server: the tune starts its own engine per point, so they have no meaning here.
TARGET_FLAGS = {"base_url": "--base-url", "host": "--host", "port": "--port", "model": "--model"}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "tune",
        help="the engine flags that serve the most under your SLOs: start, benchmark, stop the engine per point",
        description=(
            "For every point of a grid of engine-config fields (--grid FIELD=V1,V2, repeatable), start the engine "
            "with those flags (as `deepserve serve --no-gateway` would, on a free loopback port), run the benchmark "
            "(every `deepserve bench` workload and load flag), stop it, and save the point; then pick the highest "
            "goodput among the points whose SLOs hold and write OUT/best.yaml. The planner predicts each point "
            "first: points that cannot fit or miss an SLO by far are skipped, the rest run most promising first. "
            "Re-running the same command resumes. Flags after `--` go to every engine. See docs/TUNE.md."
        ),
        conflict_handler="resolve",  # --config below replaces bench's, with the engine section added
    )
    add_bench_flags(parser)
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help="YAML/JSON file: the engine section (the base of every point) and bench_* sections",
    )
    group = parser.add_argument_group("tune")
    group.add_argument(
        "--grid",
        action="append",
        default=None,
        metavar="FIELD=V1,V2",
        help=f"engine-config values to try, repeatable (every combination runs); 'default' leaves an optional "
        f"field to the engine. Fields: {', '.join(engine_fields())}",
    )
    group.add_argument(
        "--set", action="append", default=None, metavar="FIELD=VALUE", help="an engine-config field every point shares"
    )
    group.add_argument(
        "--slo",
        action="append",
        default=None,
        metavar="METRIC=MS",
        help=f"a latency SLO, repeatable: STAT_METRIC_ms with STAT mean, median or pNN and METRIC ttft, tpot, itl or "
        f"e2el (default: {' '.join(DEFAULT_SLOS)})",
    )
    group.add_argument("--out", type=Path, required=True, help="the tune's directory (created; re-use it to resume)")
    group.add_argument(
        "--prune-margin",
        type=float,
        default=2.0,
        help="skip a point the planner predicts beyond this many times an SLO's limit (0: never skip for SLOs)",
    )
    group.add_argument(
        "--spec-acceptance",
        default=None,
        metavar="RATES",
        help="for points with speculative decoding: the acceptance the planner assumes, per draft position "
        "(0.8,0.6,0.4) or one rate for each draft given the ones before (default: published MTP/DSpark figures)",
    )
    group.add_argument("--no-planner", action="store_true", help="no predictions: run every point, in grid order")
    group.add_argument(
        "--planner-gpu", default=None, help="the catalog entry the planner models this machine with (default: found)"
    )
    group.add_argument("--max-points", type=int, default=None, help="measure at most this many points in OUT")
    group.add_argument("--budget-s", type=float, default=None, help="start no new point after this many seconds")
    search = group.add_mutually_exclusive_group()
    search.add_argument(
        "--find-max-rate", action="store_true", help="per point, bisect for the highest request rate meeting the SLOs"
    )
    search.add_argument(
        "--find-max-concurrency",
        action="store_true",
        help="per point, search for the highest concurrency meeting the SLOs (needs --max-concurrency)",
    )
    group.add_argument("--search-steps", type=int, default=5, help="benchmark runs the search may add per point")
    group.add_argument(
        "--tie-margin", type=float, default=0.02, help="goodputs within this fraction of the best count as tied"
    )
    group.add_argument(
        "--engine-python",
        default=sys.executable,
        help="the Python interpreter that runs the engine, e.g. another virtualenv's (default: this one)",
    )
    group.add_argument("--retry-failed", action="store_true", help="run points whose engine failed before again")
    group.add_argument("--dry-run", action="store_true", help="print the plan (order, predictions, commands), exit")
    group.add_argument("--db", type=Path, default=None, help="results store (default: $DEEPSERVE_RESULTS_DB or home)")
    group.add_argument("--no-record", action="store_true", help="do not record the points in the results store")
    group.add_argument("--no-report", action="store_true", help="skip writing OUT/report/")
    parser.set_defaults(handler=_tune)


def _tune(args: argparse.Namespace) -> int:
    console = Console(stderr=True, highlight=False, soft_wrap=True)
    request = _request(args)
    spec = build_spec(request)
    _print_plan(console, spec, request, commands=args.dry_run)
    if args.dry_run:
        return 0
    runnable = [planned for planned in spec.points if planned.skip_reason is None]
    if runnable:
        check_can_run(service_plan(runnable[0].point.config, request.python))  # the engine is installed
    options = TuneOptions(
        slos=request.slos,
        max_points=args.max_points,
        budget_s=args.budget_s,
        tie_margin=args.tie_margin,
        retry_failed=args.retry_failed,
        record=not args.no_record,
        db_path=args.db,
    )
    runner = EnginePointRunner(request.slos, args.out / "logs", request.search, request.python, console.print)
    with stop_on_sigterm():
        outcome = run_tune(args.out, spec, request.bench, runner, options, console.print)
    _print_outcome(console, outcome)
    if not args.no_report and outcome.scored:
        from deepserve.report.build import build_report, load_sets  # matplotlib: only when a report is drawn

        report = build_report(load_sets([args.out]), args.out / "report", request.slos, f"deepserve {spec.label}")
        console.print(f"Report: {report.html_path}")
    if outcome.interrupted:
        return 130
    return 0 if outcome.best is not None else 1


def _request(args: argparse.Namespace) -> TuneRequest:
    given = [flag for name, flag in TARGET_FLAGS.items() if getattr(args, name, None) is not None]
    if given:
        raise ConfigError(
            f"{', '.join(given)}: the tune starts the engine itself for every point; name the model with "
            "--set model=NAME (or the engine section of --config), and leave the server flags out"
        )
    if not args.grid:
        raise ConfigError("give at least one --grid FIELD=V1,V2 (e.g. --grid max_num_seqs=64,128,256)")
    slos = tuple(parse_slos(args.slo))
    bench = config_from_args(args, ["deepserve", *sys.argv[1:]])
    axes = tuple(parse_axis(text) for text in args.grid)
    return TuneRequest(
        base=_base_engine(args, {axis.field for axis in axes}),
        axes=axes,
        bench=bench,
        slos=slos,
        search=_search(args, bench.load.max_concurrency),
        use_planner=not args.no_planner,
        planner_gpu=args.planner_gpu,
        prune_margin=args.prune_margin or None,
        label=bench.output.label,
        python=args.engine_python,
        spec_acceptance=parse_acceptance(args.spec_acceptance),
    )


def _base_engine(args: argparse.Namespace, grid_fields: set[str]) -> EngineConfig:
    settings: dict[str, Any] = dict(parse_setting(text) for text in args.set or [])
    both = sorted(grid_fields & settings.keys())
    if both:
        raise ConfigError(f"{both[0]} is in both --set and --grid; a field is either fixed or tried")
    if args.passthrough:
        settings["extra_args"] = list(settings.get("extra_args", [])) + args.passthrough
    return load_section(EngineConfig, "engine", args.config, settings)


def _search(args: argparse.Namespace, max_concurrency: int | None) -> SearchOptions | None:
    if args.search_steps < 1:
        raise ConfigError("--search-steps must be at least 1")
    if args.find_max_rate:
        return SearchOptions("request_rate", steps=args.search_steps)
    if args.find_max_concurrency:
        if max_concurrency is None:
            raise ConfigError("--find-max-concurrency starts from --max-concurrency N: give it")
        return SearchOptions("max_concurrency", steps=args.search_steps)
    return None


def _print_plan(console: Console, spec: TuneSpec, request: TuneRequest, commands: bool) -> None:
    slos = ", ".join(slo.words for slo in request.slos)
    console.print(f"Tune '{spec.label}': {len(spec.points)} points, SLOs {slos}")
    planner = spec.metadata.get("planner") or {}
    if planner.get("note"):
        console.print(f"  no predictions: {planner['note']}")
    for number, planned in enumerate(spec.points, start=1):
        forecast, words = planned.forecast, ""
        if forecast.predicted:
            verdict = "meets" if forecast.meets(request.slos) else "misses"
            words = (
                f"; predicted {forecast.output_tok_s or 0:,.0f} output tok/s, TPOT {forecast.tpot_ms or 0:,.1f} ms, "
                f"TTFT {forecast.ttft_ms or 0:,.0f} ms ({verdict} the SLOs)"
            )
        plan = f"skip, {planned.skip_reason}" if planned.skip_reason else "run"
        console.print(f"  {number:>2}. {planned.point.describe()}: {plan}{words}")
        if commands and planned.command:
            console.print(f"      {planned.command}")


def _print_outcome(console: Console, outcome: TuneOutcome) -> None:
    counts = outcome.counts
    console.print(
        f"Tune finished in {outcome.elapsed_s:.0f} s: {counts['ran']} ran, {counts['kept']} kept from before, "
        f"{counts['skipped']} skipped, {counts['failed']} failed. Index: {outcome.directory / 'index.json'}"
    )
    scored = {item.point_id: item for item in outcome.scored}
    for entry in outcome.index.points:
        item = scored.get(entry.point_id)
        predicted = (extra(entry, "predicted") or {}).get("output_tok_s")
        forecast = "" if predicted is None else f" (predicted {predicted:,.0f})"
        if item is None:
            measured = f"{entry.status}" + (f": {entry.note}" if entry.status != "pending" else "")
        else:
            verdict = "SLOs hold" if item.holds else "SLOs missed"
            measured = (
                f"{item.output_tok_s:,.0f} output tok/s{forecast}, goodput {item.goodput_output_tok_s:,.0f} tok/s, "
                f"{verdict}" + ("" if item.judged_at == JUDGED_AT_LOAD else f" at {item.judged_at}")
            )
        console.print(f"  {entry.params.get('variant') or entry.point_id}: {measured}")
    if outcome.best is None:
        console.print("No measured point met every SLO: no best.yaml written. Loosen an SLO or try other values.")
        return
    console.print(
        f"[bold green]Best:[/] {outcome.best.description}: "
        f"goodput {outcome.best.goodput_output_tok_s:,.0f} output tok/s "
        f"at {outcome.best.judged_at}. Serve it: deepserve serve --config {outcome.best_path}"
    )
