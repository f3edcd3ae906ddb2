"""Entry point: one sub-command per module in COMMANDS, each with `register(subparsers)`."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from deepserve import __version__
from deepserve.errors import DeepserveError

# Module name under deepserve.cli → registers one or more sub-commands. Kept in the order `--help` shows them.
COMMANDS = (
    "serve", "model", "gateway", "keys", "usage", "bench", "sweep", "tune", "report", "runs", "plan", "simulate",
    "deploy", "cluster",
)  # fmt: skip


def build_parser(commands: Sequence[str] = COMMANDS) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deepserve",
        description="Plan, serve, gate and benchmark DeepSeek-V3-class models on your own hardware.",
    )
    parser.add_argument("--version", action="version", version=f"deepserve {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in commands:
        importlib.import_module(f"deepserve.cli.{name}").register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None, commands: Sequence[str] = COMMANDS) -> int:
    """Run a deepserve command line (ARGV, default sys.argv); COMMANDS: the modules to register (one alone starts
    faster: the others' imports are skipped)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if "--" in args_list:  # everything after `--` goes to the engine unchanged
        cut = args_list.index("--")
        args_list, passthrough = args_list[:cut], args_list[cut + 1 :]
    parser = build_parser(commands)
    args = parser.parse_args(args_list)
    args.passthrough = passthrough
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as typed, for commands that record their own line
    try:
        return int(args.handler(args) or 0)
    except DeepserveError as exc:
        print(f"deepserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
