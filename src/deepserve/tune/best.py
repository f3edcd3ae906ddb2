"""DIR/best.yaml: the winning point as a config file that `deepserve serve --config DIR/best.yaml` takes as it is
(its `engine` section), with what was measured in comments above it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from deepserve.engines.config import EngineConfig
from deepserve.results.slo import Slo
from deepserve.results.sweepdir import now_iso
from deepserve.tune.select import Scored

BEST_NAME = "best.yaml"


def engine_section(config: EngineConfig, overrides: dict[str, Any]) -> dict[str, Any]:
    """The engine fields a point sets: everything not at its default, and the grid's own fields even when they are
    (the tune's loopback host and port are left out: they were the tune's, not the config's)."""
    data = config.model_dump(exclude={"host", "port"}, exclude_defaults=True)
    data.update({key: value for key, value in overrides.items() if key not in ("host", "port")})
    return data


def best_yaml(
    best: Scored, overrides: dict[str, Any], label: str, slos: Sequence[Slo], directory: Path, measured: int
) -> str:
    slo_words = ", ".join(slo.words for slo in slos) or "none"
    lines = [
        f"# deepserve tune '{label}', {now_iso()}: the best of {measured} measured points in {directory.resolve()}",
        f"# (every point: index.json there, or `deepserve report {directory} --out REPORT_DIR`).",
        f"# {best.description}: goodput {best.goodput_output_tok_s:,.1f} of {best.output_tok_s:,.1f} output tok/s "
        f"at {best.judged_at}; SLOs: {slo_words}.",
        *(f"#   {check.words}" for check in best.checks),
        f"# Serve it: deepserve serve --config {directory / BEST_NAME}",
    ]
    body = yaml.safe_dump({"engine": engine_section(best.config, overrides)}, sort_keys=False)
    return "\n".join(lines) + "\n" + body


def write_best(
    directory: Path, best: Scored, overrides: dict[str, Any], label: str, slos: Sequence[Slo], measured: int
) -> Path:
    path = directory / BEST_NAME
    path.write_text(best_yaml(best, overrides, label, slos, directory, measured))
    return path
