"""`deepserve serve`: start an OpenAI-compatible DeepSeek-V3 service."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console

from deepserve.cli.flags import add_section_flags, section_overrides
from deepserve.config import EngineConfig, load_section
from deepserve.engines.supervisor import EngineProcess
from deepserve.service import ServicePlan, dry_run_text, plan_service, preflight, run_service


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="start an OpenAI-compatible service (the tiny model on CPU when no GPU and no --model)",
        description="Start the engine as a supervised child process. Flags after `--` go to the engine unchanged.",
    )
    parser.add_argument("--config", type=Path, default=None, help="YAML or JSON config file (section `engine`)")
    parser.add_argument("--dry-run", action="store_true", help="print the engine command line and environment, exit")
    add_section_flags(parser, EngineConfig, skip=("extra_args",))
    parser.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    overrides = section_overrides(args, EngineConfig)
    if args.passthrough:
        overrides["extra_args"] = args.passthrough
    config = load_section(EngineConfig, "engine", args.config, overrides)
    plan = plan_service(config)
    if args.dry_run:
        print(dry_run_text(plan))
        return 0
    preflight(plan)
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
        name = self.plan.engine.name
        self.console.print(f"Starting {name} on {self.plan.device} with {self.plan.model.served_name} …")
        if self._status:
            self._status.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._status:
            self._status.stop()
        self.console.print("deepserve: engine stopped")

    def update(self, phase: str, elapsed_s: float) -> None:
        if self._status:
            self._status.update(f"{phase} ({elapsed_s:.0f} s)")
        elif phase != self._last_phase:
            self.console.print(f"  [{elapsed_s:5.0f} s] {phase}")
        self._last_phase = phase

    def ready(self, ready_s: float, process: EngineProcess) -> None:
        if self._status:
            self._status.stop()
            self._status = None
        launch = self.plan.launch
        curl = (
            f"curl {launch.base_url}/chat/completions -H 'Content-Type: application/json' "
            f'-d \'{{"model": "{launch.served_model_name}", '
            f'"messages": [{{"role": "user", "content": "Hello"}}], "max_tokens": 32}}\''
        )
        lines = [
            f"[bold green]deepserve is ready[/] after {ready_s:.0f} s",
            f"  base URL  {launch.base_url}",
            f"  model     {launch.served_model_name}",
            f"  engine    {self.plan.engine.name} on {self.plan.device}, pid {process.pid}, log {process.log_path}",
            f"  try       {curl}",
            "Press Ctrl-C to stop.",
        ]
        for line in lines:
            self.console.print(line, soft_wrap=True, highlight=False)
        # A machine-readable line for scripts and tests: READY <base URL> <served model name>
        print(f"READY {launch.base_url} {launch.served_model_name}", file=sys.stdout, flush=True)
