"""The tune's grid: engine-config fields and the values to try (`--grid max_num_seqs=2,16`), each value parsed and
checked by the field's own type in EngineConfig, expanded into points with stable ids."""

from __future__ import annotations

import hashlib
import json
import shlex
import typing
from dataclasses import dataclass
from itertools import product
from typing import Any

from pydantic import ValidationError

from deepserve.engines.config import EngineConfig
from deepserve.errors import ConfigError, unknown_name

# Set by the tune for every point (a free loopback port), never by the user.
TUNE_SETS = ("host", "port")
# A tune starts each point on this machine alone: the fields of a deployment over several nodes do not apply.
MULTI_NODE_FIELDS = (
    "nnodes", "node_rank", "master_addr", "master_port", "join_port", "join_timeout_s", "data_parallel_size_local",
    "data_parallel_address", "data_parallel_rpc_port",
)  # fmt: skip
DEFAULT_WORDS = ("default", "none", "null")  # a grid value that leaves an optional field to the engine's default


@dataclass(frozen=True)
class GridAxis:
    field: str
    values: tuple[Any, ...]


@dataclass(frozen=True)
class TunePoint:
    point_id: str
    overrides: dict[str, Any]  # the grid's engine-config fields at this point
    config: EngineConfig  # the base config with them set

    def describe(self) -> str:
        """ "max_num_seqs=16 max_num_batched_tokens=512": the point in the user's own words."""
        return " ".join(f"{field}={format_value(value)}" for field, value in self.overrides.items()) or "base config"


def engine_fields() -> list[str]:
    return [name for name in EngineConfig.model_fields if name not in TUNE_SETS + MULTI_NODE_FIELDS]


def parse_axis(text: str) -> GridAxis:
    """ "max_num_seqs=2,16" → GridAxis("max_num_seqs", (2, 16)); each value checked as EngineConfig checks it."""
    name, sep, raw_values = text.partition("=")
    field = name.strip().replace("-", "_")
    if not sep or not field:
        raise ConfigError(f"--grid {text!r} must look like FIELD=V1,V2,..., e.g. max_num_seqs=64,128,256")
    check_field(field, "--grid")
    items = [item.strip() for item in raw_values.split(",")]
    if not any(items):
        raise ConfigError(f"--grid {text!r} needs at least one value after '='")
    values = tuple(parse_value(field, item, f"--grid {text}") for item in items if item)
    if len(set(map(_key, values))) != len(values):
        raise ConfigError(f"--grid {text!r} lists a value twice")
    return GridAxis(field, values)


def parse_setting(text: str) -> tuple[str, Any]:
    """ "model=tiny" (--set): one engine-config field fixed for every point."""
    name, sep, raw = text.partition("=")
    field = name.strip().replace("-", "_")
    if not sep or not field:
        raise ConfigError(f"--set {text!r} must look like FIELD=VALUE, e.g. max_model_len=4096")
    check_field(field, "--set")
    return field, parse_value(field, raw.strip(), f"--set {text}")


def check_field(field: str, flag: str) -> None:
    if field in TUNE_SETS:
        raise ConfigError(f"{flag} {field}: the tune starts each engine on a free loopback port itself; leave it out")
    if field in MULTI_NODE_FIELDS:
        raise ConfigError(f"{flag} {field}: a tune runs every point on this machine alone, not over several nodes")
    if field not in EngineConfig.model_fields:
        raise ConfigError(unknown_name("engine-config field", field, engine_fields()))


def parse_value(field: str, raw: str, where: str) -> Any:
    """RAW as FIELD's type: pydantic's own parsing and limits (ints, floats, booleans, choices), "default" for an
    optional field the engine should choose, and a shell-quoted argument list for list fields."""
    annotation = EngineConfig.model_fields[field].annotation
    value: Any = raw
    if raw in _choices(annotation):
        pass  # a choice of the field's own (speculative_method=none: off), not a word for its default
    elif raw.lower() in DEFAULT_WORDS:
        if not _optional(annotation):
            default = EngineConfig.model_fields[field].get_default(call_default_factory=True)
            raise ConfigError(f"{where}: {field} has no engine default to fall back on (its default is {default!r})")
        value = None
    elif typing.get_origin(annotation) is list:
        value = shlex.split(raw)
    try:
        EngineConfig.model_validate({field: value})
    except ValidationError as exc:
        problem = "; ".join(error["msg"] for error in exc.errors())
        raise ConfigError(f"{where}: {raw!r} is not a valid {field} ({problem})") from None
    return getattr(EngineConfig.model_validate({field: value}), field)


def expand(axes: list[GridAxis], base: EngineConfig) -> list[TunePoint]:
    """Every combination of the axes (the first axis varies slowest), each applied to BASE."""
    fields = [axis.field for axis in axes]
    twice = sorted({field for field in fields if fields.count(field) > 1})
    if twice:
        raise ConfigError(f"--grid {twice[0]} is given twice; list all its values in one --grid {twice[0]}=V1,V2")
    points = []
    for values in product(*(axis.values for axis in axes)):
        overrides = {axis.field: value for axis, value in zip(axes, values, strict=True)}
        try:
            config = base.model_validate({**base.model_dump(), **overrides})
        except ValidationError as exc:
            problem = "; ".join(error["msg"].removeprefix("Value error, ") for error in exc.errors())
            raise ConfigError(f"grid point {describe_overrides(overrides)}: {problem}") from None
        points.append(TunePoint(point_id(overrides), overrides, config))
    return points


def point_id(overrides: dict[str, Any]) -> str:
    """A readable slug of the point's values (max_num_seqs=16 → "mns16") and a hash of them, so that two points
    that differ in anything never share a result file."""
    parts = [_initials(field) + _slug(value) for field, value in overrides.items()]
    digest = hashlib.sha256(json.dumps(overrides, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return "-".join([*parts, digest])[:120]


def describe_overrides(overrides: dict[str, Any]) -> str:
    return " ".join(f"{field}={format_value(value)}" for field, value in overrides.items())


def format_value(value: Any) -> str:
    if value is None:
        return "default"
    if isinstance(value, list):
        return shlex.join(value)
    if isinstance(value, bool):
        return str(value).lower()
    return f"{value:g}" if isinstance(value, float) else str(value)


def _initials(field: str) -> str:
    return "".join(word[0] for word in field.split("_") if word)


def _slug(value: Any) -> str:
    text = format_value(value)
    return "".join(ch if ch.isalnum() or ch in ".+" else "_" for ch in text)[:24]


def _choices(annotation: Any) -> tuple[Any, ...]:
    """The Literal values a field takes (through Optional), or none."""
    for arg in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(arg) is typing.Literal:
            return typing.get_args(arg)
    return ()


def _optional(annotation: Any) -> bool:
    return type(None) in typing.get_args(annotation)


def _key(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)
