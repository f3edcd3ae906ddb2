"""`deepserve usage`: requests and tokens per key and day, from the gateway's usage ledger."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from deepserve.gateway.ledger import default_ledger_path, summarise


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("usage", help="summarise the gateway's usage ledger per key and day")
    parser.add_argument("--days", type=int, default=None, help="only the last N days (default: everything)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--ledger", type=Path, default=None, help="the ledger file (default: the gateway's; see its --ledger-path)"
    )
    parser.set_defaults(handler=_usage)


def _usage(args: argparse.Namespace) -> int:
    since = time.time() - args.days * 86400 if args.days else None
    rows = summarise(args.ledger or default_ledger_path(), since)
    if args.json:
        print(json.dumps([asdict(row) for row in rows], indent=2))
        return 0
    table = Table(
        "day (UTC)", "key", "requests", "errors", "prompt tokens", "completion tokens", "of which reasoning",
        "mean latency",
    )  # fmt: skip
    for row in rows:
        table.add_row(
            row.day,
            row.key,
            f"{row.requests:,}",
            f"{row.errors:,}",
            f"{row.prompt_tokens:,}",
            f"{row.completion_tokens:,}",
            f"{row.reasoning_tokens:,}",
            f"{row.mean_latency_ms:,.0f} ms",
        )
    Console().print(table)
    return 0
