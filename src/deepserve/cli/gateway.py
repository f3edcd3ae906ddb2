"""`deepserve gateway`: the OpenAI-compatible front door in front of one or more engine replicas."""

from __future__ import annotations

import argparse
from pathlib import Path

from deepserve.cli.flags import add_section_flags, section_overrides
from deepserve.config import load_section
from deepserve.gateway.config import GatewayConfig


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "gateway",
        help="run the OpenAI-compatible gateway (keys, limits, balancing, usage ledger, metrics)",
        description="Forward /v1/completions, /v1/chat/completions and /v1/models to the upstream engine replicas. "
        "Prints `GATEWAY READY <base URL>` on stdout once it accepts connections.",
    )
    parser.add_argument("--config", type=Path, default=None, help="YAML or JSON config file (section `gateway`)")
    add_section_flags(parser, GatewayConfig)
    parser.set_defaults(handler=_gateway)


def _gateway(args: argparse.Namespace) -> int:
    config = load_section(GatewayConfig, "gateway", args.config, section_overrides(args, GatewayConfig))
    from deepserve.gateway.server import run_gateway  # the server and its parsers: only when the gateway runs

    return run_gateway(config)
