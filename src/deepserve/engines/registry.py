"""Engines by name: the one place a new engine is added."""

from __future__ import annotations

from deepserve.engines.base import Engine
from deepserve.engines.sglang import SglangEngine
from deepserve.engines.vllm import VllmEngine
from deepserve.errors import ConfigError, unknown_name

ENGINES: dict[str, Engine] = {"vllm": VllmEngine(), "sglang": SglangEngine()}


def get_engine(name: str) -> Engine:
    try:
        return ENGINES[name]
    except KeyError:
        raise ConfigError(unknown_name("engine", name, list(ENGINES))) from None
