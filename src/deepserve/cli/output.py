"""Console output shared by the sub-commands."""

from __future__ import annotations

from rich.console import Console

PIPE_WIDTH = 160  # rich assumes 80 columns when not on a terminal, which folds model names in tables


def console(stderr: bool = False) -> Console:
    probe = Console(stderr=stderr)
    return probe if probe.is_terminal else Console(stderr=stderr, width=PIPE_WIDTH)
