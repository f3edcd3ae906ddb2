"""Engine profiles: the engine's own overheads on top of the kernel table (data/engine_profiles.json).

A profile has five overhead parameters (kernels per layer, prefill efficiency, per-request overhead, step
overhead, per-sequence overhead), at most three of them fitted to published figures (`deepserve plan fit`) or to
measured runs (the CPU profile), and facts per engine version read from the engine's source (how kernels are
launched, whether the MoE kernel launches per expert, whether prompts share a step with decodes, what max_num_seqs
caps). `select_profile` picks the profile for a deployment and says where it comes from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from deepserve.errors import ConfigError

PROFILES_PATH = Path(__file__).with_name("data") / "engine_profiles.json"
PARAMETER_NAMES = (
    "kernels_per_layer",
    "prefill_efficiency",
    "request_overhead_ms",
    "cross_node_latency_us",
    "step_overhead_ms",
    "per_sequence_us",
)
# Five observables pin five parameters: a single user's TPOT (the step's small kernels), a single user's TTFT at a
# short prompt (the per-request overhead), how TTFT and saturated throughput grow with the prompt (the prefill
# path's efficiency), TPOT of a tensor-parallel group spread over nodes (its all-reduces' latency) and how TPOT grows
# with the running batch beyond its kernels (CPU time per sequence). Each fitted parameter also has a prior (value,
# factor, source) that holds it where a fold's rows say nothing about it.
MAX_FITTED = 5


@dataclass(frozen=True)
class EngineParameters:
    kernels_per_layer: float  # small kernels per layer per step, one launch each
    prefill_efficiency: float  # fraction of the kernel table's GEMM rate that prompt tokens' FLOPs reach
    request_overhead_ms: float = 0.0  # per request, before its first token, outside the GPU's steps
    cross_node_latency_us: float = 0.0  # one all-reduce across nodes as the engine issues it (0: the kernel table's)
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
    mixed_prefill: bool = True  # prompts (chunks) share a step with decodes; False: prefill steps of their own
    prefill_launch: str | None = None  # launch mode of steps that carry prompt tokens (None: as `launch`)
    max_num_seqs_per_micro_batch: bool = False  # max_num_seqs caps each PP micro-batch (vLLM V0), else all of them
    step_overhead_ms: float = 0.0  # a version's own extra time per step (slower kernels than the profile's today)
    # the engine's own running-request cap when the command sets none, by model architecture (config.json's
    # `architectures`), over all data-parallel ranks together: each rank runs its share
    default_running_requests: dict[str, int] = field(default_factory=dict)
    # the engine's own KV pool for a model architecture where it admits fewer requests than the planner's cache
    # model: its sliding-window pool's share of the full pool's tokens (SGLang's --swa-full-tokens-ratio for
    # DeepSeek-V4, plan/engine_pools.py)
    swa_full_tokens_ratio: dict[str, float] = field(default_factory=dict)
    # with data-parallel attention each rank prefills at most the step's token budget divided by this: "dp" for
    # the DP size (SGLang >= 0.4.5's --chunked-prefill-size // dp_size), or a number (SGLang 0.4.4 and before
    # halved it); None: every rank has the whole budget (vLLM's DP engines)
    dp_attention_chunk_divisor: int | str | None = None

    def prefill_chunk_per_rank(self, budget: int, dp: int) -> int:
        """Prompt tokens one of DP data-parallel attention ranks may prefill in a step of BUDGET tokens."""
        divisor = dp if self.dp_attention_chunk_divisor == "dp" else self.dp_attention_chunk_divisor
        if dp <= 1 or divisor is None:
            return budget
        return max(budget // int(divisor), 1)

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
    priors: dict[str, tuple[float, float]] = field(default_factory=dict)  # name -> (value, factor of spread)

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


@lru_cache(maxsize=256)
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
    """The profiles in PATH, read once per version of the file (`plan fit --write` rewrites it)."""
    return dict(_load_profiles(path, path.stat().st_mtime_ns))


@lru_cache(maxsize=4)
def _load_profiles(path: Path, _version: int) -> dict[str, EngineProfile]:
    data = json.loads(path.read_text())
    return {name: _profile(name, raw) for name, raw in data["profiles"].items()}


def _profile(name: str, raw: dict[str, Any]) -> EngineProfile:
    parameters = EngineParameters(
        **{key: float(raw["parameters"][key]["value"]) for key in PARAMETER_NAMES if key in raw["parameters"]}
    )
    fitted = tuple(raw["fitted"])
    if len(fitted) > MAX_FITTED or not set(fitted) <= set(PARAMETER_NAMES):
        raise ConfigError(f"engine profile {name}: at most {MAX_FITTED} fitted parameters of {PARAMETER_NAMES}")
    versions = tuple(_version_facts(entry) for entry in raw["versions"])
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
        priors={
            key: (float(entry["prior"]["value"]), float(entry["prior"]["factor"]))
            for key, entry in raw["parameters"].items()
            if "prior" in entry
        },
    )


def _version_facts(entry: dict[str, Any]) -> VersionFacts:
    return VersionFacts(
        range=entry["range"],
        launch=entry["launch"],
        moe_per_expert={family: PerExpertMoE(**facts) for family, facts in entry["moe_per_expert"].items()},
        source=entry["source"],
        mixed_prefill=bool(entry.get("mixed_prefill", True)),
        prefill_launch=entry.get("prefill_launch"),
        max_num_seqs_per_micro_batch=bool(entry.get("max_num_seqs_per_micro_batch", False)),
        step_overhead_ms=float(entry.get("step_overhead_ms", 0.0)),
        default_running_requests={
            architecture: int(count)
            for architecture, count in entry.get("default_running_requests", {}).get("by_architecture", {}).items()
        },
        swa_full_tokens_ratio={
            architecture: float(ratio)
            for architecture, ratio in entry.get("swa_pool", {}).get("by_architecture", {}).items()
        },
        dp_attention_chunk_divisor=_chunk_divisor(entry),
    )


def _chunk_divisor(entry: dict[str, Any]) -> int | str | None:
    divisor = entry.get("dp_attention_prefill_chunk", {}).get("divide_by")
    if divisor is None or divisor == "dp" or (isinstance(divisor, int) and divisor >= 1):
        return divisor
    raise ConfigError(
        f'engine profile version {entry["range"]}: dp_attention_prefill_chunk.divide_by is {divisor!r}; give "dp" '
        "(the DP size) or a whole number of at least 1"
    )


ROCM_CLASSES = frozenset({"cdna3", "cdna4"})


def device_of(hardware_class: str) -> str:
    """The kind of device an engine profile is for: cpu, rocm (AMD Instinct), gpu (NVIDIA, CUDA)."""
    if hardware_class == "cpu":
        return "cpu"
    return "rocm" if hardware_class in ROCM_CLASSES else "gpu"


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
