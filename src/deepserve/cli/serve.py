"""`deepserve serve`: start an OpenAI-compatible DeepSeek-V3 service."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console

from deepserve.cli.flags import (
    add_gateway_switches,
    add_section_flags,
    engine_overrides,
    gateway_switches,
    section_overrides,
)
from deepserve.config import load_section
from deepserve.engines.config import EngineConfig
from deepserve.engines.supervisor import SupervisedProcess
from deepserve.gateway.config import GatewayConfig
from deepserve.serve.config import ServeConfig
from deepserve.serve.run import run_service
from deepserve.serve.service_plan import ServicePlan, check_can_run, dry_run_text, plan_service


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="start an OpenAI-compatible service (the tiny model on CPU when no GPU and no --model)",
        description=(
            "Start the engine and, in front of it, the gateway (keys, limits, metrics), as supervised child "
            "processes. --host/--port are the public address; the engine listens on loopback behind the gateway "
            "(--no-gateway serves the engine directly). Other gateway settings come from the `gateway` section of "
            "--config or DEEPSERVE_GATEWAY__* variables. Flags after `--` go to the engine unchanged."
        ),
    )
    parser.add_argument(
        "--config", type=Path, default=None, help="YAML or JSON config file (sections engine, serve, gateway)"
    )
    parser.add_argument("--dry-run", action="store_true", help="print the command lines and environment, exit")
    add_section_flags(parser, EngineConfig, skip=("extra_args",))
    add_section_flags(parser, ServeConfig)
    add_gateway_switches(parser)
    parser.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    config = load_section(EngineConfig, "engine", args.config, engine_overrides(args))
    serve = load_section(ServeConfig, "serve", args.config, section_overrides(args, ServeConfig))
    gateway = load_section(GatewayConfig, "gateway", args.config, gateway_switches(args)) if serve.gateway else None
    plan = plan_service(config, serve, gateway, on_this_machine=not args.dry_run)
    if args.dry_run:
        print(dry_run_text(plan, serve, gateway))
        return 0
    check_can_run(plan)
    console = Console(stderr=True)
    with _ProgressLine(console, plan) as progress:
        return run_service(plan, progress.update, lambda ready_s, proc: progress.ready(ready_s, proc))


class _ProgressLine:
    """A live "phase (elapsed)" line on a terminal; one line per phase change elsewhere (CI logs)."""

    def __init__(self, console: Console, plan: ServicePlan) -> None:
        self.console = console
        self.plan = plan
        self._last_phase = ""
        self._status = console.status("") if console.is_terminal else None

    def __enter__(self) -> _ProgressLine:
        name, config = self.plan.engine.name, self.plan.config
        where = ""
        if self.plan.role == "head":
            where = f" as node 0 of {config.nnodes} (the API; the other nodes join at {config.master_addr})"
        elif self.plan.role == "worker":
            where = (
                f" as node {config.node_rank} of {config.nnodes}: a headless worker for node 0 at "
                f"{config.master_addr} (no API and no gateway on this node)"
            )
        self.console.print(f"Starting {name} on {self.plan.device} with {self.plan.model.served_name}{where} …")
        for note in self.plan.notes:
            self.console.print(f"  note: {note}", highlight=False)
        if self._status:
            self._status.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._status:
            self._status.stop()
        self.console.print("deepserve: stopped")

    def update(self, phase: str, elapsed_s: float) -> None:
        if self._status:
            self._status.update(f"{phase} ({elapsed_s:.0f} s)")
        elif phase != self._last_phase:
            self.console.print(f"  [{elapsed_s:5.0f} s] {phase}")
        self._last_phase = phase

    def ready(self, ready_s: float, processes: list[SupervisedProcess]) -> None:
        if self._status:
            self._status.stop()
            self._status = None
        if self.plan.role == "worker":
            self._worker_ready(ready_s, processes[0])
            return
        launch = self.plan.public
        curl = (
            f"curl {launch.base_url}/chat/completions -H 'Content-Type: application/json' "
            f'-d \'{{"model": "{launch.served_model_name}", '
            f'"messages": [{{"role": "user", "content": "Hello"}}], "max_tokens": 32}}\''
        )
        lines = [
            f"[bold green]deepserve is ready[/] after {ready_s:.0f} s ({self.plan.engine.name} on {self.plan.device})",
            f"  base URL  {launch.base_url}",
            f"  model     {launch.served_model_name}",
            *(f"  {proc.name:<9} {proc.spec.base_url}, pid {proc.pid}, log {proc.log_path}" for proc in processes),
            f"  try       {curl}",
            "Press Ctrl-C to stop.",
        ]
        for line in lines:
            self.console.print(line, soft_wrap=True, highlight=False)
        # A machine-readable line for scripts and tests: READY <public base URL> <served model name> <engine base URL>
        ready_line = f"READY {launch.base_url} {launch.served_model_name} {self.plan.launch.base_url}"
        print(ready_line, file=sys.stdout, flush=True)

    def _worker_ready(self, ready_s: float, engine: SupervisedProcess) -> None:
        config = self.plan.config
        self.console.print(
            f"[bold green]node {config.node_rank} is serving its share[/] after {ready_s:.0f} s; the service's API is "
            f"on node 0 ({config.master_addr})\n  engine    pid {engine.pid}, log {engine.log_path}\n"
            "Press Ctrl-C to stop this node (node 0 then stops too).",
            soft_wrap=True,
            highlight=False,
        )
        # For scripts and tests: WORKER <rank> <engine pid>
        print(f"WORKER {config.node_rank} {engine.pid}", file=sys.stdout, flush=True)
