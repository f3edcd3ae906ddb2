"""Request validation: everything a client can get wrong is a 4xx in OpenAI's shape, decided before forwarding.

Validation is a table of field checks rather than a pydantic model: it runs on every request, and the table keeps
the hot path to one `json.loads` and a few isinstance calls. The body that is forwarded is the client's bytes,
unchanged, unless a model alias or the stream usage option has to be written into it."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from deepserve.gateway.errors import InvalidRequest, ModelNotFound, NoHealthyUpstream, bound_text
from deepserve.gateway.streaming import CHAT_STREAM, COMPLETION_STREAM, RESPONSES_STREAM, StreamShape

# Output tokens charged to the tokens-per-minute bucket when a request gives no max_tokens (corrected afterwards).
DEFAULT_CHARGED_OUTPUT_TOKENS = 512
# Characters per prompt token assumed before the real count is known (corrected with the upstream's usage).
CHARS_PER_TOKEN_ESTIMATE = 4
# How much of the prompt decides prefix affinity: enough to tell system prompts apart, short enough to hash fast.
# For chat it is the start of the first message (the system prompt, or a conversation's first turn), so that
# requests sharing a system prompt, and all turns of one conversation, land where that prefix is cached.
AFFINITY_PREFIX_CHARS = 256
# The deepest nesting of arrays and objects a body may have. Far beyond any real request (tool schemas nest a few
# levels), far below where Python's JSON encoder and decoder run out of stack.
MAX_JSON_DEPTH = 100
# How much of a client's value an error message quotes back.
_QUOTED_CHARS = 80

Check = Callable[[Any], bool]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int_at_least(low: int) -> Check:
    return lambda value: _is_int(value) and value >= low


def _number_between(low: float, high: float) -> Check:
    return lambda value: _is_number(value) and low <= value <= high


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _is_dict(value: Any) -> bool:
    return isinstance(value, dict)


def _is_list(value: Any) -> bool:
    return isinstance(value, list)


def _is_stop(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, list) and all(isinstance(item, str) for item in value))


def _is_prompt(value: Any) -> bool:
    if isinstance(value, str):
        return True
    if not isinstance(value, list) or not value:
        return False
    return (
        all(isinstance(item, str) for item in value)
        or all(_is_int(item) for item in value)
        or all(isinstance(item, list) and all(_is_int(t) for t in item) for item in value)
    )


def _is_messages(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(message, dict) and isinstance(message.get("role"), str) for message in value)
    )


def _anything(value: Any) -> bool:
    return True


def _one_of(*values: str) -> Check:
    allowed = frozenset(values)
    return lambda value: isinstance(value, str) and value in allowed


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(_is_int(item) for item in value)


def _is_tools(value: Any) -> bool:
    """A list of tool definitions, each an object with a string `type` (OpenAI's and vLLM's tools)."""
    return isinstance(value, list) and all(
        isinstance(tool, dict) and isinstance(tool.get("type"), str) for tool in value
    )


def _is_tool_choice(value: Any) -> bool:
    """ "none", "auto", "required", or an object naming one tool."""
    return value in ("none", "auto", "required") or (isinstance(value, dict) and isinstance(value.get("type"), str))


def _is_input(value: Any) -> bool:
    """The Responses API's input: a string, or a list of input items (objects: messages, tool outputs, …)."""
    return isinstance(value, str) or (isinstance(value, list) and all(isinstance(item, dict) for item in value))


# vLLM 0.32's reasoning_effort values (chat_completion/protocol.py: Literal[...]); a value outside them is its 400.
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")

# Fields of OpenAI's API and of the engines' extensions, per endpoint. The sources: OpenAI's API reference for chat
# completions, completions and responses; vLLM 0.32's request models (vllm/entrypoints/openai/{chat_completion,
# completion,responses}/protocol.py: ChatCompletionRequest, CompletionRequest, ResponsesRequest; a test holds the
# installed vLLM's fields to these tables); SGLang's reasoning switches (separate_reasoning, stream_reasoning).
_SAMPLING: dict[str, Check] = {
    "model": _is_str,
    "stream": _is_bool,
    "stream_options": _is_dict,
    "max_tokens": _int_at_least(1),
    "temperature": _number_between(0.0, 2.0),
    "top_p": _number_between(0.0, 1.0),
    "n": _int_at_least(1),
    "stop": _is_stop,
    "presence_penalty": _number_between(-2.0, 2.0),
    "frequency_penalty": _number_between(-2.0, 2.0),
    "seed": _is_int,
    "user": _is_str,
    "logit_bias": _is_dict,
    "response_format": _is_dict,
    "metadata": _is_dict,
    # vLLM's sampling extensions
    "top_k": _is_int,
    "min_p": _number_between(0.0, 1.0),
    "repetition_penalty": _is_number,
    "length_penalty": _is_number,
    "min_tokens": _int_at_least(0),
    "ignore_eos": _is_bool,
    "stop_token_ids": _is_list,
    "bad_words": _is_list,
    "allowed_token_ids": _is_list,
    "skip_special_tokens": _is_bool,
    "spaces_between_special_tokens": _is_bool,
    "include_stop_str_in_output": _is_bool,
    "truncate_prompt_tokens": _int_at_least(1),
    "truncation_side": _one_of("left", "right"),
    "prompt_logprobs": _int_at_least(0),
    "logprob_token_ids": _is_int_list,
    "priority": _is_int,
    "request_id": _is_str,
    "session_id": _is_str,
    "add_special_tokens": _is_bool,
    "return_tokens_as_token_ids": _is_bool,
    "return_token_ids": _is_bool,
    "return_token_offsets": _is_bool,
    "structured_outputs": _is_dict,
    "guided_json": _anything,
    "guided_regex": _is_str,
    "guided_choice": _is_list,
    "guided_grammar": _is_str,
    "cache_salt": _is_str,
    "kv_transfer_params": _is_dict,
    "ec_transfer_params": _is_dict,
    "vllm_xargs": _is_dict,
    "use_beam_search": _is_bool,
    "thinking_token_budget": _int_at_least(0),
    "repetition_detection": _is_dict,
    "stream_interval": _int_at_least(1),
    "mm_payload": _one_of("tensors", "none"),
    "return_mm_kwargs": _is_bool,
    "routed_experts_prompt_start": _int_at_least(0),
    "watermarking": _is_bool,
}

COMPLETION_FIELDS: dict[str, Check] = {
    **_SAMPLING,
    "prompt": _is_prompt,
    "prompt_embeds": lambda value: isinstance(value, str) or (isinstance(value, list) and all(map(_is_str, value))),
    "echo": _is_bool,
    "best_of": _int_at_least(1),
    "logprobs": _int_at_least(0),
    "suffix": _is_str,
}

# What reasoning models and tool calling send (chat completions and responses alike).
_REASONING_AND_TOOLS: dict[str, Check] = {
    "tools": _is_tools,
    "tool_choice": _is_tool_choice,
    "parallel_tool_calls": _is_bool,
    "chat_template_kwargs": _is_dict,  # e.g. {"thinking": true} (DeepSeek V3.1, V4), {"enable_thinking": false}
    "include_reasoning": _is_bool,  # vLLM: false leaves the reasoning out of the answer
    "separate_reasoning": _is_bool,  # SGLang
    "stream_reasoning": _is_bool,  # SGLang
    "media_io_kwargs": _is_dict,
    "mm_processor_kwargs": _is_dict,
}

CHAT_FIELDS: dict[str, Check] = {
    **_SAMPLING,
    **_REASONING_AND_TOOLS,
    "messages": _is_messages,
    "max_completion_tokens": _int_at_least(1),
    "logprobs": _is_bool,
    "top_logprobs": _int_at_least(0),
    "reasoning_effort": _one_of(*REASONING_EFFORTS),
    "store": _is_bool,
    "service_tier": _is_str,
    "modalities": _is_list,
    "prediction": _is_dict,
    "audio": _is_dict,
    "web_search_options": _is_dict,
    "verbosity": _is_str,
    "prompt_cache_key": _is_str,
    "safety_identifier": _is_str,
    "functions": _is_list,  # OpenAI's deprecated form of tools
    "function_call": lambda value: isinstance(value, (str, dict)),
    "add_generation_prompt": _is_bool,
    "continue_final_message": _is_bool,
    "chat_template": _is_str,
    "documents": _is_list,
    "echo": _is_bool,
    "return_prompt_text": _is_bool,
}

_RESPONSES_SAMPLING = (
    "model", "stream", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "seed",
    "user", "logit_bias", "metadata", "repetition_penalty", "stop", "stop_token_ids", "ignore_eos",
    "skip_special_tokens", "include_stop_str_in_output", "priority", "request_id", "session_id", "structured_outputs",
    "cache_salt", "kv_transfer_params", "ec_transfer_params", "vllm_xargs", "mm_payload", "return_mm_kwargs",
    "watermarking",
)  # fmt: skip

RESPONSES_FIELDS: dict[str, Check] = {
    **{name: _SAMPLING[name] for name in _RESPONSES_SAMPLING},
    **_REASONING_AND_TOOLS,
    "input": _is_input,
    "instructions": _is_str,
    "max_output_tokens": _int_at_least(1),
    "max_tool_calls": _int_at_least(0),
    "previous_response_id": _is_str,
    "previous_input_messages": _is_list,
    "prompt": _is_dict,  # a stored prompt template (OpenAI); not the completions prompt
    "prompt_cache_key": _is_str,
    "reasoning": _is_dict,  # {"effort": …, "summary": …}
    "text": _is_dict,
    "include": lambda value: isinstance(value, list) and all(map(_is_str, value)),
    "background": _is_bool,
    "store": _is_bool,
    "service_tier": _is_str,
    "top_logprobs": _int_at_least(0),
    "truncation": _one_of("auto", "disabled"),
    "enable_response_messages": _is_bool,
    "stream_options": _is_dict,
    "safety_identifier": _is_str,
    "conversation": lambda value: isinstance(value, (str, dict)),
}

_FIELD_HINTS = {
    "max_tokens": "an integer ≥ 1",
    "max_completion_tokens": "an integer ≥ 1",
    "temperature": "a number between 0 and 2",
    "top_p": "a number between 0 and 1",
    "n": "an integer ≥ 1",
    "stream": "true or false",
    "model": "a string",
    "prompt": "a string, a list of strings, or token ids",
    "messages": "a non-empty list of objects with a 'role'",
    "stop": "a string or a list of strings",
    "input": "a string or a list of input items (objects)",
    "max_output_tokens": "an integer ≥ 1",
    "reasoning_effort": "one of " + ", ".join(REASONING_EFFORTS),
    "tools": "a list of tool objects, each with a 'type'",
    "tool_choice": "'none', 'auto', 'required' or an object naming a tool",
    "chat_template_kwargs": 'an object, e.g. {"thinking": true}',
}


@dataclass(frozen=True)
class ApiRoute:
    """One route of OpenAI's API that the gateway forwards: its path, its allowed fields, where the prompt is, which
    fields cap the output tokens (the first given counts), and how its streams carry usage."""

    path: str
    fields: Mapping[str, Check]
    prompt_field: str
    max_tokens_fields: tuple[str, ...]
    # Streams carry usage only when stream_options.include_usage asks (the gateway asks, and hides the chunk);
    # a Responses stream always ends with its usage (response.completed).
    stream_shape: StreamShape
    usage_on_request: bool = True
    chat_template: bool = False  # takes chat_template_kwargs (the gateway's default thinking mode applies)


COMPLETIONS = ApiRoute("/v1/completions", COMPLETION_FIELDS, "prompt", ("max_tokens",), COMPLETION_STREAM)
CHAT_COMPLETIONS = ApiRoute(
    "/v1/chat/completions",
    CHAT_FIELDS,
    "messages",
    ("max_completion_tokens", "max_tokens"),
    CHAT_STREAM,
    chat_template=True,
)
RESPONSES = ApiRoute(
    "/v1/responses",
    RESPONSES_FIELDS,
    "input",
    ("max_output_tokens",),
    RESPONSES_STREAM,
    usage_on_request=False,
    chat_template=True,
)


@dataclass
class ParsedRequest:
    """What the gateway needs to know about a request, plus the exact bytes to forward."""

    body: bytes  # what goes upstream
    model: str  # the upstream model name (after alias mapping)
    client_model: str  # what the client asked for
    stream: bool
    max_tokens: int | None
    prompt_tokens_estimate: int
    strip_usage_chunk: bool  # we asked the upstream for a usage chunk the client did not ask for
    request: dict[str, Any]  # the parsed body (for log_bodies)
    prompt: Any = None  # the prompt as sent (prompt, messages or input)
    prompt_text: str = ""  # the prompt as text (for the estimate)

    @property
    def charged_tokens(self) -> int:
        return self.prompt_tokens_estimate + (self.max_tokens or DEFAULT_CHARGED_OUTPUT_TOKENS)

    @functools.cached_property
    def affinity_text(self) -> str:
        """The start of the prompt, for prefix affinity (worked out only for the policy that routes by it)."""
        return _affinity_text(self.prompt, self.prompt_text)


def resolve_model(client_model: str, models: Mapping[str, int | None], aliases: Mapping[str, str]) -> str:
    """The served model CLIENT_MODEL names (itself or through an alias). An unknown model is the client's mistake
    (404, listing the valid names), unless no replica is up to say what it serves (503)."""
    model = aliases.get(client_model, client_model)
    if model in models:
        return model
    if not models:
        raise NoHealthyUpstream("no healthy upstream; the engine may still be starting")
    valid = ", ".join(sorted({*models, *aliases}))
    raise ModelNotFound(
        f"the model {_quote(client_model)} does not exist; available: {valid}",
        param="model",
        ledger_message="the requested model does not exist",
    )


def parse_request(
    endpoint: ApiRoute,
    raw: bytes,
    models: Mapping[str, int | None],
    aliases: Mapping[str, str],
    template_defaults: Mapping[str, Mapping[str, Any]] | None = None,
) -> ParsedRequest:
    """Validate RAW for ENDPOINT. MODELS maps each served model to its context length (None when unknown).
    TEMPLATE_DEFAULTS ({model: chat_template_kwargs}, by the name the client used or the served one) fill in the
    chat template options a request leaves out (e.g. the model's default thinking mode), unless it chose a
    reasoning_effort itself."""
    request = load_json_object(raw)
    _check_fields(endpoint, request)
    client_model = request["model"]
    model = resolve_model(client_model, models, aliases)
    max_tokens = _max_tokens(endpoint, request)
    _check_context(max_tokens, models[model])
    stream = request.get("stream") is True
    if not stream and endpoint.usage_on_request and request.get("stream_options") is not None:
        raise InvalidRequest("stream_options is only allowed when stream is true", param="stream_options")
    prompt = request[endpoint.prompt_field]
    prompt_text = _prompt_text(prompt)
    if isinstance(request.get("instructions"), str):  # the Responses API's system prompt
        prompt_text = request["instructions"] + "\n" + prompt_text
    strip_usage = (
        stream and endpoint.usage_on_request and not (request.get("stream_options") or {}).get("include_usage")
    )
    template = _template_defaults(endpoint, request, template_defaults, client_model, model)
    body = raw
    spliceable = "stream_options" not in request and not raw.startswith(_UTF8_BOM)
    if model == client_model and template is None and strip_usage and spliceable:
        body = _with_usage_option(raw)  # the common stream: no re-encoding of the whole body
    elif model != client_model or strip_usage or template is not None:
        body = _rewrite(request, model, strip_usage, template)
    return ParsedRequest(
        body=body,
        model=model,
        client_model=client_model,
        stream=stream,
        max_tokens=max_tokens,
        prompt_tokens_estimate=-(-len(prompt_text) // CHARS_PER_TOKEN_ESTIMATE),
        strip_usage_chunk=strip_usage,
        request=request,
        prompt=prompt,
        prompt_text=prompt_text,
    )


def _max_tokens(endpoint: ApiRoute, request: dict[str, Any]) -> int | None:
    for name in endpoint.max_tokens_fields:
        value = request.get(name)
        if value is not None:
            return int(value)
    return None


def _template_defaults(
    endpoint: ApiRoute,
    request: dict[str, Any],
    defaults: Mapping[str, Mapping[str, Any]] | None,
    client_model: str,
    model: str,
) -> dict[str, Any] | None:
    """The chat_template_kwargs to send instead of the request's (its own, with the model's defaults for the keys
    it left out), or None to send it as it is."""
    if not defaults or not endpoint.chat_template or request.get("reasoning_effort") is not None:
        return None
    default = defaults.get(client_model) or defaults.get(model)
    if not default:
        return None
    given = request.get("chat_template_kwargs") or {}
    if all(key in given for key in default):
        return None
    return {**default, **given}


def load_json_object(raw: bytes) -> dict[str, Any]:
    """RAW as a JSON object, or InvalidRequest: the body must be UTF-8 JSON (RFC 8259: no NaN or Infinity), an
    object, nested at most MAX_JSON_DEPTH deep, and its strings valid Unicode (no lone UTF-16 surrogate such as
    "\\ud800", which no engine can encode). Whatever passes can be re-encoded and forwarded without error."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(
            f"the request body is not UTF-8 text (byte {exc.start}); send JSON encoded as UTF-8"
        ) from None
    if text.startswith("\ufeff"):
        text = text[1:]  # a byte order mark: harmless, and json.loads would refuse it
    try:
        request = _DECODER.decode(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None
    except (ValueError, RecursionError) as exc:  # NaN, a number of over 4,300 digits, nesting beyond the stack
        what = "nested too deeply" if isinstance(exc, RecursionError) else bound_text(str(exc), 160)
        raise InvalidRequest(f"the request body is not valid JSON: {what}") from None
    if not isinstance(request, dict):
        raise InvalidRequest("the request body must be a JSON object")
    # Both checks are rare-path: a body with fewer brackets cannot be that deep, and one without a \u escape of a
    # surrogate cannot hold a lone one (the strict UTF-8 decode above refused encoded surrogates).
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and _depth(request) > MAX_JSON_DEPTH:
        raise InvalidRequest(f"the request body nests arrays and objects more than {MAX_JSON_DEPTH} deep")
    if ("\\ud" in text or "\\uD" in text) and _has_lone_surrogate(request):
        raise InvalidRequest(
            'the request body has a lone UTF-16 surrogate escape (e.g. "\\ud800" without its pair), which is not '
            "valid Unicode; send the character itself or a complete surrogate pair"
        )
    return request


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value (RFC 8259); send a number or null")


# Built once: json.loads with any keyword argument builds a decoder per call (several µs on every request).
_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)


def _depth(value: Any) -> int:
    """How deep arrays and objects nest in VALUE (1 for a flat object), without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if deepest > MAX_JSON_DEPTH:
            break
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def _has_lone_surrogate(value: Any) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _quote(value: Any) -> str:
    """VALUE as an error message quotes it: its repr, cut to _QUOTED_CHARS."""
    text = repr(value)
    return text if len(text) <= _QUOTED_CHARS else text[: _QUOTED_CHARS - 1] + "…"


def _check_fields(endpoint: ApiRoute, request: dict[str, Any]) -> None:
    """Each field known for ENDPOINT and of its type (null is allowed for optional fields). The ledger's copy of
    an error names the field only when it is a known one, and never quotes the value."""
    for required in ("model", endpoint.prompt_field):
        if request.get(required) is None:
            what = "missing" if required not in request else "null for"
            hint = _FIELD_HINTS[required]
            raise InvalidRequest(
                f"{what} required parameter '{required}'; give {hint}", param=required, code="missing_required"
            )
    fields = endpoint.fields
    for name, value in request.items():
        check = fields.get(name)
        if check is None:
            shown = name if len(name) <= _QUOTED_CHARS else name[: _QUOTED_CHARS - 1] + "…"
            raise InvalidRequest(
                f"unsupported parameter {shown!r} for {endpoint.path}",
                param=shown,
                code="unsupported_parameter",
                ledger_message=f"an unsupported parameter for {endpoint.path}",
            )
        if value is not None and not check(value):
            hint = _FIELD_HINTS.get(name, "a value of the documented type")
            raise InvalidRequest(
                f"invalid value for '{name}': {_quote(value)}; expected {hint}",
                param=name,
                ledger_message=f"invalid value for '{name}'; expected {hint}",
            )


def _check_context(max_tokens: int | None, max_model_len: int | None) -> None:
    if max_tokens is not None and max_model_len is not None and max_tokens >= max_model_len:
        raise InvalidRequest(
            f"max_tokens {max_tokens} leaves no room for the prompt in the model's context of {max_model_len} "
            f"tokens; ask for fewer than {max_model_len}",
            param="max_tokens",
            code="context_length_exceeded",
        )


def _affinity_text(prompt: Any, prompt_text: str) -> str:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        return _prompt_text(prompt[:1])[:AFFINITY_PREFIX_CHARS]
    return prompt_text[:AFFINITY_PREFIX_CHARS]


def _prompt_text(prompt: Any) -> str:
    """The prompt as text, for the token estimate and affinity (token-id prompts count one char per id)."""
    if isinstance(prompt, str):
        return prompt
    parts: list[str] = []
    for item in prompt:
        if isinstance(item, str):
            parts.append(item)
        elif isinstance(item, dict):
            content = item.get("content")
            parts.append(content if isinstance(content, str) else json.dumps(content))
        else:
            parts.append(json.dumps(item))
    return "\n".join(parts)


_USAGE_OPTION = b'"stream_options":{"include_usage":true},'
_UTF8_BOM = b"\xef\xbb\xbf"  # allowed from a client, not passed on (a JSON parser refuses it)


def _with_usage_option(raw: bytes) -> bytes:
    """RAW (a JSON object with members and no stream_options) with stream_options.include_usage as its first
    member: the client's bytes otherwise, spliced rather than re-encoded (a stream's body, on every stream)."""
    opening = raw.find(b"{")
    return raw[: opening + 1] + _USAGE_OPTION + raw[opening + 1 :]


def _rewrite(request: dict[str, Any], model: str, add_usage: bool, template: dict[str, Any] | None = None) -> bytes:
    request = dict(request)
    request["model"] = model
    if add_usage:
        request["stream_options"] = {**(request.get("stream_options") or {}), "include_usage": True}
    if template is not None:
        request["chat_template_kwargs"] = template
    return json.dumps(request, separators=(",", ":"), ensure_ascii=False).encode()
