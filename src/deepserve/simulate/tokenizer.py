"""The simulator's tokenizer: deepserve's tiny model's, one token per UTF-8 byte plus DeepSeek-V3's special tokens.

It counts exactly as the tiny checkpoint's tokenizer.json does under Hugging Face (`deepserve bench --tokenizer`
pointed at the tiny model, or its /tokenize fallback) and as vLLM serving the tiny model does, so a prompt built to N
tokens by the benchmark is N tokens here. It is written out in Python instead of loading `transformers`: a
simulated server must answer /tokenize and tokenize every prompt in microseconds. Special-token texts inside a
prompt become their single token, as the Hugging Face tokenizer splits added tokens out before the byte level.

Generated text is deterministic: the reply to any prompt is GENERATED_TEXT, repeated, one byte per token.
"""

from __future__ import annotations

import re
from typing import Any

from deepserve.models.tiny import BOS, BYTE_TOKEN_OFFSET, EOS, special_tokens

__all__ = [
    "BOS_ID", "BYTE_TOKEN_OFFSET", "EOS_ID", "ByteTokenizer", "generated_text", "generated_token", "varied_text",
]  # fmt: skip

BOS_ID = 0
EOS_ID = 1
GENERATED_TEXT = (
    "The simulated engine answers with this text, one byte per token, so that every reply is known in advance. "
)
_GENERATED = GENERATED_TEXT.encode()

USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
TOOL_OUTPUT_OPEN = "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>"
TOOL_OUTPUT_CLOSE = "<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"


class ChatFormatError(ValueError):
    """Chat messages that the template cannot render (the server answers 400 with this message)."""


class ByteTokenizer:
    """Encode, decode and render chats like the tiny model's tokenizer; ids fit the tiny vocabulary (320)."""

    def __init__(self) -> None:
        self._special_ids = {text: token_id for token_id, text in special_tokens()}
        self._special_texts = {token_id: text for text, token_id in self._special_ids.items()}
        ordered = sorted(self._special_ids, key=len, reverse=True)  # longest first: no special is cut short
        self._special_pattern = re.compile("|".join(re.escape(text) for text in ordered))
        self._markers = tuple({text[:2] for text in ordered})  # a cheap test before the regular expression

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = [BOS_ID] if add_special_tokens else []
        if not any(marker in text for marker in self._markers):
            ids.extend(byte + BYTE_TOKEN_OFFSET for byte in text.encode())
            return ids
        position = 0
        for match in self._special_pattern.finditer(text):
            ids.extend(byte + BYTE_TOKEN_OFFSET for byte in text[position : match.start()].encode())
            ids.append(self._special_ids[match.group()])
            position = match.end()
        ids.extend(byte + BYTE_TOKEN_OFFSET for byte in text[position:].encode())
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Bytes that do not form UTF-8 are replaced (U+FFFD), as the Hugging Face byte-level decoder does."""
        pieces: list[str] = []
        data = bytearray()
        for token_id in ids:
            byte = token_id - BYTE_TOKEN_OFFSET
            if 0 <= byte < 256:
                data.append(byte)
                continue
            if data:
                pieces.append(data.decode("utf-8", "replace"))
                data.clear()
            if not skip_special_tokens:
                pieces.append(self._special_texts.get(token_id, ""))
        if data:
            pieces.append(data.decode("utf-8", "replace"))
        return "".join(pieces)

    def render_chat(self, messages: list[Any], add_generation_prompt: bool = True) -> str:
        """The tiny model's chat template (DeepSeek-V3's format), written out: BOS, system prompts, then user,
        assistant and tool turns, then the generation prompt."""
        parts = [BOS]
        turns = [_message(m, i) for i, m in enumerate(messages)]
        parts += [content for role, content in turns if role == "system"]
        for role, content in turns:
            if role == "user":
                parts += [USER, content]
            elif role == "assistant":
                parts += [ASSISTANT, content, EOS]
            elif role == "tool":
                parts += [TOOL_OUTPUT_OPEN, content, TOOL_OUTPUT_CLOSE]
        if add_generation_prompt:
            parts.append(ASSISTANT)
        return "".join(parts)

    def chat_ids(self, messages: list[Any], add_generation_prompt: bool = True) -> list[int]:
        """What the server processes for chat MESSAGES: the rendered template, tokenized without adding BOS (the
        template has it), as vLLM does."""
        return self.encode(self.render_chat(messages, add_generation_prompt))


def _message(message: Any, index: int) -> tuple[str, str]:
    if not isinstance(message, dict):
        raise ChatFormatError(f"messages[{index}] must be an object with 'role' and 'content'")
    role = message.get("role")
    if role not in ("system", "user", "assistant", "tool", "developer", "function"):
        raise ChatFormatError(
            f"messages[{index}].role must be one of system, user, assistant, tool, developer, function; got {role!r}"
        )
    return role, _content_text(message.get("content"), index)  # the template leaves out developer and function


def _content_text(content: Any, index: int) -> str:
    """A string, or OpenAI content parts whose text parts are joined with newlines (vLLM's rendering for templates
    that expect a string); None is an empty turn (an assistant message with tool calls only)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ChatFormatError(
                    f"messages[{index}].content: only text parts ({{'type': 'text', 'text': ...}}) are supported"
                )
            texts.append(part["text"])
        return "\n".join(texts)
    raise ChatFormatError(f"messages[{index}].content must be a string or a list of text parts")


def generated_token(position: int) -> int:
    """The token the simulated model emits at output POSITION (0-based) of any request."""
    return _GENERATED[position % len(_GENERATED)] + BYTE_TOKEN_OFFSET


def generated_text(start: int, count: int) -> str:
    """The text of output tokens START .. START+COUNT-1 (ASCII: every token is one whole character)."""
    length = len(GENERATED_TEXT)
    begin = start % length
    if begin + count <= length:
        return GENERATED_TEXT[begin : begin + count]
    return "".join(GENERATED_TEXT[(start + i) % length] for i in range(count))


def varied_text(start: int, count: int) -> str:
    """The text of output tokens START .. START+COUNT-1 when each token is 1 to 8 characters long, as the tokens of
    real vocabularies differ (`--token-text varied`): a space and up to 7 letters, the length scrambled by the
    token's position (Knuth's multiplicative hash), so a client that counts tokens by their text cannot be exact."""
    return "".join(" " + "abcdefg"[: ((start + i) * 2654435761 >> 7) % 8] for i in range(count))
