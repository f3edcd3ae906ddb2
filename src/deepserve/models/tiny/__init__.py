"""deepserve's tiny checkpoints: DeepSeek's real architectures at a size vLLM's CPU build serves on two cores, so the
whole stack can be tested without a GPU. Each is a preset (`deepserve model list`), generated on first use into the
model cache, or written anywhere with `deepserve model tiny --arch ARCH [--mtp VARIANT] --out DIR`.

- deepserve/tiny-deepseek-v3 (`tiny`, `tiny-v3`): V3 (MLA + MoE), random weights; the default on a CPU machine.
- deepserve/tiny-deepseek-v3-mtp (`tiny-mtp`): V3 with one MTP layer, weights edited so that greedy decoding is a
  known byte sequence and every MTP draft is accepted (markov.py says how).
- deepserve/tiny-deepseek-v3-mtp-partial (`tiny-mtp-partial`): the same, but the drafts made after one byte in
  five are rejected: greedy acceptance near 2/3, 3/4, 1/2 with 1, 2, 3 drafts, exactly as
  markov.simulate_greedy_speculation predicts.
- deepserve/tiny-deepseek-v4 (`tiny-v4`): V4 (compressed sparse attention, hyper-connections, hash routing),
  random weights, V4's chat format (vLLM's deepseek_v4 encoder).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from deepserve.errors import ModelError, unknown_name
from deepserve.models.presets import TINY_MODEL_NAME
from deepserve.models.tiny import tokenizer as _tokenizer
from deepserve.models.tiny.markov import MTP_VARIANTS, MtpVariant, apply_markov_weights
from deepserve.models.tiny.tokenizer import (
    BOS,
    BYTE_TOKEN_OFFSET,
    EOS,
    PAD,
    TINY_VOCAB_SIZE,
    V4_SPECIALS,
    special_tokens,
    special_tokens_map,
)
from deepserve.models.tiny.v3 import CHAT_TEMPLATE, tiny_v3_config, v3_weights
from deepserve.models.tiny.v4 import tiny_v4_config, v4_weights

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "BOS",
    "BYTE_TOKEN_OFFSET",
    "CHAT_TEMPLATE",
    "EOS",
    "PAD",
    "TINY_ARCHES",
    "TINY_MODELS",
    "TINY_MODEL_NAME",
    "TINY_SEED",
    "TINY_VOCAB_SIZE",
    "TinyModel",
    "ensure_tiny_model",
    "is_tiny_model",
    "special_tokens",
    "tiny_config",
    "tiny_fingerprint",
    "tiny_model",
    "tokenizer_config",
    "tokenizer_json",
    "write_tiny_model",
]

TINY_SEED = 20241226  # DeepSeek-V3's release date
FORMAT_VERSION = 1  # bump when the files written change, so cached copies are rebuilt
VARIANTS_VERSION = 2  # the same for the models other than the default tiny V3 (whose cache key predates them)
TinyArch = Literal["deepseek-v3", "deepseek-v4"]
TINY_ARCHES: tuple[TinyArch, ...] = ("deepseek-v3", "deepseek-v4")


@dataclass(frozen=True)
class TinyModel:
    """One tiny checkpoint: its preset name, architecture and MTP variant."""

    name: str
    arch: TinyArch = "deepseek-v3"
    mtp: MtpVariant = "none"

    def config(self) -> dict[str, Any]:
        if self.arch == "deepseek-v4":
            return tiny_v4_config()
        return tiny_v3_config(mtp_layers=0 if self.mtp == "none" else 1)

    @property
    def chat_template(self) -> str | None:
        """V3's Jinja template; None for V4, which (like DeepSeek's release) has none: vLLM encodes its chats in
        Python (tokenizer mode deepseek_v4, picked from the architecture)."""
        return CHAT_TEMPLATE if self.arch == "deepseek-v3" else None

    @property
    def trailing_specials(self) -> list[str] | None:
        return V4_SPECIALS if self.arch == "deepseek-v4" else None

    def weights(self, seed: int = TINY_SEED) -> dict[str, np.ndarray]:
        config = self.config()
        if self.arch == "deepseek-v4":
            return v4_weights(config, seed)
        tensors = v3_weights(config, seed)
        if self.mtp != "none":
            apply_markov_weights(tensors, config, self.mtp, seed)
        return tensors


TINY_MODELS: dict[str, TinyModel] = {
    model.name: model
    for model in (
        TinyModel(TINY_MODEL_NAME),
        TinyModel("deepserve/tiny-deepseek-v3-mtp", mtp="full"),
        TinyModel("deepserve/tiny-deepseek-v3-mtp-partial", mtp="partial"),
        TinyModel("deepserve/tiny-deepseek-v4", arch="deepseek-v4"),
    )
}
TINY_ALIASES = {
    "tiny": TINY_MODEL_NAME,
    "tiny-v3": TINY_MODEL_NAME,
    "tiny-mtp": "deepserve/tiny-deepseek-v3-mtp",
    "tiny-mtp-partial": "deepserve/tiny-deepseek-v3-mtp-partial",
    "tiny-v4": "deepserve/tiny-deepseek-v4",
}


def is_tiny_model(name: str | None) -> bool:
    """Whether NAME (a preset name or alias, any case) is one of the tiny checkpoints."""
    return name is not None and _canonical(name) in TINY_MODELS


def tiny_model(name: str = TINY_MODEL_NAME) -> TinyModel:
    canonical = _canonical(name)
    if canonical not in TINY_MODELS:
        raise ModelError(unknown_name("tiny model", name, list(TINY_MODELS)))
    return TINY_MODELS[canonical]


def tiny_model_for(arch: str, mtp: str = "none") -> TinyModel:
    """The tiny model `deepserve model tiny --arch ARCH --mtp MTP` writes."""
    if arch not in TINY_ARCHES:
        raise ModelError(unknown_name("tiny architecture", arch, list(TINY_ARCHES)))
    if mtp not in MTP_VARIANTS:
        raise ModelError(unknown_name("MTP variant", mtp, list(MTP_VARIANTS)))
    for model in TINY_MODELS.values():
        if (model.arch, model.mtp) == (arch, mtp):
            return model
    raise ModelError(
        f"there is no tiny {arch} with MTP {mtp!r}: vLLM's CPU build does not run DeepSeek-V4's MTP layer, so the "
        "tiny V4 has none; use --arch deepseek-v3 for MTP"
    )


def _canonical(name: str) -> str:
    name = TINY_ALIASES.get(name.lower(), name)
    return next((key for key in TINY_MODELS if key.lower() == name.lower()), name)


def tiny_config(name: str = TINY_MODEL_NAME) -> dict[str, Any]:
    return tiny_model(name).config()


def tokenizer_json(model: TinyModel = TINY_MODELS[TINY_MODEL_NAME]) -> dict[str, Any]:
    return _tokenizer.tokenizer_json(model.trailing_specials)


def tokenizer_config(model: TinyModel = TINY_MODELS[TINY_MODEL_NAME]) -> dict[str, Any]:
    return _tokenizer.tokenizer_config(model.chat_template, model.config()["max_position_embeddings"])


# ---- writing -------------------------------------------------------------------------------------------------------


def write_tiny_model(out: Path, name: str = TINY_MODEL_NAME, seed: int = TINY_SEED) -> Path:
    """Write the tiny checkpoint NAME into OUT (created if needed) and return it."""
    model = tiny_model(name)
    out.mkdir(parents=True, exist_ok=True)
    config = model.config()
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": 0, "eos_token_id": 1, "do_sample": True, "temperature": 0.6, "top_p": 0.95},
    )
    _write_json(out / "tokenizer.json", tokenizer_json(model))
    _write_json(out / "tokenizer_config.json", tokenizer_config(model))
    _write_json(out / "special_tokens_map.json", special_tokens_map())
    from deepserve.models.safetensors_io import save_safetensors

    save_safetensors(model.weights(seed), out / "model.safetensors")
    return out


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True) + "\n", encoding="utf-8")


def tiny_fingerprint(name: str = TINY_MODEL_NAME, seed: int = TINY_SEED) -> str:
    """Changes whenever the files written would change: names the cache directory. The default tiny V3's stays
    what it was before the other tiny models existed, so its cached copies stay valid."""
    model = tiny_model(name)
    parts: list[Any] = [FORMAT_VERSION, seed, model.config(), CHAT_TEMPLATE]
    if model != TINY_MODELS[TINY_MODEL_NAME]:
        parts += [VARIANTS_VERSION, model.arch, model.mtp, tokenizer_json(model)]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:12]


def ensure_tiny_model(cache_dir: Path, name: str = TINY_MODEL_NAME) -> Path:
    """The cached tiny checkpoint NAME, made on first use. Written to a temporary directory and renamed, so a crash
    or a concurrent writer never leaves a half-written model in the cache."""
    model = tiny_model(name)
    target = cache_dir / f"{model.name.split('/')[-1]}-{tiny_fingerprint(model.name)}"
    if (target / "model.safetensors").is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tiny-", dir=cache_dir))
    try:
        write_tiny_model(staging, model.name)
        os.replace(staging, target)
    except OSError:
        if not (target / "model.safetensors").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
