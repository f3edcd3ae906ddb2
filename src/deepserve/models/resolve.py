"""From what the user typed (a preset, a Hugging Face id, a local path, or nothing) to what an engine loads."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from deepserve.config import deepserve_home
from deepserve.errors import ModelError
from deepserve.models.presets import TINY_MODEL_NAME, canonical_preset_name, preset_names, preset_spec
from deepserve.models.spec import ModelSpec
from deepserve.models.tiny import ensure_tiny_model, is_tiny_model, tiny_model


@dataclass(frozen=True)
class ResolvedModel:
    """The model to launch: what the engine loads (a path or hub id) and what clients call it."""

    source: str
    served_name: str
    on_cpu: bool


def models_cache_dir() -> Path:
    return deepserve_home() / "models"


def resolve_model(name: str | None, on_cpu: bool) -> ResolvedModel:
    """NAME=None means the tiny default, which only makes sense where there is no GPU to serve a real model."""
    if name is None:
        if not on_cpu:
            raise ModelError(
                "this machine has a GPU: name the model to serve with --model, e.g. "
                "--model deepseek-ai/DeepSeek-V3-0324 (presets: `deepserve model list`), "
                "or --model tiny for a smoke test"
            )
        name = TINY_MODEL_NAME
    if is_tiny_model(name):
        tiny = tiny_model(name)
        return ResolvedModel(str(ensure_tiny_model(models_cache_dir(), tiny.name)), tiny.name, on_cpu)
    path = Path(name).expanduser()
    if path.exists() or _looks_like_path(name):
        _check_model_dir(path)
        return ResolvedModel(str(path.resolve()), name.rstrip("/"), on_cpu)
    canonical = canonical_preset_name(name)
    return ResolvedModel(canonical or name, canonical or name, on_cpu)


def load_spec(name: str) -> ModelSpec:
    """The architecture of a preset or of a local directory with a config.json."""
    path = Path(name).expanduser()
    if canonical_preset_name(name) is not None and not path.is_dir():
        return preset_spec(name)
    if path.exists() or _looks_like_path(name):
        _check_model_dir(path)
        return ModelSpec.from_dir(path)
    raise ModelError(
        f"{name!r} is neither a preset nor a local directory with a config.json "
        f"(no network look-ups are made); presets: {', '.join(preset_names())}"
    )


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1


def _check_model_dir(path: Path) -> None:
    if not path.is_dir():
        raise ModelError(f"model path {path} does not exist or is not a directory")
    if not (path / "config.json").is_file():
        raise ModelError(
            f"model directory {path} has no config.json; point --model at a Hugging Face checkpoint directory "
            "(or write the tiny one with `deepserve model tiny --out DIR`)"
        )
