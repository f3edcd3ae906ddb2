"""The chat flags each model needs on each engine: reasoning parser, tool-call parser, tokenizer mode. Chosen from the
model's chat format (models/chat_format.py), overridable by EngineConfig's fields (`none` / false switches one off).

Sources: vLLM's recipes (vllm-project/recipes models/deepseek-ai/*.yaml) and vLLM 0.32's registries
(vllm/reasoning/__init__.py, vllm/tool_parsers/__init__.py, vllm/tokenizers/registry.py: a test checks every name
against the installed vLLM); SGLang's cookbook (docs/basic_usage/deepseek_v32.md, the DeepSeek-V4 cookbook) and its
name lists (sgl-project/sglang python/sglang/srt/parser/reasoning_parser_names.py @0a933a2,
python/sglang/srt/function_call/parser_names.py @042de61; copies in tests/fixtures/sglang_parser_names.json).

Not set by default: the Jinja templates the recipes pass to vLLM for R1, V3 and V3.1 tool calls
(`examples/tool_chat_template_deepseek*.jinja` live in vLLM's repository, not in its wheel; pass one with
--chat-template PATH), and a server-wide thinking switch (vLLM's thinking defaults are the model's: V4 thinks unless
a request says `"chat_template_kwargs": {"thinking": false}`, V3.1 and V3.2 only when asked).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from deepserve.engines.config import EngineConfig
from deepserve.errors import ConfigError
from deepserve.models.chat_format import ChatFormat

OFF = "none"  # the value that switches a default parser off


@dataclass(frozen=True)
class ChatFlags:
    """An engine's chat settings for one model (None: the engine's own default)."""

    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    tokenizer_mode: str | None = None


VLLM_DEFAULTS = {
    ChatFormat.DEEPSEEK_V3: ChatFlags(tool_call_parser="deepseek_v3"),
    ChatFormat.DEEPSEEK_R1: ChatFlags(reasoning_parser="deepseek_r1", tool_call_parser="deepseek_v3"),
    ChatFormat.DEEPSEEK_V31: ChatFlags(reasoning_parser="deepseek_v3", tool_call_parser="deepseek_v31"),
    # vLLM has no deepseek_v32 reasoning parser: V3.2 thinks in V3.1's format
    ChatFormat.DEEPSEEK_V32: ChatFlags("deepseek_v3", "deepseek_v32", tokenizer_mode="deepseek_v32"),
    ChatFormat.DEEPSEEK_V4: ChatFlags("deepseek_v4", "deepseek_v4", tokenizer_mode="deepseek_v4"),
    ChatFormat.DEEPSEEK_V41: ChatFlags("deepseek_v41", "deepseek_v41", tokenizer_mode="deepseek_v41"),
}
SGLANG_DEFAULTS = {
    ChatFormat.DEEPSEEK_V3: ChatFlags(tool_call_parser="deepseekv3"),
    ChatFormat.DEEPSEEK_R1: ChatFlags(reasoning_parser="deepseek-r1", tool_call_parser="deepseekv3"),
    ChatFormat.DEEPSEEK_V31: ChatFlags(reasoning_parser="deepseek-v3", tool_call_parser="deepseekv31"),
    ChatFormat.DEEPSEEK_V32: ChatFlags(reasoning_parser="deepseek-v3", tool_call_parser="deepseekv32"),
    ChatFormat.DEEPSEEK_V4: ChatFlags(reasoning_parser="deepseek-v4", tool_call_parser="deepseekv4"),
    ChatFormat.DEEPSEEK_V41: ChatFlags(reasoning_parser="deepseek-v41", tool_call_parser="deepseekv41"),
}


def chat_flags(defaults: ChatFlags, config: EngineConfig) -> ChatFlags:
    """DEFAULTS with CONFIG's explicit choices applied (`none` switches a parser off)."""
    return ChatFlags(
        reasoning_parser=_chosen(config.reasoning_parser, defaults.reasoning_parser),
        tool_call_parser=_chosen(config.tool_call_parser, defaults.tool_call_parser),
        tokenizer_mode=_chosen(config.tokenizer_mode, defaults.tokenizer_mode),
    )


def _chosen(given: str | None, default: str | None) -> str | None:
    if given is None:
        return default
    return None if given.lower() == OFF else given


def auto_tool_choice(flags: ChatFlags, config: EngineConfig) -> bool:
    """Tool calls are parsed (`--enable-auto-tool-choice`) whenever there is a parser, unless switched off."""
    if config.enable_auto_tool_choice and flags.tool_call_parser is None:
        raise ConfigError(
            "--enable-auto-tool-choice needs a tool-call parser, and this model has none by default or it was "
            "switched off: name one with --tool-call-parser (e.g. deepseek_v3)"
        )
    return flags.tool_call_parser is not None and config.enable_auto_tool_choice is not False


def vllm_chat_args(flags: ChatFlags, config: EngineConfig) -> list[tuple[str, object]]:
    kwargs = config.default_chat_template_kwargs
    return [
        ("--tokenizer-mode", flags.tokenizer_mode),
        ("--reasoning-parser", flags.reasoning_parser),
        ("--tool-call-parser", flags.tool_call_parser),
        ("--enable-auto-tool-choice", auto_tool_choice(flags, config) or None),
        ("--chat-template", config.chat_template),
        ("--default-chat-template-kwargs", json.dumps(kwargs) if kwargs is not None else None),
    ]


def sglang_chat_args(flags: ChatFlags, config: EngineConfig) -> list[tuple[str, object]]:
    """SGLang parses tool calls whenever it has a parser (it has no auto-tool-choice switch)."""
    if config.default_chat_template_kwargs is not None:
        raise ConfigError(
            "--default-chat-template-kwargs is a vLLM flag; SGLang takes chat_template_kwargs per request only: "
            "send them in the request body (or let the gateway add them)"
        )
    return [
        ("--tokenizer-mode", flags.tokenizer_mode),
        ("--reasoning-parser", flags.reasoning_parser),
        ("--tool-call-parser", flags.tool_call_parser if config.enable_auto_tool_choice is not False else None),
        ("--chat-template", config.chat_template),
    ]
