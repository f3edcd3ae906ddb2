"""Built-in model presets: the config.json of published DeepSeek checkpoints, usable with no network.

The facts live in data/presets.json: per architecture a config.json (or a base config with keys set or removed)
with the source of every key, and per preset the figures its publisher gives (parameters, context, checkpoint
size), each with its source. DeepSeek-V3, V3-0324, R1 and R1-0528 share one architecture, as do V3.1 and
V3.1-Terminus, V3.2-Exp, V3.2 and V3.2-Speciale; V4's releases differ in weight formats and draft modules. The
generated tiny checkpoints (models/tiny.py) are presets too.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from deepserve.errors import ModelError, unknown_name
from deepserve.models.spec import ModelSpec

TINY_MODEL_NAME = "deepserve/tiny-deepseek-v3"


@dataclass(frozen=True)
class PublishedFact:
    """A figure the model's publisher gives, with where it says so."""

    name: str  # total_params, active_params, context_length, checkpoint_gb, ...
    value: float
    source: str  # the source's text: a URL or repository + path, and what it says


@dataclass(frozen=True)
class ExportOrigin:
    """The preset whose weights an export re-quantizes (an AWQ, NVFP4 or FP8 repack), with where it says so."""

    model: str
    source: str


@dataclass(frozen=True)
class Preset:
    name: str
    config_name: str  # the architecture config in data/presets.json
    aliases: tuple[str, ...]
    published: tuple[PublishedFact, ...]
    notes: str = ""
    quantized_from: ExportOrigin | None = None

    def fact(self, name: str) -> PublishedFact | None:
        return next((f for f in self.published if f.name == name), None)


@cache
def _data() -> dict[str, Any]:
    text = resources.files("deepserve.models").joinpath("data/presets.json").read_text()
    data: dict[str, Any] = json.loads(text)
    return data


def _resolved_config(name: str) -> tuple[dict[str, Any], dict[str, str]]:
    """Config NAME with its base's keys (set and removed as it says), and the source id of every key."""
    entry = _data()["configs"][name]
    if "base" in entry:
        config, sources = _resolved_config(entry["base"])
        config, sources = copy.deepcopy(config), dict(sources)
        if "*" in entry["sources"]:  # the derived file is a reconstruction: inherited keys cite it
            sources = dict.fromkeys(sources, entry["sources"]["*"])
    else:
        config, sources = copy.deepcopy(entry["config"]), {}
    for key in entry.get("remove", ()):
        config.pop(key, None)
        sources.pop(key, None)
    config.update(copy.deepcopy(entry.get("set", {})))
    sources.update({key: value for key, value in entry["sources"].items() if key != "*"})
    return config, sources


def config_sources(name: str) -> dict[str, str]:
    """Each config key of preset NAME → the text of its source."""
    preset = _preset(name)
    _, ids = _resolved_config(preset.config_name)
    texts = _data()["sources"]
    return {key: texts[source] for key, source in ids.items()}


@cache
def _presets() -> dict[str, Preset]:
    texts = _data()["sources"]
    presets = {}
    for entry in _data()["presets"]:
        facts = tuple(
            PublishedFact(name, float(fact["value"]), texts[fact["source"]])
            for name, fact in entry["published"].items()
        )
        origin = entry.get("quantized_from")
        presets[entry["name"]] = Preset(
            entry["name"],
            entry["config"],
            tuple(entry.get("aliases", ())),
            facts,
            entry.get("notes", ""),
            ExportOrigin(origin["name"], texts[origin["source"]]) if origin else None,
        )
    return presets


def _generated_configs() -> dict[str, dict[str, Any]]:
    """Presets whose config.json deepserve writes itself (the tiny checkpoints)."""
    from deepserve.models.tiny import TINY_MODELS

    return {name: model.config() for name, model in TINY_MODELS.items()}


def _aliases() -> dict[str, str]:
    from deepserve.models.tiny import TINY_ALIASES

    aliases = dict(TINY_ALIASES)
    for preset in _presets().values():
        aliases.update({alias: preset.name for alias in preset.aliases})
    return aliases


def preset_names() -> list[str]:
    return [*_presets(), *_generated_configs()]


def canonical_preset_name(name: str) -> str | None:
    """The preset's canonical name for NAME (case-insensitive, short aliases allowed), or None."""
    name = _aliases().get(name.lower(), name)
    by_lower = {key.lower(): key for key in preset_names()}
    return by_lower.get(name.lower())


def _canonical(name: str) -> str:
    canonical = canonical_preset_name(name)
    if canonical is None:
        raise ModelError(unknown_name("model preset", name, preset_names()))
    return canonical


def _preset(name: str) -> Preset:
    canonical = _canonical(name)
    if canonical not in _presets():
        raise ModelError(f"{canonical} is generated by deepserve (`deepserve model tiny`); it has no published facts")
    return _presets()[canonical]


def exports_of(name: str) -> list[str]:
    """The presets that re-quantize model NAME's weights (its AWQ, NVFP4 or FP8 exports); none for a name that is
    not a preset (a local directory, an unknown hub id)."""
    canonical = canonical_preset_name(name)
    return [p.name for p in _presets().values() if p.quantized_from and p.quantized_from.model == canonical]


def preset_info(name: str) -> Preset | None:
    """The published facts of preset NAME; None for a generated (tiny) preset."""
    canonical = _canonical(name)
    return _presets().get(canonical)


def preset_config(name: str) -> dict[str, Any]:
    canonical = _canonical(name)
    generated = _generated_configs()
    if canonical in generated:
        return copy.deepcopy(generated[canonical])
    config, _ = _resolved_config(_presets()[canonical].config_name)
    return config


def preset_spec(name: str) -> ModelSpec:
    canonical = _canonical(name)
    return ModelSpec.from_hf_config(preset_config(canonical), name=canonical)


DEEPSEEK_V3_CONFIG: dict[str, Any] = _resolved_config("deepseek-v3")[0]
# YaRN: trained at 4K positions, stretched 40x to 160K.
DEEPSEEK_V3_ROPE_SCALING: dict[str, Any] = DEEPSEEK_V3_CONFIG["rope_scaling"]
