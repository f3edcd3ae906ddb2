"""`deepserve simulate`: an OpenAI-compatible server that behaves like vLLM serving a model on GPUs you do not have."""

from __future__ import annotations

import argparse
from pathlib import Path

from deepserve.cli.flags import add_section_flags, section_overrides
from deepserve.config import load_section
from deepserve.engines.config import EngineConfig
from deepserve.errors import ConfigError
from deepserve.net import ensure_port_free
from deepserve.simulate.config import ENGINE_FIELDS_NOT_SIMULATED, SimulateConfig, parse_metric_overrides
from deepserve.simulate.run import serve_simulator
from deepserve.simulate.setup import resolve


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="a vLLM-like server on this machine, timed as the model would run on the GPUs you name",
        description=(
            "Serve the OpenAI API (completions, chat, /tokenize, /metrics with vLLM's names) from a simulated "
            "engine: vLLM's continuous-batching scheduler (max_num_seqs, token budget, chunked prefill, prefix "
            "caching, preemption) over the planner's step times for --model on --gpus x --gpu, in real time. "
            "Engine flags are those of `deepserve serve`; --fixed-* replace the step model for tests. Prints "
            "`READY <base URL> <model> <base URL>` on stdout once it listens. docs/SIMULATE.md explains it."
        ),
    )
    parser.add_argument(
        "--config", type=Path, default=None, help="YAML or JSON config file (sections engine and simulate)"
    )
    parser.add_argument("--dry-run", action="store_true", help="print what would be simulated and exit")
    parser.add_argument(
        "--metric",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="serve VALUE for the series NAME in /metrics (e.g. vllm:num_requests_waiting=12), for routing tests",
    )
    add_section_flags(parser, EngineConfig, skip=ENGINE_FIELDS_NOT_SIMULATED)
    add_section_flags(parser, SimulateConfig)
    parser.set_defaults(handler=_simulate)


def _simulate(args: argparse.Namespace) -> int:
    if args.passthrough:
        raise ConfigError(f"deepserve simulate passes nothing to an engine; remove `-- {' '.join(args.passthrough)}`")
    engine = load_section(EngineConfig, "engine", args.config, section_overrides(args, EngineConfig))
    sim = load_section(SimulateConfig, "simulate", args.config, section_overrides(args, SimulateConfig))
    overrides = parse_metric_overrides(args.metric)
    deployment = resolve(engine, sim)
    if args.dry_run:
        print(deployment.describe())
        return 0
    ensure_port_free(engine.host, engine.port)
    return serve_simulator(deployment, sim, engine.host, engine.port, overrides)
