"""`deepserve sweep`: `deepserve bench` over a grid or a named suite, resumable, with a report at the end."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from deepserve.bench.config import BenchConfig
from deepserve.bench.runner import run_benchmark
from deepserve.cli.bench import add_bench_flags, config_from_args
from deepserve.errors import ConfigError
from deepserve.results.slo import parse_slos
from deepserve.results.sweepdir import read_index
from deepserve.sweep.grid import (
    LIST_FIELDS,
    SweepSpec,
    grid_spec,
    parse_list,
    signature,
    suite_spec,
    template_variants,
)
from deepserve.sweep.probe import probe_speed, server_facts
from deepserve.sweep.resume import stored_points
from deepserve.sweep.run import SweepOptions, run_sweep
from deepserve.sweep.suites import DEFAULT_TIME_BUDGET_S, SUITES, get_suite, plan_suite

LIST_TYPES: dict[str, type] = {
    "max_concurrency": int,
    "request_rate": float,
    "random_input_len": int,
    "random_output_len": int,
}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "sweep",
        help="run the benchmark over a grid or a named suite (resumable), then write a report",
        description=(
            "Takes every `deepserve bench` flag; --max-concurrency, --request-rate, --random-input-len and "
            "--random-output-len may be comma-separated lists (every combination is run). --suite NAME runs one of "
            f"the seeds' experiments: {', '.join(SUITES)}. Each point's result goes to --result-dir/points/, with "
            "index.json; re-running the same command resumes. See docs/REPORTS.md."
        ),
        conflict_handler="resolve",  # the list flags below replace bench's single-value ones
    )
    add_bench_flags(parser)
    group = parser.add_argument_group("sweep")
    for name in LIST_FIELDS:
        flag = "--" + name.replace("_", "-")
        group.add_argument(flag, default=None, metavar="V[,V...]", help=f"one value or a comma-separated list ({name})")
    group.add_argument(
        "--chat-template-kwargs",
        action="append",
        default=None,
        metavar="JSON",
        help="chat template options (a JSON object); given several times, every point runs once with each, e.g. "
        "'{\"thinking\": true}' and '{\"thinking\": false}'",
    )
    group.add_argument("--suite", default=None, help=f"a named suite: {', '.join(SUITES)}")
    group.add_argument("--list-suites", action="store_true", help="list the suites and exit")
    group.add_argument(
        "--time-budget-s",
        type=float,
        default=None,
        help=f"scale a suite to finish within this many seconds (default for suites: {DEFAULT_TIME_BUDGET_S:.0f}; "
        "0: the seeds' sizes); for a grid, no new point starts after it",
    )
    group.add_argument(
        "--stop-at-saturation",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="end a concurrency/rate line once throughput stops rising or requests fail (default: on)",
    )
    group.add_argument("--saturation-patience", type=int, default=2, help="points without gain before stopping")
    group.add_argument("--db", type=Path, default=None, help="results store (default: $DEEPSERVE_RESULTS_DB or home)")
    group.add_argument("--no-record", action="store_true", help="do not record the points in the results store")
    group.add_argument("--slo", action="append", default=None, help="SLO for the report, e.g. p99_itl_ms=50")
    group.add_argument("--no-report", action="store_true", help="skip writing RESULT_DIR/report/")
    parser.set_defaults(handler=_sweep)


def _sweep(args: argparse.Namespace) -> int:
    console = Console(stderr=True, highlight=False, soft_wrap=True)
    if args.list_suites:
        _print_suites()
        return 0
    lists = {name: parse_list(name, getattr(args, name), LIST_TYPES[name]) for name in LIST_FIELDS}
    for name in LIST_FIELDS:
        setattr(args, name, None)  # the grid sets these per point; the base config must not
    options = args.chat_template_kwargs or []
    variants = template_variants(options) if len(options) > 1 else None
    args.chat_template_kwargs = options[0] if len(options) == 1 else None
    slos = parse_slos(args.slo)
    base = config_from_args(args, ["deepserve", *sys.argv[1:]])
    base = base.model_copy(update={"output": base.output.model_copy(update={"disable_tqdm": True})})
    facts = server_facts(base)
    asked = _asked(args, base, lists) | ({"variants": variants} if variants else {})
    directory = Path(base.output.result_dir or Path.cwd() / "sweeps" / _default_dir_name(args, asked))
    spec = _spec(args, base, lists, facts, asked, directory, console, variants)
    options = SweepOptions(
        stop_at_saturation=args.stop_at_saturation,
        patience=args.saturation_patience,
        time_budget_s=_runtime_budget_s(args),
        record=not args.no_record,
        db_path=args.db,
    )
    console.print(f"Sweep '{spec.label}': {len(spec.points)} points → {directory}")
    outcome = run_sweep(directory, spec, base, _run_point, options, progress=console.print)
    console.print(
        f"Sweep finished in {outcome.elapsed_s:.0f} s: {outcome.ran} ran, {outcome.kept} kept from before, "
        f"{outcome.skipped} skipped, {outcome.failed} failed. Index: {directory / 'index.json'}"
    )
    if not args.no_report:
        from deepserve.report.build import build_report, load_sets  # matplotlib: only when a report is drawn

        report = build_report(load_sets([directory]), directory / "report", slos, f"deepserve sweep: {spec.label}")
        for answer in report.answer_texts():
            console.print(answer)
        console.print(f"Report: {report.html_path}")
    return 1 if outcome.failed else 0


def _runtime_budget_s(args: argparse.Namespace) -> float | None:
    """No new point starts after this: the budget a suite was scaled to, or a grid's --time-budget-s."""
    if args.suite is not None and args.time_budget_s is None:
        return DEFAULT_TIME_BUDGET_S
    return args.time_budget_s or None


def _run_point(config: BenchConfig) -> dict[str, Any]:
    return run_benchmark(config, display=False).to_json()


def _asked(args: argparse.Namespace, base: BenchConfig, lists: dict[str, list[Any] | None]) -> dict[str, Any]:
    """What identifies this sweep: the suite or grid, the base flags and the budget (not the progress flags)."""
    return {
        "suite": args.suite,
        "lists": {name: values for name, values in lists.items() if values},
        "base": base.model_dump(exclude={"command_line", "output"}),
        "time_budget_s": args.time_budget_s,
    }


def _default_dir_name(args: argparse.Namespace, asked: dict[str, Any]) -> str:
    return f"{args.suite or 'grid'}-{signature(asked)[:8]}"


def _spec(
    args: argparse.Namespace,
    base: BenchConfig,
    lists: dict[str, list[Any] | None],
    facts: dict[str, Any],
    asked: dict[str, Any],
    directory: Path,
    console: Console,
    variants: dict[str, dict[str, Any]] | None = None,
) -> SweepSpec:
    label = base.output.label or f"{facts.get('model', 'model')} {args.suite or 'sweep'}"
    metadata = {**facts, "command": " ".join(base.command_line or []), **_user_metadata(base)}
    if args.suite is None:
        spec = grid_spec({name: values for name, values in lists.items() if values}, label, asked, variants)
        spec.metadata.update(metadata)
        return spec
    if variants:
        raise ConfigError(
            "with --suite, give --chat-template-kwargs once (it applies to every point); the reasoning suite runs "
            "thinking on and off, or drop --suite for a grid"
        )
    suite = get_suite(args.suite)
    several = [name for name, values in lists.items() if values and len(values) > 1]
    if several:
        flags = ", ".join("--" + name.replace("_", "-") for name in several)
        raise ConfigError(f"with --suite, {flags} take one value (it applies to every point); drop --suite for a grid")
    given = {name: values[0] for name, values in lists.items() if values}
    index = read_index(directory)
    if index is not None and index.signature == signature({"suite": suite.name, **asked}):
        console.print(f"Resuming the planned suite in {directory} (no new speed probe)")
        spec = SweepSpec(label, stored_points(index), suite.sweep_axis, signature({"suite": suite.name, **asked}))
        spec.suite = suite.name
        return spec
    budget_s = DEFAULT_TIME_BUDGET_S if args.time_budget_s is None else args.time_budget_s
    probe = probe_speed(base, _run_point, facts.get("max_model_len")) if budget_s else None
    if probe is not None:
        console.print(
            f"Speed probe: prefill of 1K tokens {probe.prefill_s(1024):.2f} s, of 16K {probe.prefill_s(16384):.1f} s; "
            f"{probe.batched_prefill_tok_s or 0:,.0f} prompt tok/s batched; {probe.tpot_s * 1000:.1f} ms/token alone, "
            f"peak {probe.peak_output_tok_s:,.0f} output tok/s"
        )
    plan = plan_suite(suite, facts.get("max_model_len"), budget_s or None, probe, _fixed_fields(args) | given)
    for note in plan.notes:
        console.print(f"  scaled: {note}")
    spec = suite_spec(plan, label, asked)
    spec.metadata.update(metadata)
    if probe is not None:
        spec.metadata["scale"]["probe"] = vars(probe)
    spec.metadata["scale"]["time_budget_s"] = budget_s
    return spec


def _fixed_fields(args: argparse.Namespace) -> dict[str, Any]:
    """Workload flags the user typed that a suite must not scale (e.g. --num-prompts)."""
    fixed = {}
    for name in ("num_prompts", "seed", "random_range_ratio", "ignore_eos"):
        if getattr(args, name, None) is not None:
            fixed[name] = getattr(args, name)
    return fixed


def _user_metadata(base: BenchConfig) -> dict[str, str]:
    return {key.strip(): value.strip() for key, _, value in (item.partition("=") for item in base.output.metadata)}


def _print_suites() -> None:
    for suite in SUITES.values():
        print(f"{suite.name:15} {suite.title}")
        print(f"{'':15} seed: {suite.seed}")
        print(f"{'':15} {suite.description}")
