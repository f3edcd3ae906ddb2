"""Injected failures and settable state, for tests of what sits in front of an engine (the gateway, the benchmark).

Which requests fail is decided by their arrival index, never by chance: a fraction f picks requests i where
floor((i + 1) f + phase) > floor(i f + phase), evenly spread and exactly f of them; each kind of fault has its own
phase, so a 10% error rate and a 10% cut rate hit different requests. Index sets pick requests by hand (tests).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any, get_args

from deepserve.simulate.config import CutMode, SimulateConfig

CUT_MODES: tuple[str, ...] = get_args(CutMode)
_PHASES = {"hang": 0.0, "error": 1 / 3, "cut": 2 / 3}


@dataclass(frozen=True)
class Faults:
    error_fraction: float = 0.0  # answered ERROR_STATUS before any byte of a reply
    error_status: int = 500
    cut_fraction: float = 0.0  # streams that end after CUT_AFTER_TOKENS tokens, as CUT_MODE says
    cut_after_tokens: int = 1
    # close: the connection drops; error_event: an error event and [DONE]; malformed_event: an event that is not
    # JSON; stall: nothing more is sent and the connection stays open (an engine hung mid-stream)
    cut_mode: CutMode = "close"
    hang_fraction: float = 0.0  # never answered: no byte until the client gives up
    error_indices: frozenset[int] = frozenset()
    cut_indices: frozenset[int] = frozenset()
    hang_indices: frozenset[int] = frozenset()
    cut_modes: Mapping[int, CutMode] = field(default_factory=lambda: MappingProxyType({}))  # several kinds, one run

    def __post_init__(self) -> None:
        for name in ("error_fraction", "cut_fraction", "hang_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be between 0 and 1")
        named = [("cut_mode", self.cut_mode)] + [(f"cut_modes[{i}]", mode) for i, mode in self.cut_modes.items()]
        for name, mode in named:
            if mode not in CUT_MODES:
                raise ValueError(f"{name} must be one of {', '.join(CUT_MODES)} (got {mode!r})")
        if not 400 <= self.error_status <= 599:
            raise ValueError("error_status must be an HTTP error status (400-599)")
        if self.cut_after_tokens < 0:
            raise ValueError("cut_after_tokens must not be negative")

    @classmethod
    def from_config(cls, config: SimulateConfig) -> Faults:
        return cls(
            error_fraction=config.error_fraction,
            error_status=config.error_status,
            cut_fraction=config.cut_fraction,
            cut_after_tokens=config.cut_after_tokens,
            cut_mode=config.cut_mode,
            hang_fraction=config.hang_fraction,
        )

    def decide(self, index: int) -> str | None:
        """The fault for the INDEX-th generation request (0-based): "hang", "error", "cut" or None."""
        if index in self.hang_indices or _every(index, self.hang_fraction, _PHASES["hang"]):
            return "hang"
        if index in self.error_indices or _every(index, self.error_fraction, _PHASES["error"]):
            return "error"
        if index in self.cut_indices or index in self.cut_modes or _every(index, self.cut_fraction, _PHASES["cut"]):
            return "cut"
        return None

    def cut_mode_of(self, index: int) -> CutMode:
        """How the INDEX-th request's stream is cut (when decide says "cut")."""
        return self.cut_modes.get(index, self.cut_mode)

    def updated(self, changes: dict[str, Any]) -> Faults:
        """A copy with CHANGES (JSON from POST /simulate/control: lists for the index sets, an object of index →
        mode for cut_modes)."""
        known = {f.name for f in fields(self)}
        unknown = set(changes) - known
        if unknown:
            names, valid = ", ".join(sorted(unknown)), ", ".join(sorted(known))
            raise ValueError(f"unknown fault setting(s) {names}; valid: {valid}")
        values: dict[str, Any] = {
            key: frozenset(value) if key.endswith("_indices") else value for key, value in changes.items()
        }
        if "cut_modes" in values:
            modes = values["cut_modes"] or {}
            if not isinstance(modes, Mapping):
                raise ValueError("cut_modes must map request indices to cut modes")
            values["cut_modes"] = MappingProxyType({int(index): mode for index, mode in modes.items()})
        return replace(self, **values)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_indices"):
                value = sorted(value)
            elif f.name == "cut_modes":
                value = {str(index): mode for index, mode in sorted(value.items())}
            data[f.name] = value
        return data


def _every(index: int, fraction: float, phase: float) -> bool:
    if fraction <= 0:
        return False
    return math.floor((index + 1) * fraction + phase) > math.floor(index * fraction + phase)


@dataclass
class Controls:
    """What tests may change while the simulator runs (in-process, or with POST /simulate/control)."""

    faults: Faults = field(default_factory=Faults)
    healthy: bool | None = None  # None: healthy until the unhealthy_after_* schedule says otherwise
    unhealthy_after_s: float | None = None
    unhealthy_after_requests: int | None = None
    health_delay_s: float = 0.0
    metrics_delay_s: float = 0.0
    metric_overrides: dict[str, float] = field(default_factory=dict)  # series name → value served in /metrics
    metrics_text: str | None = None  # served verbatim as /metrics instead of the engine's series

    @classmethod
    def from_config(cls, config: SimulateConfig) -> Controls:
        return cls(
            faults=Faults.from_config(config),
            unhealthy_after_s=config.unhealthy_after_s,
            unhealthy_after_requests=config.unhealthy_after_requests,
            health_delay_s=config.health_delay_s,
            metrics_delay_s=config.metrics_delay_s,
        )

    def is_healthy(self, uptime_s: float, requests: int) -> bool:
        if self.healthy is not None:
            return self.healthy
        if self.unhealthy_after_s is not None and uptime_s >= self.unhealthy_after_s:
            return False
        return self.unhealthy_after_requests is None or requests < self.unhealthy_after_requests

    def apply(self, changes: Any) -> None:
        """Apply a POST /simulate/control body; ValueError (answered 400) for anything it cannot use."""
        if not isinstance(changes, dict):
            raise ValueError("the control body must be a JSON object")
        unknown = set(changes) - {
            "faults", "healthy", "unhealthy_after_s", "unhealthy_after_requests", "health_delay_s",
            "metrics_delay_s", "metric_overrides", "metrics_text",
        }  # fmt: skip
        if unknown:
            raise ValueError(f"unknown control(s) {', '.join(sorted(unknown))}")
        if "faults" in changes:
            if not isinstance(changes["faults"], dict):
                raise ValueError("faults must be an object of fault settings")
            self.faults = self.faults.updated(changes["faults"])
        if "healthy" in changes:
            if changes["healthy"] not in (True, False, None):
                raise ValueError("healthy must be true, false or null (follow the schedule)")
            self.healthy = changes["healthy"]
        for name in ("unhealthy_after_s", "unhealthy_after_requests", "health_delay_s", "metrics_delay_s"):
            if name in changes:
                setattr(self, name, _number_or_none(name, changes[name], allow_none=not name.endswith("delay_s")))
        if "metric_overrides" in changes:
            overrides = changes["metric_overrides"] or {}
            if not isinstance(overrides, dict) or not all(_is_number(v) for v in overrides.values()):
                raise ValueError("metric_overrides must map series names to numbers")
            self.metric_overrides = {str(k): float(v) for k, v in overrides.items()}
        if "metrics_text" in changes:
            if changes["metrics_text"] is not None and not isinstance(changes["metrics_text"], str):
                raise ValueError("metrics_text must be a string or null")
            self.metrics_text = changes["metrics_text"]

    def to_json(self) -> dict[str, Any]:
        return {
            "faults": self.faults.to_json(),
            "healthy": self.healthy,
            "unhealthy_after_s": self.unhealthy_after_s,
            "unhealthy_after_requests": self.unhealthy_after_requests,
            "health_delay_s": self.health_delay_s,
            "metrics_delay_s": self.metrics_delay_s,
            "metric_overrides": self.metric_overrides,
            "metrics_text": self.metrics_text,
        }


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number_or_none(name: str, value: Any, allow_none: bool) -> Any:
    if value is None and allow_none:
        return None
    if not _is_number(value) or value < 0:
        raise ValueError(f"{name} must be a non-negative number" + (" or null" if allow_none else ""))
    return value
