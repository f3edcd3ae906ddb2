"""`deepserve report DIR [DIR ...] --out OUTDIR`: charts and one self-contained HTML file from result sets."""

from __future__ import annotations

import argparse
from pathlib import Path

from deepserve.errors import ConfigError
from deepserve.results.slo import DEFAULT_SLOS, parse_slos
from deepserve.results.store import ResultsStore


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "report",
        help="charts and an offline HTML report from sweep directories, result files or stored runs",
        description=(
            "Each DIR is one result set (one colour in every chart): a `deepserve sweep` directory, a directory of "
            "result JSON files (ours or `vllm bench serve --save-result`'s), or one result file. Several sets "
            "overlay with a legend. Writes OUTDIR/report.html (charts embedded, opens offline) and OUTDIR/*.png."
        ),
    )
    parser.add_argument("dirs", nargs="*", type=Path, metavar="DIR", help="result sets to draw")
    parser.add_argument("--out", type=Path, required=True, help="output directory (created if missing)")
    parser.add_argument(
        "--label",
        action="append",
        default=None,
        help="legend label for each DIR, in order (default: the sweep's label or the directory name)",
    )
    parser.add_argument(
        "--runs",
        default=None,
        metavar="ID[,ID...]",
        help="also draw stored runs (see `deepserve runs list`) as one more set",
    )
    parser.add_argument("--db", type=Path, default=None, help="results store for --runs")
    parser.add_argument(
        "--slo",
        action="append",
        default=None,
        metavar="METRIC=MS",
        help=f"an SLO the answers and charts use, repeatable (default: {' '.join(DEFAULT_SLOS)})",
    )
    parser.add_argument(
        "--gpus",
        type=int,
        default=None,
        metavar="N",
        help="GPUs that served each set whose run recorded none (for tokens/s per GPU and cost; default 1, noted)",
    )
    parser.add_argument(
        "--gpu-hour-usd",
        type=float,
        default=None,
        metavar="USD",
        help="price of one GPU-hour, for the cost per million output tokens of sets whose run recorded none",
    )
    parser.add_argument("--title", default=None, help="report title")
    parser.set_defaults(handler=_report)


def _report(args: argparse.Namespace) -> int:
    if not args.dirs and not args.runs:
        raise ConfigError("give at least one result directory (or --runs ID,...)")
    from deepserve.report.build import build_report, load_sets  # matplotlib: only when a report is drawn
    from deepserve.report.deployment import DeploymentOptions

    deployment = DeploymentOptions(gpus=args.gpus, gpu_hour_usd=args.gpu_hour_usd)
    sets = load_sets(args.dirs, args.label) if args.dirs else []
    if args.runs:
        run_ids = _run_ids(args.runs)
        sets.append(ResultsStore(args.db).as_result_set(run_ids))
    report = build_report(sets, args.out, parse_slos(args.slo), args.title, deployment)
    for answer in report.answer_texts():
        print(answer)
    print(
        f"wrote {report.html_path} and {len(report.charts)} chart(s): {', '.join(c.path.name for c in report.charts)}"
    )
    return 0


def _run_ids(text: str) -> list[int]:
    try:
        return [int(item) for item in text.split(",") if item.strip()]
    except ValueError as exc:
        raise ConfigError(f"--runs {text!r} must be run ids separated by commas, e.g. 3,4,7") from exc
