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
from deepserve.sweep.compare import Target, common_context, common_plan, parse_targets, target_config
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
from deepserve.sweep.run import SweepOptions, SweepOutcome, run_sweep
from deepserve.sweep.suites import DEFAULT_TIME_BUDGET_S, SUITES, SuitePlan, get_suite, plan_suite

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
        "--target",
        action="append",
        default=None,
        metavar="NAME=URL",
        help="a server to compare (repeat for each: engines or machines); every target runs the same points into "
        "RESULT_DIR/NAME and one report draws them side by side (e.g. --suite seed004 --target sglang=http://… "
        "--target vllm=http://… --target trtllm=http://…); a suite's --time-budget-s is per target",
    )
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
    if args.target:
        return _compare(args, base, lists, parse_targets(args.target), console)
    facts = server_facts(base)
    asked = _asked(args, base, lists) | ({"variants": variants} if variants else {})
    directory = Path(base.output.result_dir or Path.cwd() / "sweeps" / _default_dir_name(args, asked))
    spec = _spec(args, base, lists, facts, asked, directory, console, variants)
    console.print(f"Sweep '{spec.label}': {len(spec.points)} points → {directory}")
    outcome = run_sweep(directory, spec, base, _run_point, _options(args), progress=console.print)
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


def _options(args: argparse.Namespace) -> SweepOptions:
    return SweepOptions(
        stop_at_saturation=args.stop_at_saturation,
        patience=args.saturation_patience,
        time_budget_s=_runtime_budget_s(args),
        record=not args.no_record,
        db_path=args.db,
    )


def _compare(
    args: argparse.Namespace,
    base: BenchConfig,
    lists: dict[str, list[Any] | None],
    targets: list[Target],
    console: Console,
) -> int:
    """The same sweep against every target, each into its own directory, then one report over all of them."""
    if base.target.base_url:
        raise ConfigError("--target names every server to compare: drop --base-url")
    asked = _asked(args, base, lists) | {"targets": [target.name for target in targets]}
    directory = Path(base.output.result_dir or Path.cwd() / "sweeps" / f"compare-{_default_dir_name(args, asked)}")
    configs = {target.name: target_config(base, target, directory) for target in targets}
    facts = {name: server_facts(config) for name, config in configs.items()}
    label = f"{args.suite or 'sweep'}: {' vs '.join(configs)}"
    spec = _comparison_spec(args, configs, facts, lists, asked, directory, console)
    outcomes: list[SweepOutcome] = []
    for target in targets:
        target_spec = SweepSpec(target.name, spec.points, spec.sweep_axis, spec.signature, spec.suite)
        target_spec.metadata = {**spec.metadata, **facts[target.name], "comparison": label}
        console.print(
            f"Target '{target.name}' ({target.url}): {len(spec.points)} points → {target.directory(directory)}"
        )
        outcome = run_sweep(
            target.directory(directory), target_spec, configs[target.name], _run_point, _options(args), console.print
        )
        console.print(
            f"  {target.name}: {outcome.ran} ran, {outcome.kept} kept from before, {outcome.skipped} skipped, "
            f"{outcome.failed} failed"
        )
        outcomes.append(outcome)
    if not args.no_report:
        from deepserve.report.build import build_report, load_sets  # matplotlib: only when a report is drawn

        dirs = [target.directory(directory) for target in targets]
        report = build_report(load_sets(dirs), directory / "report", parse_slos(args.slo), f"deepserve sweep {label}")
        for answer in report.answer_texts():
            console.print(answer)
        console.print(f"Report: {report.html_path}")
    return 1 if any(outcome.failed for outcome in outcomes) else 0


def _comparison_spec(
    args: argparse.Namespace,
    configs: dict[str, BenchConfig],
    facts: dict[str, dict[str, Any]],
    lists: dict[str, list[Any] | None],
    asked: dict[str, Any],
    directory: Path,
    console: Console,
) -> SweepSpec:
    """The points every target runs: a grid as given, or the suite planned for the slowest target (each probed),
    or, when every target's directory already holds this comparison, the points stored there (a resume)."""
    if args.suite is None:
        return grid_spec({name: values for name, values in lists.items() if values}, "comparison", asked)
    suite = get_suite(args.suite)
    _check_suite_lists(lists)
    wanted = signature({"suite": suite.name, **asked})
    indexes = [read_index(directory / name) for name in configs]
    if all(index is not None and index.signature == wanted for index in indexes):
        console.print(f"Resuming the planned comparison in {directory} (no new speed probes)")
        first = indexes[0]
        assert first is not None
        return SweepSpec("comparison", stored_points(first), suite.sweep_axis, wanted, suite.name)
    budget_s = DEFAULT_TIME_BUDGET_S if args.time_budget_s is None else args.time_budget_s
    context = common_context([target_facts.get("max_model_len") for target_facts in facts.values()])
    given = {name: values[0] for name, values in lists.items() if values}
    plans: list[SuitePlan] = []
    for name, config in configs.items():
        probe = probe_speed(config, _run_point, facts[name].get("max_model_len")) if budget_s else None
        if probe is not None:
            console.print(
                f"Speed probe of '{name}': {probe.tpot_s * 1000:.1f} ms/token alone, peak "
                f"{probe.peak_output_tok_s:,.0f} output tok/s"
            )
        plans.append(plan_suite(suite, context, budget_s or None, probe, _fixed_fields(args) | given))
    plan = common_plan(plans)
    for note in plan.notes:
        console.print(f"  scaled (for the slowest target): {note}")
    spec = suite_spec(plan, "comparison", asked)
    spec.metadata["scale"]["time_budget_s"] = budget_s
    return spec


def _check_suite_lists(lists: dict[str, list[Any] | None]) -> None:
    several = [name for name, values in lists.items() if values and len(values) > 1]
    if several:
        flags = ", ".join("--" + name.replace("_", "-") for name in several)
        raise ConfigError(f"with --suite, {flags} take one value (it applies to every point); drop --suite for a grid")


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
    _check_suite_lists(lists)
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
