"""OpenAI's completions and chat completions as vLLM serves them: what a request asks for, checked as vLLM checks
it, and the bytes of its answer (SSE chunks, the usage chunk, `[DONE]`, or one JSON body).

Shapes follow vLLM's OpenAI server (vllm/entrypoints/openai/protocol.py): chunk ids `cmpl-<request id>` and
`chatcmpl-<request id>`, a chat stream opening with the assistant's role, `finish_reason` on the chunk with the
last token, `return_token_ids` adding `token_ids` to each choice and `prompt_token_ids` to the first chunk, the
usage chunk (choices empty) only with `stream_options.include_usage`, and errors as
`{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from deepserve.simulate.tokenizer import EOS_ID, ByteTokenizer, ChatFormatError, generated_text


class ApiError(Exception):
    """A request the server refuses, with the status and OpenAI error it answers."""

    def __init__(self, status: int, message: str, error_type: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.status}}


def error_body(status: int, message: str, error_type: str) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": error_type, "param": None, "code": status}})


@dataclass(frozen=True)
class Generation:
    """A completions or chat request, checked."""

    chat: bool
    model: str
    prompt_ids: list[int]
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    stream: bool
    include_usage: bool
    continuous_usage: bool
    return_token_ids: bool
    thinking: bool = True  # chat_template_kwargs turned thinking off ("thinking" or "enable_thinking": false)
    tool: str | None = None  # the first tool the request offers (unless tool_choice is "none"), for tool_calls


def parse_generation(
    body: Any, chat: bool, tokenizer: ByteTokenizer, max_model_len: int, models: tuple[str, ...]
) -> Generation:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model") or models[0]
    if model not in models:
        message = f"The model `{model}` does not exist. Valid aliases: {models[0]}."  # vLLM's words
        raise ApiError(404, message, "NotFoundError", "model")
    if body.get("n", 1) != 1:
        raise ApiError(400, "n must be 1: the simulator generates one choice per request", param="n")
    prompt_ids = _chat_ids(body, tokenizer) if chat else _prompt_ids(body, tokenizer)
    prompt_len = len(prompt_ids)
    if prompt_len >= max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{prompt_len} input tokens. Please reduce the length of the input messages.",
        )
    max_tokens = _max_tokens(body, chat, max_model_len - prompt_len)
    if prompt_len + max_tokens > max_model_len:
        raise ApiError(
            400,
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum context "
            f"length is {max_model_len} tokens and your request has {prompt_len} input tokens "
            f"({max_tokens} > {max_model_len} - {prompt_len}).",
            param="max_tokens",
        )
    min_tokens = _int(body, "min_tokens", 0, minimum=0)
    if min_tokens > max_tokens:
        raise ApiError(400, f"min_tokens ({min_tokens}) must be less than or equal to max_tokens ({max_tokens})")
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not stream:
        raise ApiError(400, "Stream options can only be defined when `stream=True`.", param="stream_options")
    if options is not None and not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", param="stream_options")
    options = options or {}
    return Generation(
        chat=chat,
        model=model,
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        ignore_eos=_bool(body, "ignore_eos"),
        stream=stream,
        include_usage=bool(options.get("include_usage")),
        continuous_usage=bool(options.get("continuous_usage_stats")),
        return_token_ids=_bool(body, "return_token_ids"),
        thinking=_thinking(body),
        tool=_offered_tool(body) if chat else None,
    )


def _offered_tool(body: dict[str, Any]) -> str | None:
    """The name of the first function in `tools`, None when there is none or tool_choice is "none"."""
    tools = body.get("tools")
    if not isinstance(tools, list) or not tools or body.get("tool_choice") == "none":
        return None
    function = tools[0].get("function") if isinstance(tools[0], dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) else None


def _thinking(body: dict[str, Any]) -> bool:
    """Whether the chat template is asked to think (DeepSeek's `thinking`, Qwen's `enable_thinking`; default on)."""
    kwargs = body.get("chat_template_kwargs")
    if not isinstance(kwargs, dict):
        return True
    return all(kwargs.get(key) is not False for key in ("thinking", "enable_thinking"))


def _prompt_ids(body: dict[str, Any], tokenizer: ByteTokenizer) -> list[int]:
    """A string, token ids, or a batch of one of either (vLLM accepts batches; the simulator serves one)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    add_special = body.get("add_special_tokens", True) is not False
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=add_special)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise ApiError(400, "batched prompts are not simulated: send one prompt per request", param="prompt")
    raise ApiError(400, "prompt must be a string or a non-empty list of token ids", param="prompt")


def _chat_ids(body: dict[str, Any], tokenizer: ByteTokenizer) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of messages", param="messages")
    try:
        return tokenizer.chat_ids(messages, add_generation_prompt=body.get("add_generation_prompt", True) is not False)
    except ChatFormatError as exc:
        raise ApiError(400, str(exc), param="messages") from None


def _max_tokens(body: dict[str, Any], chat: bool, room: int) -> int:
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(name)
    if value is None:
        return room  # vLLM's default: whatever the context has left
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ApiError(400, f"{name} must be a positive integer (got {value!r})", param=name)
    return value


def _int(body: dict[str, Any], name: str, default: int, minimum: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ApiError(400, f"{name} must be an integer of at least {minimum} (got {value!r})", param=name)
    return value


def _bool(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be true or false (got {value!r})", param=name)
    return value


# ---- answers --------------------------------------------------------------------------------------------------


class ReplyFormat:
    """The bytes of one request's answer. Stream events are built from pre-encoded pieces: only the text, the ids
    and the finish reason change from chunk to chunk."""

    def __init__(
        self,
        generation: Generation,
        request_id: str,
        created: int,
        text_of: Callable[[int, int], str] = generated_text,
        reasoning_tokens: int = 0,
        reasoning_field: str = "reasoning_content",
        tool_calls: bool = False,
    ) -> None:
        """REASONING_TOKENS: a chat answer's first tokens that stream as reasoning (in REASONING_FIELD), as vLLM
        with a reasoning parser sends a thinking model's; none when the request turned thinking off. TOOL_CALLS:
        a request that offers tools gets its answer (after the reasoning) as one call of the first tool, the tokens
        streaming as its arguments and the finish reason "tool_calls", as vLLM with a tool parser sends one."""
        self.generation = generation
        self.text_of = text_of  # (first output position, count) -> the text of those tokens
        self.reasoning_tokens = reasoning_tokens if generation.chat and generation.thinking else 0
        self.reasoning_field = reasoning_field
        self.tool = generation.tool if tool_calls else None
        self._tool_started = False
        chat = generation.chat
        self.response_id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.created = created
        head = {
            "id": self.response_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": generation.model,
        }
        self._head = orjson.dumps(head)[:-1]  # without the closing brace
        opening = b',"choices":[{"index":0,"delta":{"content":' if chat else b',"choices":[{"index":0,"text":'
        self._open = self._head + opening
        # chunks of one token that carry nothing else (no ids, no usage, not the last): the streaming hot path
        self.plain_chunks = (
            not generation.return_token_ids
            and not self.reasoning_tokens
            and not self.tool
            and not (generation.continuous_usage and generation.include_usage)
        )
        close = (b"}" if chat else b"") + b',"logprobs":null,"finish_reason":null'
        self._plain_open = b"data: " + self._open
        self._plain_close = close + (b"" if chat else b',"stop_reason":null') + b"}]}\n\n"

    def role_event(self) -> bytes:
        """The chat stream's first chunk: the assistant's role, no text."""
        extra = b""
        if self.generation.return_token_ids:
            extra = b',"prompt_token_ids":' + orjson.dumps(self.generation.prompt_ids)
        choice = b'[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]'
        return b"data: " + self._head + b',"choices":' + choice + extra + b"}\n\n"

    def token_event(self, first_position: int, token_ids: list[int], finish_reason: str | None, usage: bytes) -> bytes:
        """A chunk with TOKEN_IDS (output positions FIRST_POSITION…); USAGE is b"" or `,"usage":{…}`."""
        generation = self.generation
        if first_position < self.reasoning_tokens or self.tool:
            delta = self._phase_delta(first_position, token_ids)
            parts = [b"data: ", self._head, b',"choices":[{"index":0,"delta":', delta]
            finish_reason = "tool_calls" if self.tool and finish_reason in ("stop", "length") else finish_reason
        else:
            parts = [b"data: ", self._open, orjson.dumps(self._text(first_position, token_ids))]
            if generation.chat:
                parts.append(b"}")
        if generation.return_token_ids:
            parts += [b',"token_ids":', orjson.dumps(token_ids)]
            if first_position == 0 and not generation.chat:
                parts += [b',"prompt_token_ids":', orjson.dumps(generation.prompt_ids)]
        parts += [b',"logprobs":null,"finish_reason":', _reason(finish_reason)]
        if not generation.chat:
            parts.append(b',"stop_reason":null')
        parts += [b"}]", usage, b"}\n\n"]
        return b"".join(parts)

    def _phase_delta(self, first_position: int, token_ids: list[int]) -> bytes:
        """A chat delta whose first tokens may be reasoning and the rest, past the reasoning's end, the answer: as
        content, or as the arguments of the tool call (its id and name with the first piece)."""
        thinking = max(0, min(len(token_ids), self.reasoning_tokens - first_position))
        delta: dict[str, Any] = {}
        if thinking:
            delta[self.reasoning_field] = self.text_of(first_position, thinking)
        if len(token_ids) > thinking:
            text = self._text(first_position + thinking, token_ids[thinking:])
            if self.tool is None:
                delta["content"] = text
            else:
                delta["tool_calls"] = [self._tool_call_piece(text)]
        return orjson.dumps(delta)

    def _tool_call_piece(self, arguments: str) -> dict[str, Any]:
        call: dict[str, Any] = {"index": 0, "function": {"arguments": arguments}}
        if not self._tool_started:
            self._tool_started = True
            call |= {"id": "call_" + self.response_id, "type": "function"}
            call["function"]["name"] = self.tool
        return call

    def plain_token_events(self, first_position: int, count: int) -> list[bytes]:
        """COUNT chunks of one token each (output positions FIRST_POSITION…), none of them the last: what
        token_event builds for them when plain_chunks holds, in one pass."""
        text_of, head, tail = self.text_of, self._plain_open, self._plain_close
        return [head + orjson.dumps(text_of(first_position + i, 1)) + tail for i in range(count)]

    def usage_event(self, completion_tokens: int) -> bytes:
        return b"data: " + self._head + b',"choices":[],"usage":' + self.usage(completion_tokens) + b"}\n\n"

    def usage(self, completion_tokens: int) -> bytes:
        prompt_tokens = len(self.generation.prompt_ids)
        return orjson.dumps(
            {
                "prompt_tokens": prompt_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "completion_tokens": completion_tokens,
            }
        )

    def _text(self, first_position: int, token_ids: list[int]) -> str:
        """The text of output tokens, without the end-of-sequence token (a special token)."""
        count = len(token_ids) - (1 if token_ids and token_ids[-1] == EOS_ID else 0)
        return self.text_of(first_position, count)

    def full_response(self, token_ids: list[int], finish_reason: str) -> bytes:
        """The whole answer of a request that did not stream."""
        generation = self.generation
        text = self._text(0, token_ids)
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}
        if generation.chat:
            choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
        else:
            choice["text"] = text
        if generation.return_token_ids:
            choice["token_ids"] = token_ids
        body: dict[str, Any] = {
            "id": self.response_id,
            "object": "chat.completion" if generation.chat else "text_completion",
            "created": self.created,
            "model": generation.model,
            "choices": [choice],
            "usage": orjson.loads(self.usage(len(token_ids))),
        }
        if generation.return_token_ids:
            body["prompt_token_ids"] = generation.prompt_ids
        return orjson.dumps(body)


_REASONS = {None: b"null", "length": b'"length"', "stop": b'"stop"', "abort": b'"abort"'}


def _reason(finish_reason: str | None) -> bytes:
    return _REASONS.get(finish_reason) or orjson.dumps(finish_reason)


DONE_EVENT = b"data: [DONE]\n\n"
