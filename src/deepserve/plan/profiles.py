"""Engine profiles: the engine's own overheads on top of the kernel table (data/engine_profiles.json).

A profile has four overhead parameters (kernels per layer, prefill efficiency, step overhead, per-sequence
overhead), at most two of them fitted to published figures (`deepserve plan fit`) or to measured runs (the CPU
profile), and facts per engine version read from the engine's source (how kernels are launched, whether the MoE
kernel launches per expert). `select_profile` picks the profile for a deployment and says where it comes from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from deepserve.errors import ConfigError

PROFILES_PATH = Path(__file__).with_name("data") / "engine_profiles.json"
PARAMETER_NAMES = ("kernels_per_layer", "prefill_efficiency", "step_overhead_ms", "per_sequence_us")
MAX_FITTED = 2


@dataclass(frozen=True)
class EngineParameters:
    kernels_per_layer: float  # small kernels per layer per step, one launch each
    prefill_efficiency: float  # fraction of the kernel table's compute rate that prompt tokens' FLOPs reach
    step_overhead_ms: float = 0.0  # per step, besides kernels
    per_sequence_us: float = 0.0  # per running sequence per step

    def to_json(self) -> dict[str, float]:
        return {name: round(getattr(self, name), 6) for name in PARAMETER_NAMES}

    def with_values(self, values: dict[str, float]) -> EngineParameters:
        return replace(self, **values)


@dataclass(frozen=True)
class PerExpertMoE:
    """An MoE kernel that launches GEMMs per touched expert from the host (instead of one fused launch)."""

    launches_per_expert: int
    launch: str  # launch mode of those per-expert launches
    step_launch: str  # the launch mode it forces on the rest of the step
    source: str


@dataclass(frozen=True)
class VersionFacts:
    range: str
    launch: str
    moe_per_expert: dict[str, PerExpertMoE]
    source: str

    def step_launch(self, family: str) -> str:
        per_expert = self.moe_per_expert.get(family)
        return per_expert.step_launch if per_expert else self.launch


@dataclass(frozen=True)
class EngineProfile:
    name: str
    engine: str
    device: str  # gpu or cpu
    description: str
    parameters: EngineParameters
    fitted: tuple[str, ...]
    versions: tuple[VersionFacts, ...]
    default_version: str
    fit: dict[str, Any] = field(default_factory=dict)

    def facts_for(self, version: str | None) -> VersionFacts:
        wanted = version or self.default_version
        for facts in self.versions:
            if version_in_range(wanted, facts.range):
                return facts
        raise ConfigError(f"engine profile {self.name}: no version facts cover version {wanted}")


@dataclass(frozen=True)
class SelectedFactors:
    """The engine profile a plan uses (the name is kept from the fitted-factors model: the simulator passes it
    back to `Deployment.performance_model`)."""

    engine: EngineProfile
    parameters: EngineParameters
    version: str
    profile: str  # the profile's name
    provenance: str  # "fitted", "measured on ...", "transferred (...)"

    @property
    def facts(self) -> VersionFacts:
        return self.engine.facts_for(self.version)

    @property
    def factors(self) -> EngineParameters:
        return self.parameters

    def with_parameters(self, parameters: EngineParameters, provenance: str | None = None) -> SelectedFactors:
        return replace(self, parameters=parameters, provenance=provenance or self.provenance)


def version_key(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.strip().lstrip("v").split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def version_in_range(version: str, spec: str) -> bool:
    """`<0.8`, `>=0.8`, `>=0`: one bound per range, compared numerically component by component."""
    for op in ("<=", ">=", "<", ">", "=="):
        if spec.startswith(op):
            bound = version_key(spec[len(op) :])
            value = version_key(version)
            return {
                "<=": value <= bound,
                ">=": value >= bound,
                "<": value < bound,
                ">": value > bound,
                "==": value == bound,
            }[op]
    raise ConfigError(f"version range {spec!r} must start with <, <=, >, >= or ==")


def load_profiles(path: Path = PROFILES_PATH) -> dict[str, EngineProfile]:
    data = json.loads(path.read_text())
    return {name: _profile(name, raw) for name, raw in data["profiles"].items()}


def _profile(name: str, raw: dict[str, Any]) -> EngineProfile:
    parameters = EngineParameters(**{key: float(raw["parameters"][key]["value"]) for key in PARAMETER_NAMES})
    fitted = tuple(raw["fitted"])
    if len(fitted) > MAX_FITTED or not set(fitted) <= set(PARAMETER_NAMES):
        raise ConfigError(f"engine profile {name}: at most {MAX_FITTED} fitted parameters of {PARAMETER_NAMES}")
    versions = tuple(
        VersionFacts(
            range=entry["range"],
            launch=entry["launch"],
            moe_per_expert={family: PerExpertMoE(**facts) for family, facts in entry["moe_per_expert"].items()},
            source=entry["source"],
        )
        for entry in raw["versions"]
    )
    return EngineProfile(
        name=name,
        engine=raw["engine"],
        device=raw["device"],
        description=raw["description"],
        parameters=parameters,
        fitted=fitted,
        versions=versions,
        default_version=raw["default_version"],
        fit=raw.get("fit", {}),
    )


def device_of(hardware_class: str) -> str:
    return "cpu" if hardware_class == "cpu" else "gpu"


def select_profile(
    engine: str,
    hardware_class: str,
    version: str | None = None,
    profiles: dict[str, EngineProfile] | None = None,
    across_engines: bool = True,
) -> SelectedFactors | None:
    """The profile of ENGINE on this kind of device; else (when ACROSS_ENGINES) another engine's profile for the
    same kind of device, marked as transferred. None when nothing may stand in."""
    profiles = load_profiles() if profiles is None else profiles
    device = device_of(hardware_class)
    exact = [p for p in profiles.values() if p.engine == engine and p.device == device]
    if exact:
        chosen = exact[0]
        return _selected(chosen, version, _own_provenance(chosen))
    if not across_engines:
        return None
    donors = sorted((p for p in profiles.values() if p.device == device), key=lambda p: p.name)
    if not donors:
        return None
    donor = donors[0]
    note = f"transferred (no profile for {engine} on {device}: {donor.name}'s overheads, a rough estimate)"
    return _selected(donor, None, note)


def _own_provenance(profile: EngineProfile) -> str:
    if not profile.fitted:
        return f"nothing fitted: {profile.fit.get('provenance', 'values set by hand')}"
    where = profile.fit.get("fitted_on", "")
    return f"fitted ({', '.join(profile.fitted)}{'; ' + where if where else ''})"


def _selected(profile: EngineProfile, version: str | None, provenance: str) -> SelectedFactors:
    chosen_version = version or profile.default_version
    profile.facts_for(chosen_version)  # fail fast on a version no facts cover
    return SelectedFactors(profile, profile.parameters, chosen_version, profile.name, provenance)


def write_parameters(name: str, values: dict[str, float], fit: dict[str, Any], path: Path = PROFILES_PATH) -> Path:
    """Store fitted VALUES (and the fit's inputs) in profile NAME, leaving every other field as it is."""
    data = json.loads(path.read_text())
    profile = data["profiles"][name]
    for key, value in values.items():
        if key not in profile["fitted"]:
            raise ConfigError(f"engine profile {name}: {key} is not one of its fitted parameters {profile['fitted']}")
        profile["parameters"][key]["value"] = round(float(value), 6)
    profile["fit"] = fit
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    return path
