"""One workload against several served engines (or machines): what seed 004 did with SGLang, vLLM and
TensorRT-LLM on 8 x H200 and 8 x MI300X, as `deepserve sweep --suite seed004 --target NAME=URL --target …`.

Every target runs the same points (the same lengths, counts and durations), each into its own result directory
under the comparison's (DIR/NAME), and one report draws them together, a line per target. A suite is scaled once
for all of them: each target is probed, and the plan of the slowest (the most shortened) is the one all run, so
that it still fits the time budget and the lines stay comparable point for point."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from deepserve.bench.config import BenchConfig
from deepserve.errors import ConfigError
from deepserve.sweep.suites import SuitePlan

TARGET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,40}")


@dataclass(frozen=True)
class Target:
    name: str  # the report's label for its lines, and its result directory's name
    url: str

    def directory(self, comparison: Path) -> Path:
        return comparison / self.name


def parse_targets(values: Sequence[str]) -> list[Target]:
    """`NAME=URL` each, e.g. `sglang-h200=http://10.0.0.5:8000`; names unique and usable as directory names."""
    targets: list[Target] = []
    for value in values:
        name, sep, url = value.partition("=")
        name, url = name.strip(), url.strip()
        if not sep or not url:
            raise ConfigError(f"--target {value!r}: give NAME=URL, e.g. --target vllm=http://127.0.0.1:8000")
        if not TARGET_NAME.fullmatch(name):
            raise ConfigError(
                f"--target {value!r}: the name {name!r} must be letters, digits, '.', '_', '+' or '-' (up to 41), "
                "as it names the target's result directory"
            )
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"--target {value!r}: the URL must start with http:// or https://")
        if any(target.name == name for target in targets):
            raise ConfigError(f"--target {name} is given twice: each target needs its own name")
        targets.append(Target(name, url))
    return targets


def target_config(base: BenchConfig, target: Target, comparison: Path) -> BenchConfig:
    """BASE aimed at TARGET: its URL, its name as the label, its own directory."""
    return base.model_copy(
        update={
            "target": base.target.model_copy(update={"base_url": target.url}),
            "output": base.output.model_copy(
                update={"label": target.name, "result_dir": str(target.directory(comparison))}
            ),
        }
    )


def common_context(contexts: Sequence[int | None]) -> int | None:
    """The context every target serves: the shortest one they report (None when none does)."""
    known = [context for context in contexts if context]
    return min(known) if known else None


def common_plan(plans: Sequence[SuitePlan]) -> SuitePlan:
    """The plan every target runs: the slowest target's (the shortest lengths, then the shortest point duration),
    which the faster ones run too: within the budget for all, and the same workload everywhere."""
    if not plans:
        raise ValueError("no plan to choose from")
    return min(plans, key=lambda plan: (plan.length_factor, plan.point_duration_s or math.inf))
