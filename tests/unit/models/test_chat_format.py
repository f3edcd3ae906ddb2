from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepserve.models.chat_format import ChatFormat, chat_format, model_chat_format
from deepserve.models.presets import preset_names

F = ChatFormat


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("deepseek-ai/DeepSeek-V3", F.DEEPSEEK_V3),
        ("deepseek-ai/DeepSeek-V3-0324", F.DEEPSEEK_V3),
        ("cognitivecomputations/DeepSeek-V3-AWQ", F.DEEPSEEK_V3),
        ("deepseek-ai/DeepSeek-R1", F.DEEPSEEK_R1),
        ("deepseek-ai/DeepSeek-R1-0528", F.DEEPSEEK_R1),
        ("cognitivecomputations/DeepSeek-R1-AWQ", F.DEEPSEEK_R1),
        ("deepseek-ai/DeepSeek-V2-Lite", F.OTHER),
        ("tiny", F.DEEPSEEK_V3),
        ("tiny-mtp", F.DEEPSEEK_V3),
        ("tiny-v4", F.DEEPSEEK_V4),
    ],
)
def test_presets(name: str, expected: ChatFormat) -> None:
    assert model_chat_format(name) is expected


def test_every_preset_is_classified() -> None:
    """A preset that falls to OTHER gets no parsers: only models that are not DeepSeek chat models may."""
    others = [name for name in preset_names() if model_chat_format(name) is F.OTHER]
    assert others == ["deepseek-ai/DeepSeek-V2-Lite"]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("deepseek-ai/DeepSeek-V3.1", F.DEEPSEEK_V31),
        ("deepseek-ai/DeepSeek-V3.1-Terminus", F.DEEPSEEK_V31),
        ("deepseek-ai/DeepSeek-V3.2-Exp", F.DEEPSEEK_V32),
        ("nvidia/DeepSeek-V3.2-NVFP4", F.DEEPSEEK_V32),
        ("deepseek-ai/DeepSeek-V4-Flash", F.DEEPSEEK_V4),
        ("deepseek-ai/DeepSeek-V4-Pro-0813", F.DEEPSEEK_V4),
        ("deepseek-ai/DeepSeek-V4.1-Flash", F.DEEPSEEK_V41),
        ("nvidia/DeepSeek-R1-FP4", F.DEEPSEEK_R1),
        ("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", F.OTHER),  # a Qwen model in R1's voice: Qwen's parsers
        ("Qwen/Qwen3-8B", F.OTHER),
    ],
)
def test_hub_ids_by_name(name: str, expected: ChatFormat) -> None:
    assert chat_format(name) is expected


@pytest.mark.parametrize(
    ("architecture", "expected"),
    [
        ("DeepseekV32ForCausalLM", F.DEEPSEEK_V32),
        ("DeepseekV4ForCausalLM", F.DEEPSEEK_V4),
        ("DeepseekV41ForCausalLM", F.DEEPSEEK_V41),
        ("DeepseekV3ForCausalLM", F.DEEPSEEK_V3),
    ],
)
def test_architecture_decides_whatever_the_name(architecture: str, expected: ChatFormat) -> None:
    """A colleague's new preset, or a renamed local copy, lands in its family from its config alone."""
    assert chat_format("my-org/renamed-checkpoint", {"architectures": [architecture]}) is expected


def test_v3_architecture_releases_are_told_apart_by_name() -> None:
    v3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}
    assert chat_format("deepseek-ai/DeepSeek-V3.1", v3) is F.DEEPSEEK_V31
    assert chat_format("/models/DeepSeek-R1-0528", v3) is F.DEEPSEEK_R1


def test_local_directory_is_read(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["DeepseekV4ForCausalLM"]}))
    assert model_chat_format(str(tmp_path)) is F.DEEPSEEK_V4
    assert model_chat_format(str(tmp_path / "missing")) is F.OTHER
