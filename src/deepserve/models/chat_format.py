"""Which chat format a model speaks: what decides the reasoning parser, the tool-call parser, the tokenizer mode and
the thinking switch an engine needs for it (engines/chat_defaults.py holds those per engine).

DeepSeek's formats follow the architecture where the architecture changed (V3.2's sparse attention came with its own
encoder, V4's and V4.1's too) and the release where only the weights did (R1 and V3.1 are DeepseekV3ForCausalLM
checkpoints, told apart by name). To add a model: if its config names a new architecture, add it to
_BY_ARCHITECTURE; if it reuses one, add a name pattern to _BY_NAME (checked in order, first match wins).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from enum import Enum
from pathlib import Path
from typing import Any


class ChatFormat(str, Enum):
    DEEPSEEK_V3 = "deepseek-v3"  # V3, V3-0324, the tiny V3: no thinking; V3's tool-call tokens
    DEEPSEEK_R1 = "deepseek-r1"  # R1, R1-0528: always thinks (<think>...</think>); V3's tool-call tokens
    DEEPSEEK_V31 = "deepseek-v3.1"  # V3.1, V3.1-Terminus: thinking on request; its own tool-call format
    DEEPSEEK_V32 = "deepseek-v3.2"  # V3.2-Exp, V3.2, V3.2-Speciale: Python encoder; V3.1-style thinking switch
    DEEPSEEK_V4 = "deepseek-v4"  # V4-Flash, V4-Pro, the tiny V4: Python encoder; thinks unless told not to; DSML
    DEEPSEEK_V41 = "deepseek-v4.1"  # V4.1-Flash: its own encoder and parsers
    OTHER = "other"  # none of the above: no defaults

    def __str__(self) -> str:
        return self.value


# config.json "architectures" / "model_type" -> format (vLLM 0.32's registry names them; vllm/config/model.py picks
# the tokenizer mode from the same names)
_BY_ARCHITECTURE = {
    "DeepseekV41ForCausalLM": ChatFormat.DEEPSEEK_V41,
    "deepseek_v41": ChatFormat.DEEPSEEK_V41,
    "DeepseekV4ForCausalLM": ChatFormat.DEEPSEEK_V4,
    "DeepseekV4ForConditionalGeneration": ChatFormat.DEEPSEEK_V4,
    "deepseek_v4": ChatFormat.DEEPSEEK_V4,
    "DeepseekV32ForCausalLM": ChatFormat.DEEPSEEK_V32,
    "deepseek_v32": ChatFormat.DEEPSEEK_V32,
}
# Name patterns (case-insensitive, searched in the model's name or path), for checkpoints whose architecture is
# V3's, and for hub ids whose config is not known here.
_BY_NAME = (
    (r"deepseek-v4\.1|v4\.1-", ChatFormat.DEEPSEEK_V41),
    (r"deepseek-v4|tiny-deepseek-v4", ChatFormat.DEEPSEEK_V4),
    (r"deepseek-v3\.2|v3_2", ChatFormat.DEEPSEEK_V32),
    (r"deepseek-v3\.1|v3_1|terminus", ChatFormat.DEEPSEEK_V31),
    (r"deepseek-r1(?!-distill)", ChatFormat.DEEPSEEK_R1),
    (r"deepseek-v3|tiny-deepseek-v3", ChatFormat.DEEPSEEK_V3),
)
_V3_ARCHITECTURES = {"DeepseekV3ForCausalLM", "deepseek_v3"}


def chat_format(name: str, config: Mapping[str, Any] | None = None) -> ChatFormat:
    """The chat format of the model NAME (a preset, hub id or path) with config.json CONFIG (None: not known)."""
    keys = [*(config or {}).get("architectures", []), (config or {}).get("model_type", "")]
    for key in keys:
        if key in _BY_ARCHITECTURE:
            return _BY_ARCHITECTURE[key]
    by_name = next((fmt for pattern, fmt in _BY_NAME if re.search(pattern, name, re.IGNORECASE)), None)
    if by_name is not None:
        return by_name
    if any(key in _V3_ARCHITECTURES for key in keys):
        return ChatFormat.DEEPSEEK_V3
    return ChatFormat.OTHER


def model_chat_format(name: str) -> ChatFormat:
    """The chat format of NAME, reading its config where one is known here: a preset's, or a local directory's."""
    return chat_format(name, _known_config(name))


def _known_config(name: str) -> Mapping[str, Any] | None:
    from deepserve.models.presets import canonical_preset_name, preset_config

    if canonical_preset_name(name) is not None:
        return preset_config(name)
    config_path = Path(name).expanduser() / "config.json"
    try:
        loaded = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return None
    return loaded if isinstance(loaded, dict) else None
