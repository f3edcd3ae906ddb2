"""OpenAI's completions and chat completions as vLLM serves them: what a request asks for, checked as vLLM checks
it, and the bytes of its answer (SSE chunks, the usage chunk, `[DONE]`, or one JSON body).

Shapes follow vLLM's OpenAI server (vllm/entrypoints/openai/protocol.py): chunk ids `cmpl-<request id>` and
`chatcmpl-<request id>`, a chat stream opening with the assistant's role, `finish_reason` on the chunk with the
last token, `return_token_ids` adding `token_ids` to each choice and `prompt_token_ids` to the first chunk, the
usage chunk (choices empty) only with `stream_options.include_usage`, and errors as
`{"error": {"message", "type", "param", "code"}}`.

Reasoning models and tools (chat only, as vLLM's reasoning and tool parsers): with `--reasoning-tokens N` the first N
output tokens are reasoning, in vLLM 0.32's `reasoning` field (or `reasoning_content`, the older vLLM's and SGLang's,
with `--reasoning-field`), the rest the answer; vLLM 0.32's usage then counts them in
`completion_tokens_details.reasoning_tokens` (the older field's servers do not). With `--tool-calls` a request that
offers tools (and does not say `tool_choice: "none"`) is answered with a call of the first function (or the one
`tool_choice` names): its arguments `{"text": "<the answer>"}` streamed in pieces as vLLM's tool parsers stream them
(the first delta with the call's id, type and name), `finish_reason` "tool_calls".

The Responses API (`/v1/responses`, as vLLM 0.32 serves it without harmony): `instructions` and `input` rendered as a
chat, `max_output_tokens`; the answer a `response` object whose usage says input_tokens, output_tokens and
output_tokens_details.reasoning_tokens; a stream of typed events (`event: response.created`, `response.in_progress`,
the reasoning item's `response.reasoning_text.delta`s, the message's `response.output_text.delta`s, their done
events, `response.completed` with the whole response), without `[DONE]`.
"""

from __future__ import annotations

import dataclasses
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
    reasoning_tokens: int = 0  # chat: the first this many output tokens are reasoning
    reasoning_field: str = "reasoning"  # the delta's and message's field for them
    tool_name: str | None = None  # chat: the reply is a call of this function
    responses: bool = False  # a Responses API request (chat-rendered input, typed events)
    kv_transfer: dict[str, Any] | None = None  # a prefill for a remote decode: the kv_transfer_params to answer with
    remote_prefill: bool = False  # a decode whose prompt's KV cache was prefilled elsewhere
    store: bool = False  # a Responses API answer kept for GET /v1/responses/{id}


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
    )


def parse_responses(body: Any, tokenizer: ByteTokenizer, max_model_len: int, models: tuple[str, ...]) -> Generation:
    """A Responses API request, checked as vLLM checks it: `instructions` and `input` are rendered as chat messages,
    `max_output_tokens` caps the answer."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    chat = {
        "model": body.get("model"),
        "messages": _responses_messages(body),
        "max_tokens": body.get("max_output_tokens"),
        "stream": body.get("stream"),
        "ignore_eos": body.get("ignore_eos"),
    }
    generation = parse_generation(chat, True, tokenizer, max_model_len, models)
    return dataclasses.replace(generation, responses=True, store=body.get("store", True) is not False)


def _responses_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if isinstance(body.get("instructions"), str):
        messages.append({"role": "system", "content": body["instructions"]})
    given = body.get("input")
    if isinstance(given, str):
        return [*messages, {"role": "user", "content": given}]
    if not isinstance(given, list) or not given or not all(isinstance(item, dict) for item in given):
        raise ApiError(400, "input must be a string or a non-empty list of input items", param="input")
    for item in given:
        role = item.get("role") if item.get("role") in ("user", "assistant", "system", "developer") else "tool"
        content = item.get("content", item.get("output", ""))
        if isinstance(content, list):  # input_text / output_text parts
            content = "\n".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
        messages.append({"role": role, "content": content if isinstance(content, str) else ""})
    return messages


def called_tool(body: dict[str, Any]) -> str | None:
    """The function a request with tools gets called: the one `tool_choice` names, else the first; none when it
    offers no function or says `tool_choice: "none"`."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if not isinstance(tools, list) or choice == "none":
        return None
    if isinstance(choice, dict):
        named = (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), dict) else None
        if isinstance(named, str):
            return named
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return str(function["name"])
    return None


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
    ) -> None:
        self.generation = generation
        self.text_of = text_of  # (first output position, count) -> the text of those tokens
        chat = generation.chat
        self.response_id = ("resp_" if generation.responses else "chatcmpl-" if chat else "cmpl-") + request_id
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
        self.shaped = chat and (generation.reasoning_tokens > 0 or generation.tool_name is not None)
        self.typed = ResponsesEvents(self) if generation.responses else None
        self.plain_chunks = (
            not generation.return_token_ids
            and not (generation.continuous_usage and generation.include_usage)
            and not self.shaped
            and self.typed is None
        )
        close = (b"}" if chat else b"") + b',"logprobs":null,"finish_reason":null'
        self._plain_open = b"data: " + self._open
        self._plain_close = close + (b"" if chat else b',"stop_reason":null') + b"}]}\n\n"

    def opening_events(self) -> list[bytes]:
        """What a stream sends before its first token: a chat's role chunk, a Responses stream's created and
        in-progress events."""
        if self.typed is not None:
            return self.typed.opening()
        return [self.role_event()] if self.generation.chat else []

    def closing_events(self, completion_tokens: int, usage: bool) -> list[bytes]:
        """What a stream sends after its last token: the usage chunk (when USAGE) and `[DONE]`; a Responses stream
        its done events and `response.completed` with the whole response."""
        if self.typed is not None:
            return self.typed.closing(completion_tokens)
        return [*([self.usage_event(completion_tokens)] if usage else []), DONE_EVENT]

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
        if self.typed is not None:
            return self.typed.tokens(first_position, len(token_ids) - (1 if token_ids[-1:] == [EOS_ID] else 0))
        if self.shaped:
            return self._shaped_event(first_position, token_ids, finish_reason, usage)
        text = orjson.dumps(self._text(first_position, token_ids))
        parts = [b"data: ", self._open, text]
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

    def plain_token_events(self, first_position: int, count: int) -> list[bytes]:
        """COUNT chunks of one token each (output positions FIRST_POSITION…), none of them the last: what
        token_event builds for them when plain_chunks holds, in one pass."""
        text_of, head, tail = self.text_of, self._plain_open, self._plain_close
        return [head + orjson.dumps(text_of(first_position + i, 1)) + tail for i in range(count)]

    def usage_event(self, completion_tokens: int) -> bytes:
        return b"data: " + self._head + b',"choices":[],"usage":' + self.usage(completion_tokens) + b"}\n\n"

    def usage(self, completion_tokens: int) -> bytes:
        return orjson.dumps(self.usage_dict(completion_tokens))

    def usage_dict(self, completion_tokens: int) -> dict[str, Any]:
        generation = self.generation
        prompt_tokens = len(generation.prompt_ids)
        usage: dict[str, Any] = {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
        }
        if generation.chat and generation.reasoning_tokens and generation.reasoning_field == "reasoning":
            usage["completion_tokens_details"] = {
                "reasoning_tokens": min(generation.reasoning_tokens, completion_tokens)
            }
        return usage

    # ---- reasoning and tool calls (chat) ------------------------------------------------------------------------

    def _shaped_event(
        self, first_position: int, token_ids: list[int], finish_reason: str | None, usage: bytes
    ) -> bytes:
        count = len(token_ids) - (1 if token_ids and token_ids[-1] == EOS_ID else 0)
        delta, calling = self._delta(first_position, count, finish_reason is not None)
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None}
        choice["finish_reason"] = "tool_calls" if calling and finish_reason is not None else finish_reason
        if self.generation.return_token_ids:
            choice["token_ids"] = token_ids
        event = orjson.dumps({**self._head_fields(), "choices": [choice]})
        return b"data: " + event[:-1] + usage + b"}\n\n"

    def _head_fields(self) -> dict[str, Any]:
        return {"id": self.response_id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.generation.model}  # fmt: skip

    def _delta(self, first: int, count: int, last: bool) -> tuple[dict[str, Any], bool]:
        """The delta of output tokens FIRST…FIRST+COUNT-1: reasoning, then answer text or tool-call arguments; and
        whether a tool call was begun by now."""
        generation = self.generation
        reasoning = max(0, min(count, generation.reasoning_tokens - first))
        delta: dict[str, Any] = {}
        if reasoning:
            delta[generation.reasoning_field] = self.text_of(first, reasoning)
        start, answer = first + reasoning, count - reasoning
        calling = generation.tool_name is not None and (answer > 0 or start > generation.reasoning_tokens)
        if calling:
            opening = start == generation.reasoning_tokens
            arguments = ('{"text": "' if opening else "") + self.text_of(start, answer) + ('"}' if last else "")
            call: dict[str, Any] = {"index": 0, "function": {"arguments": arguments}}
            if opening:
                call = {"index": 0, "id": self.tool_call_id, "type": "function",
                        "function": {"name": generation.tool_name, "arguments": arguments}}  # fmt: skip
            delta["tool_calls"] = [call]
        elif answer or not delta:
            delta["content"] = self.text_of(start, answer)
        return delta, calling

    @property
    def tool_call_id(self) -> str:
        return "chatcmpl-tool-" + self.response_id.removeprefix("chatcmpl-")

    def _shaped_message(self, count: int) -> tuple[dict[str, Any], bool]:
        """The whole reply's message (not streamed), and whether it is a tool call."""
        generation = self.generation
        reasoning = min(count, generation.reasoning_tokens)
        message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": []}
        if reasoning:
            message[generation.reasoning_field] = self.text_of(0, reasoning)
        answer = self.text_of(reasoning, count - reasoning)
        if generation.tool_name is not None and count > reasoning:
            arguments = '{"text": "' + answer + '"}'
            call = {"id": self.tool_call_id, "type": "function",
                    "function": {"name": generation.tool_name, "arguments": arguments}}  # fmt: skip
            message["tool_calls"] = [call]
            return message, True
        message["content"] = answer
        return message, False

    def _text(self, first_position: int, token_ids: list[int]) -> str:
        """The text of output tokens, without the end-of-sequence token (a special token)."""
        count = len(token_ids) - (1 if token_ids and token_ids[-1] == EOS_ID else 0)
        return self.text_of(first_position, count)

    def full_response(self, token_ids: list[int], finish_reason: str) -> bytes:
        """The whole answer of a request that did not stream."""
        generation = self.generation
        if self.typed is not None:
            count = len(token_ids) - (1 if token_ids[-1:] == [EOS_ID] else 0)
            return orjson.dumps(self.typed.response(count, len(token_ids)))
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}
        if self.shaped:
            count = len(token_ids) - (1 if token_ids and token_ids[-1] == EOS_ID else 0)
            choice["message"], calling = self._shaped_message(count)
            choice["finish_reason"] = "tool_calls" if calling else finish_reason
        elif generation.chat:
            choice["message"] = {"role": "assistant", "content": self._text(0, token_ids), "tool_calls": []}
        else:
            choice["text"] = self._text(0, token_ids)
        if generation.return_token_ids:
            choice["token_ids"] = token_ids
        body: dict[str, Any] = {
            "id": self.response_id,
            "object": "chat.completion" if generation.chat else "text_completion",
            "created": self.created,
            "model": generation.model,
            "choices": [choice],
            "usage": self.usage_dict(len(token_ids)),
        }
        if generation.return_token_ids:
            body["prompt_token_ids"] = generation.prompt_ids
        if generation.kv_transfer is not None:
            body["kv_transfer_params"] = generation.kv_transfer
        return orjson.dumps(body)


class ResponsesEvents:
    """A Responses API answer: the response object, and its stream of typed events (a reasoning item, then the
    message item; each opened, filled with deltas and closed), numbered in order."""

    def __init__(self, reply: ReplyFormat) -> None:
        self.reply = reply
        self.generation = reply.generation
        self.sequence = 0
        self.text_tokens = 0  # output tokens with text streamed so far
        self.final: dict[str, Any] | None = None  # the response as response.completed gave it
        self.reasoning_id = "rs_" + reply.response_id.removeprefix("resp_")
        self.message_id = "msg_" + reply.response_id.removeprefix("resp_")

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = orjson.dumps({"type": kind, "sequence_number": self.sequence, **fields})
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    def response(self, count: int, completion_tokens: int, status: str = "completed") -> dict[str, Any]:
        """The response object after COUNT answer tokens (COMPLETION_TOKENS with the end of sequence)."""
        generation = self.generation
        reasoning = min(count, generation.reasoning_tokens)
        text_of = self.reply.text_of
        output: list[dict[str, Any]] = []
        if reasoning:
            content = [{"type": "reasoning_text", "text": text_of(0, reasoning)}]
            output.append({"id": self.reasoning_id, "type": "reasoning", "summary": [], "content": content})
        if status == "completed" and count > reasoning:
            part = {"type": "output_text", "text": text_of(reasoning, count - reasoning), "annotations": []}
            output.append({"id": self.message_id, "type": "message", "role": "assistant", "status": "completed",
                           "content": [part]})  # fmt: skip
        prompt_tokens = len(generation.prompt_ids)
        usage = {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt_tokens + completion_tokens,
        }
        return {
            "id": self.reply.response_id, "object": "response", "created_at": self.reply.created,
            "model": generation.model, "status": status, "output": output,
            "usage": usage if status == "completed" else None, "parallel_tool_calls": True, "tool_choice": "auto",
            "tools": [], "max_output_tokens": generation.max_tokens, "previous_response_id": None,
            "background": False, "truncation": "disabled", "service_tier": "auto", "metadata": None, "error": None,
            "incomplete_details": None, "instructions": None, "reasoning": None, "text": None, "user": None,
        }  # fmt: skip

    def opening(self) -> list[bytes]:
        started = self.response(0, 0, status="in_progress")
        return [self._event("response.created", response=started),
                self._event("response.in_progress", response=started)]  # fmt: skip

    def tokens(self, first: int, count: int) -> bytes:
        """Events for output tokens FIRST…FIRST+COUNT-1: reasoning deltas, then the message's text deltas (each item
        opened before its first delta, the reasoning closed before the message opens)."""
        self.text_tokens = first + count
        limit = self.generation.reasoning_tokens
        reasoning = max(0, min(count, limit - first))
        events = self._reasoning_deltas(first, reasoning) if reasoning else []
        if count > reasoning:
            events += self._text_deltas(first + reasoning, count - reasoning)
        return b"".join(events)

    def _reasoning_deltas(self, first: int, count: int) -> list[bytes]:
        events: list[bytes] = []
        if first == 0:
            item = {"type": "reasoning", "id": self.reasoning_id, "summary": []}
            events += self._open(0, self.reasoning_id, item, {"type": "reasoning_text", "text": ""})
        delta = self.reply.text_of(first, count)
        where = {"item_id": self.reasoning_id, "output_index": 0, "content_index": 0}
        return [*events, self._event("response.reasoning_text.delta", **where, delta=delta)]

    def _text_deltas(self, start: int, count: int) -> list[bytes]:
        events: list[bytes] = []
        if start == self.generation.reasoning_tokens:  # the message begins
            if start:
                events += self._close_reasoning()
            message = {"type": "message", "id": self.message_id, "role": "assistant", "status": "in_progress",
                       "content": []}  # fmt: skip
            part = {"type": "output_text", "text": "", "annotations": []}
            events += self._open(self._message_index, self.message_id, message, part)
        delta = self.reply.text_of(start, count)
        where = {"item_id": self.message_id, "output_index": self._message_index, "content_index": 0}
        return [*events, self._event("response.output_text.delta", **where, delta=delta, logprobs=[])]

    @property
    def _message_index(self) -> int:
        return 1 if self.generation.reasoning_tokens else 0

    def _open(self, index: int, item_id: str, item: dict[str, Any], part: dict[str, Any]) -> list[bytes]:
        return [self._event("response.output_item.added", output_index=index, item=item),
                self._event("response.content_part.added", output_index=index, item_id=item_id, content_index=0,
                            part=part)]  # fmt: skip

    def _close_reasoning(self) -> list[bytes]:
        text = self.reply.text_of(0, self.generation.reasoning_tokens)
        item = {"type": "reasoning", "id": self.reasoning_id, "summary": [],
                "content": [{"type": "reasoning_text", "text": text}]}  # fmt: skip
        where = {"item_id": self.reasoning_id, "output_index": 0, "content_index": 0}
        return [self._event("response.reasoning_text.done", **where, text=text),
                self._event("response.content_part.done", **where, part=item["content"][0]),
                self._event("response.output_item.done", output_index=0, item=item)]  # fmt: skip

    def closing(self, completion_tokens: int) -> list[bytes]:
        count = self.text_tokens  # without the end of sequence, which has no text
        final = self.final = self.response(count, completion_tokens)
        events: list[bytes] = []
        limit = self.generation.reasoning_tokens
        if limit and count <= limit and count:
            events += self._close_reasoning()
        message = next((item for item in final["output"] if item["type"] == "message"), None)
        if message is not None:
            text = message["content"][0]["text"]
            index = self._message_index
            events += [
                self._event("response.output_text.done", item_id=self.message_id, output_index=index,
                            content_index=0, text=text, logprobs=[]),
                self._event("response.content_part.done", item_id=self.message_id, output_index=index,
                            content_index=0, part=message["content"][0]),
                self._event("response.output_item.done", output_index=index, item=message),
            ]  # fmt: skip
        events.append(self._event("response.completed", response=final))
        return events


_REASONS = {None: b"null", "length": b'"length"', "stop": b'"stop"', "abort": b'"abort"'}


def _reason(finish_reason: str | None) -> bytes:
    return _REASONS.get(finish_reason) or orjson.dumps(finish_reason)


DONE_EVENT = b"data: [DONE]\n\n"
