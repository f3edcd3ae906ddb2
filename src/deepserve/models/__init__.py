"""Model architecture specs, built-in presets, and the tiny DeepSeek-V3-architecture checkpoint."""

from deepserve.models.resolve import load_spec, resolve_model
from deepserve.models.spec import ModelSpec

__all__ = ["ModelSpec", "load_spec", "resolve_model"]
