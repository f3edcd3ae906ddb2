"""Engines by name: the one place a new engine is added."""

from __future__ import annotations

from deepserve.engines.base import Engine, MemoryFractionOf
from deepserve.engines.sglang import SglangEngine
from deepserve.engines.trtllm import TrtllmEngine
from deepserve.engines.vllm import VllmEngine
from deepserve.errors import ConfigError, unknown_name

ENGINES: dict[str, Engine] = {"vllm": VllmEngine(), "sglang": SglangEngine(), "trtllm": TrtllmEngine()}


def get_engine(name: str) -> Engine:
    try:
        return ENGINES[name]
    except KeyError:
        raise ConfigError(unknown_name("engine", name, list(ENGINES))) from None


def memory_fraction_of(name: str) -> MemoryFractionOf:
    """What NAME's memory fraction is a share of ("device" or "free", Engine.memory_fraction_of); "device" for an
    engine deepserve does not launch (rows of published runs only), as vLLM's and SGLang's."""
    engine = ENGINES.get(name)
    return engine.memory_fraction_of if engine is not None else "device"


def check_engine_name(name: str, also: tuple[str, ...] = ()) -> str:
    """NAME when it is a registered engine (or one of ALSO), else a ConfigError listing the valid names."""
    if name not in ENGINES and name not in also:
        raise ConfigError(unknown_name("engine", name, sorted(ENGINES)))
    return name
