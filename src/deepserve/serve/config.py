"""The `serve` section of the config tree: how `deepserve serve` arranges its processes."""

from __future__ import annotations

from pydantic import Field

from deepserve.config import Section


class ServeConfig(Section):
    """How `deepserve serve` arranges its processes: the engine alone, or behind the gateway."""

    gateway: bool = Field(True, description="put the gateway (keys, limits, metrics) in front of the engine")
    engine_port: int | None = Field(
        None, ge=1, le=65535, description="the engine's internal port behind the gateway (default: a free one)"
    )
    force: bool = Field(False, description="start even when the memory plan says the model cannot fit")
