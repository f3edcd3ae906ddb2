"""`deepserve bench`: a serving benchmark that accepts `vllm bench serve` command lines and prints its result block."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, cast

from pydantic import BaseModel, ValidationError

from deepserve.bench.config import BENCH_SECTIONS, CHAT_COMPLETIONS, COMPLETIONS, BenchConfig, TargetConfig
from deepserve.bench.output import console_block, result_path, save_records, save_result
from deepserve.bench.runner import run_benchmark
from deepserve.bench.vllm_compat import REFUSED_VLLM_FLAGS, refused_flag
from deepserve.bench.workloads import WorkloadConfig
from deepserve.cli.flags import add_section_flags, section_overrides
from deepserve.config import load_section
from deepserve.errors import ConfigError
from deepserve.results.store import record_run

# Flags made by hand, not derived: those that take several values at once in vLLM (`--goodput ttft:300 tpot:50`),
# and --no-stream (argparse's BooleanOptionalAction would read a flag named --no-… as "false").
HAND_MADE_FLAGS = {
    "target": ("header", "lora_modules"),
    "metrics": ("goodput",),
    "output": ("metadata",),
    "workload": ("no_stream",),
}
SECTIONS: dict[str, type[BaseModel]] = {"workload": WorkloadConfig, **BENCH_SECTIONS}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="benchmark an OpenAI-compatible server (vllm bench serve's flags)",
        description=(
            "Send a seeded workload to an OpenAI-compatible server and report TTFT, TPOT, ITL, E2EL, throughput and "
            "goodput in vLLM's layout. `vllm bench serve` flags with the same meaning are accepted unchanged."
        ),
    )
    add_bench_flags(parser)
    parser.set_defaults(handler=_bench)


def add_bench_flags(parser: argparse.ArgumentParser) -> None:
    """Every `deepserve bench` flag (also used by `deepserve sweep`, which takes the same flags)."""
    parser.add_argument("--config", type=Path, default=None, help="YAML/JSON file with bench_target, bench_load, …")
    parser.add_argument(
        "--backend",
        default=None,
        help="accepted for vLLM compatibility: openai-chat selects /v1/chat/completions unless --endpoint is given",
    )
    for name, section in SECTIONS.items():
        group = parser.add_argument_group(name)
        add_section_flags(cast(argparse.ArgumentParser, group), section, skip=HAND_MADE_FLAGS.get(name, ()))
    parser.add_argument("--header", nargs="*", action="extend", default=None, metavar="KEY=VALUE")
    parser.add_argument("--goodput", nargs="+", action="extend", default=None, metavar="KEY:MS")
    parser.add_argument("--metadata", nargs="*", action="extend", default=None, metavar="KEY=VALUE")
    lora_help = TargetConfig.model_fields["lora_modules"].description
    parser.add_argument("--lora-modules", nargs="+", action="extend", default=None, metavar="NAME", help=lora_help)
    no_stream = WorkloadConfig.model_fields["no_stream"].description
    parser.add_argument("--no-stream", action="store_const", const=True, default=None, help=no_stream)
    refused = parser.add_argument_group("vllm bench serve flags that deepserve refuses (each error says why)")
    for flag, (takes_value, reason) in REFUSED_VLLM_FLAGS.items():
        kind: dict[str, Any] = {"metavar": "VALUE"} if takes_value else {"action": "store_const", "const": True}
        refused.add_argument(flag, dest=_refused_dest(flag), default=None, help=f"refused: {reason}", **kind)


def _refused_dest(flag: str) -> str:
    return "refused_" + flag.lstrip("-").replace("-", "_")


def refuse_unsupported(args: argparse.Namespace) -> None:
    """A clear one-line error for the first refused vLLM flag the user gave (never ignore a flag silently)."""
    for flag in REFUSED_VLLM_FLAGS:
        if getattr(args, _refused_dest(flag), None) is not None:
            raise ConfigError(refused_flag(flag))


def config_from_args(args: argparse.Namespace, argv: list[str] | None = None) -> BenchConfig:
    """The typed config from the flags the user gave, over the config file and DEEPSERVE_BENCH_* variables."""
    refuse_unsupported(args)
    values: dict[str, Any] = {}
    for name, section in SECTIONS.items():
        overrides = section_overrides(args, section)
        if name == "target" and args.backend == "openai-chat" and "endpoint" not in overrides:
            overrides["endpoint"] = CHAT_COMPLETIONS
        values[name] = load_section(section, f"bench_{name}", args.config, overrides)
    try:
        return BenchConfig(**values, command_line=argv)
    except ValidationError as exc:
        raise ConfigError("invalid benchmark configuration: " + "; ".join(e["msg"] for e in exc.errors())) from exc


def _bench(args: argparse.Namespace) -> int:
    config = config_from_args(args, ["deepserve", *sys.argv[1:]])
    if config.target.endpoint not in (COMPLETIONS, CHAT_COMPLETIONS):
        print(f"deepserve: note: endpoint {config.target.endpoint} is neither of the OpenAI ones", file=sys.stderr)
    result = run_benchmark(config)
    print(console_block(result))
    print(f"Recorded as run {record_run(result.to_json(), label=config.output.label)} (see `deepserve runs list`)")
    output = config.output
    path = result_path(result)
    if output.save_result or output.append_result or result.incomplete:
        print(f"Results saved to {save_result(result, path, append=output.append_result)}")
    if output.save_records:
        records_path = path.with_suffix(f".records.{output.save_records}")
        print(f"Per-request records saved to {save_records(result.records, records_path, output.save_records)}")
    return 130 if result.incomplete else 0
