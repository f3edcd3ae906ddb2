"""`deepserve deploy`: render deployment files (Kubernetes, docker compose, Slurm) from the config or a plan, and the
preflight check a node runs before the deployment spends GPU hours."""

from __future__ import annotations

import argparse
import json
import shlex
from dataclasses import asdict
from pathlib import Path

from rich.table import Table

from deepserve.cli.flags import (
    add_gateway_switches,
    add_section_flags,
    engine_overrides,
    gateway_switches,
    section_overrides,
)
from deepserve.cli.output import console
from deepserve.config import load_section
from deepserve.deploy.check import Expected, Verdict, failed, gather_facts, run_checks
from deepserve.deploy.config import DeployConfig
from deepserve.deploy.render import TARGETS, render
from deepserve.deploy.source import deploy_spec, deployment_config
from deepserve.engines.config import EngineConfig
from deepserve.gateway.config import GatewayConfig
from deepserve.hardware.network import NetworkConfig
from deepserve.plan.types import PlanConfig

PLAN_ONLY_FIELDS = ("input_len", "output_len")

_VERDICT_STYLE = {Verdict.OK: "green", Verdict.WARN: "yellow", Verdict.FAIL: "bold red", Verdict.NA: "dim"}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "deploy",
        help="render Kubernetes, docker compose or Slurm files from one config or plan; check a node before it runs",
        description="Deployment files built from the same engine config as `deepserve serve` (docs/DEPLOY.md).",
    )
    actions = parser.add_subparsers(dest="deploy_command", metavar="ACTION", required=True)

    draw = actions.add_parser(
        "render",
        allow_abbrev=False,
        help="write the files that run this deployment on a cluster",
        description=(
            "Engine flags as for `deepserve serve` (or --gpu/--gpus to take the planner's layout); the gateway's "
            "limits from the `gateway` section of --config. Every engine command line in the files is written by "
            "the engine's own launcher, as `serve` runs it. Flags after `--` go to the engine unchanged."
        ),
    )
    draw.add_argument("--target", required=True, choices=sorted(TARGETS), help="what to render for")
    draw.add_argument("--out", required=True, type=Path, help="directory to write the files into")
    _add_deployment_flags(draw)
    draw.add_argument("--gpu", help="plan the layout for this GPU type (catalog name, e.g. h100, h200, b200)")
    draw.add_argument("--gpus", type=int, help="with --gpu: total GPUs to plan the layout over (whole nodes)")
    draw.add_argument("--weights", help="with --gpu: the checkpoint's weight format (or fp8-dynamic from 16-bit)")
    # The workload the plan sizes --max-num-seqs for (also from the config file's `plan` section, as `plan` reads).
    add_section_flags(draw, PlanConfig, only=PLAN_ONLY_FIELDS)
    add_gateway_switches(draw)
    add_section_flags(draw, DeployConfig)
    draw.set_defaults(handler=_render)

    check = actions.add_parser(
        "check",
        allow_abbrev=False,
        help="preflight on this node: GPUs, driver, disk, /dev/shm, node 0's ports, interfaces, model access",
        description=(
            "Run on every node with the flags its `deepserve serve` will get (--gpu-type: the GPU type it was "
            "planned for). Exits 1 when a check fails."
        ),
    )
    _add_deployment_flags(check)
    check.add_argument("--json", action="store_true", help="print JSON instead of a table")
    check.set_defaults(handler=_check)


def _add_deployment_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", type=Path, default=None, help="YAML or JSON config file (engine, gateway, network, plan, deploy)"
    )
    add_section_flags(parser, EngineConfig, skip=("extra_args", "role"))
    add_section_flags(parser, NetworkConfig)


def _render(args: argparse.Namespace) -> int:
    network = load_section(NetworkConfig, "network", args.config, section_overrides(args, NetworkConfig))
    plan_flags = {"gpu": args.gpu, "gpus": args.gpus, "weights": args.weights}
    plan_flags.update({name: getattr(args, name) for name in PLAN_ONLY_FIELDS})
    config, plan = deployment_config(args.config, engine_overrides(args), plan_flags, network)
    gateway = load_section(GatewayConfig, "gateway", args.config, gateway_switches(args))
    deploy = load_section(DeployConfig, "deploy", args.config, section_overrides(args, DeployConfig))
    spec = deploy_spec(
        config, gateway, command=shlex.join(["deepserve", *args.argv]), deploy=deploy, plan=plan, network=network
    )
    written = render(spec, args.target, args.out, str(args.out))
    out = console()
    out.print(f"rendered {args.target} for {spec.describe()}:", highlight=False)
    for path in written:
        out.print(f"  {path}", highlight=False)
    for note in spec.notes:
        out.print(f"  note: {note}", highlight=False)
    out.print(f"how to apply: the header of each file ({written[0]})", highlight=False)
    return 0


def _check(args: argparse.Namespace) -> int:
    config = load_section(EngineConfig, "engine", args.config, engine_overrides(args))
    network = load_section(NetworkConfig, "network", args.config, section_overrides(args, NetworkConfig))
    checks = run_checks(Expected(config, network.profile()), gather_facts())
    if args.json:
        print(json.dumps([{**asdict(c), "verdict": c.verdict.value} for c in checks], indent=2))
        return 1 if failed(checks) else 0
    table = Table(title=f"deepserve deploy check: node {config.node_rank} of {config.nnodes}", show_lines=False)
    for column in ("check", "verdict", "detail", "fix"):
        table.add_column(column, overflow="fold")
    for c in checks:
        style = _VERDICT_STYLE[c.verdict]
        table.add_row(c.name, f"[{style}]{c.verdict.value}[/]", c.detail, c.fix)
    out = console()
    out.print(table)
    if failed(checks):
        out.print("[bold red]some checks failed[/]: fix them before starting this node", highlight=False)
        return 1
    out.print("no check failed", highlight=False)
    return 0
