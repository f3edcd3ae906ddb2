"""Sweep points: a grid of benchmark parameters or a suite's plan, each point with a stable id and the bench config
it runs (the base config with the point's fields set)."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from itertools import product
from typing import Any

from pydantic import BaseModel, ValidationError

from deepserve.bench.config import BenchConfig
from deepserve.errors import ConfigError
from deepserve.sweep.suites import SuitePlan

# Flags of `deepserve sweep` that take comma-separated lists, and the config field each sets.
LIST_FIELDS = ("max_concurrency", "request_rate", "random_input_len", "random_output_len")
SECTION_NAMES = ("workload", "load", "target", "metrics", "output")


@dataclass(frozen=True)
class SweepPoint:
    point_id: str
    overrides: dict[str, Any]  # bench config fields this point sets
    variant: str | None = None

    @property
    def params(self) -> dict[str, Any]:
        """What the report needs to place this point (PointParams' fields)."""
        o = self.overrides
        input_len = o.get("long_prompt_len") if o.get("dataset_name") == "long" else o.get("random_input_len")
        if o.get("dataset_name") == "sampled":
            input_len = None
        return {
            "max_concurrency": o.get("max_concurrency"),
            "request_rate": o.get("request_rate"),
            "input_len": input_len,
            "output_len": o.get("random_output_len"),
            "num_prompts": o.get("num_prompts"),
            "variant": self.variant,
        }


@dataclass
class SweepSpec:
    label: str
    points: list[SweepPoint]
    sweep_axis: str | None  # "max_concurrency", "request_rate" or None
    signature: str  # what was asked (suite or lists, base flags, budget): equal signatures resume
    suite: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


def point_id(overrides: dict[str, Any], variant: str | None) -> str:
    """A readable slug ("c16-i1024-o256") plus a hash of every parameter, so that two points differing in anything
    (a seed, a duration) never share a result file."""
    parts = [variant.replace(" ", "_")] if variant else []
    for key, tag in (
        ("max_concurrency", "c"),
        ("request_rate", "r"),
        ("random_input_len", "i"),
        ("long_prompt_len", "L"),
        ("random_output_len", "o"),
    ):
        if overrides.get(key) is not None:
            parts.append(f"{tag}{overrides[key]:g}" if isinstance(overrides[key], float) else f"{tag}{overrides[key]}")
    if overrides.get("dataset_name") == "offline" or variant == "offline":
        parts.append(f"n{overrides.get('num_prompts')}")
    digest = hashlib.sha256(json.dumps([overrides, variant], sort_keys=True, default=str).encode()).hexdigest()[:8]
    return "-".join([*parts, digest])


def signature(inputs: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:16]


def template_variants(options: list[str]) -> dict[str, dict[str, Any]]:
    """--chat-template-kwargs given several times to a sweep: one variant of every point per option set, named
    by it ("thinking=true"). Each must be a JSON object."""
    variants: dict[str, dict[str, Any]] = {}
    for text in options:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--chat-template-kwargs {text!r} is not valid JSON ({exc.msg})") from exc
        if not isinstance(value, dict):
            raise ConfigError(f"--chat-template-kwargs {text!r} must be a JSON object, e.g. '{{\"thinking\": false}}'")
        name = ", ".join(f"{key}={json.dumps(item)}" for key, item in value.items()) or "no options"
        variants[name] = {"chat_template_kwargs": json.dumps(value)}
    return variants


def grid_spec(
    lists: dict[str, list[Any]],
    label: str,
    inputs: dict[str, Any],
    variants: dict[str, dict[str, Any]] | None = None,
) -> SweepSpec:
    """Points of a plain grid: every combination of the given lists (input × output × rate × concurrency, with
    the sweep axis varying fastest so that each line runs from its lowest value up), once per VARIANT (a name and
    the fields it sets, e.g. chat template options) when given."""
    order = ("random_input_len", "random_output_len", "request_rate", "max_concurrency")
    names = [name for name in order if lists.get(name)]
    axis = next((name for name in ("max_concurrency", "request_rate") if len(lists.get(name) or []) > 1), None)
    if axis is not None:  # the axis last: it varies fastest
        names = [name for name in names if name != axis] + [axis]
    points = []
    named: list[tuple[str | None, dict[str, Any]]] = list(variants.items()) if variants else [(None, {})]
    for variant, fields in named:
        for values in product(*(lists[name] for name in names)):
            overrides = {**fields, **dict(zip(names, values, strict=True))}
            points.append(SweepPoint(point_id(overrides, variant), overrides, variant))
    asked = {"grid": lists, **inputs, **({"variants": variants} if variants else {})}
    return SweepSpec(label, points, axis, signature(asked))


def suite_spec(plan: SuitePlan, label: str, inputs: dict[str, Any]) -> SweepSpec:
    points = [SweepPoint(point_id(point.params, point.variant), point.params, point.variant) for point in plan.points]
    spec = SweepSpec(label, points, plan.suite.sweep_axis, signature({"suite": plan.suite.name, **inputs}))
    spec.suite = plan.suite.name
    spec.metadata["scale"] = plan.describe()
    return spec


def parse_list(flag: str, text: str | None, kind: type) -> list[Any] | None:
    """ "1,2,4" → [1, 2, 4]; request rates accept "inf"."""
    if text is None:
        return None
    values = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            value = kind(item)
        except ValueError as exc:
            raise ConfigError(
                f"--{flag.replace('_', '-')} {text!r}: {item!r} is not {'an integer' if kind is int else 'a number'}"
            ) from exc
        if isinstance(value, int | float) and value <= 0:
            raise ConfigError(f"--{flag.replace('_', '-')} {text!r}: values must be positive")
        values.append(value)
    if not values:
        raise ConfigError(f"--{flag.replace('_', '-')} needs at least one value")
    return values


def apply_overrides(base: BenchConfig, overrides: dict[str, Any]) -> BenchConfig:
    """BASE with each field in OVERRIDES set in whichever section (workload, load, ...) defines it."""
    data = base.model_dump()
    for key, value in overrides.items():
        section = _section_of(base, key)
        data[section][key] = math.inf if key == "request_rate" and value is None else value
    try:
        return BenchConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"invalid sweep point {overrides}: {problems}") from exc


def _section_of(config: BenchConfig, key: str) -> str:
    for name in SECTION_NAMES:
        section: BaseModel = getattr(config, name)
        if key in type(section).model_fields:
            return name
    raise ConfigError(f"sweep parameter {key!r} is not a field of the benchmark config")
