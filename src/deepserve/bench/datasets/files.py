"""Datasets read from files: `custom` (JSONL, vLLM's format plus chat messages) and `sharegpt` (ShareGPT JSON).

A file that does not parse is a DatasetError naming the file, the line and what was expected."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deepserve.bench.datasets.base import DatasetContext, DatasetError, DatasetResult, DraftRequest
from deepserve.bench.types import ChatMessages

if TYPE_CHECKING:
    from deepserve.bench.workloads import WorkloadConfig

ALL_REQUESTS = 0  # default_num_prompts of file datasets: every usable request of the file, once
CUSTOM_DEFAULT_OUTPUT_LEN = 256  # vLLM's --custom-output-len default
CUSTOM_EXAMPLE = '{"prompt": "...", "output_tokens": 128} or {"messages": [{"role": "user", "content": "..."}]}'
# A line's own body fields, sent with its request on the chat endpoint (tools: OpenAI's function-calling schema)
REQUEST_FIELDS = ("tools", "tool_choice", "chat_template_kwargs")
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
SHAREGPT_EXAMPLE = '[{"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}]}, ...]'
HUMAN_ROLES = frozenset({"human", "user"})
REPLY_ROLES = frozenset({"gpt", "assistant", "chatgpt", "bard", "model"})
# vLLM's is_valid_sequence defaults for ShareGPT (from benchmark_serving.py): drop very short and very long pairs
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048


@dataclass(frozen=True)
class FileItem:
    line: int
    prompt: str | ChatMessages
    output_len: int | None = None
    reference_output: str | None = None  # ShareGPT's first reply, whose length is the default output length
    extra_body: dict[str, Any] = field(default_factory=dict)  # tools, tool_choice, chat_template_kwargs


def require_path(config: WorkloadConfig, dataset: str) -> Path:
    if not config.dataset_path:
        raise DatasetError(f"dataset {dataset!r} reads a file: pass --dataset-path FILE")
    path = Path(config.dataset_path).expanduser()
    if not path.is_file():
        raise DatasetError(f"dataset file {path} does not exist or is not a file")
    return path


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc


def check_messages(value: Any, where: str) -> ChatMessages:
    """OpenAI chat messages as a file gives them: a role and text content each; an assistant message may carry
    tool calls (its content then null), a tool message answers one (tool_call_id)."""
    if not isinstance(value, list) or not value:
        raise DatasetError(f'{where}: \'messages\' must be a non-empty list of {{"role": ..., "content": ...}}')
    return [_check_message(message, f"{where}: messages[{i}]") for i, message in enumerate(value)]


def _check_message(message: Any, where: str) -> dict[str, Any]:
    if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
        raise DatasetError(f"{where} must be an object with a 'role' ({', '.join(sorted(CHAT_ROLES))})")
    content, calls = message.get("content"), message.get("tool_calls")
    if calls is not None:
        _check_tool_calls(calls, where)
    if not isinstance(content, str) and not (content is None and calls) and not isinstance(content, list):
        raise DatasetError(f"{where} must have a string 'content' (null only beside 'tool_calls')")
    if message["role"] == "tool" and not isinstance(message.get("tool_call_id"), str):
        raise DatasetError(f"{where}: a tool message needs the 'tool_call_id' of the call it answers")
    return dict(message)


def _check_tool_calls(calls: Any, where: str) -> None:
    example = '[{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]'
    if not isinstance(calls, list) or not all(
        isinstance(call, dict)
        and isinstance(call.get("id"), str)
        and isinstance(call.get("function"), dict)
        and isinstance(call["function"].get("name"), str)
        and isinstance(call["function"].get("arguments"), str)
        for call in calls
    ):
        raise DatasetError(f"{where}: 'tool_calls' must be a list like {example}")


def request_fields(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A line's own body fields (REQUEST_FIELDS), checked: tools as OpenAI's list of functions, tool_choice as
    "none", "auto", "required" or a function, chat template options as an object."""
    fields = {key: item[key] for key in REQUEST_FIELDS if item.get(key) is not None}
    tools = fields.get("tools")
    if tools is not None and not (
        isinstance(tools, list)
        and all(isinstance(tool, dict) and isinstance((tool.get("function") or {}).get("name"), str) for tool in tools)
    ):
        raise DatasetError(
            f'{where}: \'tools\' must be a list like [{{"type": "function", "function": {{"name": ...}}}}]'
        )
    choice = fields.get("tool_choice")
    if choice is not None and choice not in ("none", "auto", "required") and not isinstance(choice, dict):
        raise DatasetError(f'{where}: \'tool_choice\' must be none, auto, required or {{"type": "function", …}}')
    if "chat_template_kwargs" in fields and not isinstance(fields["chat_template_kwargs"], dict):
        raise DatasetError(f"{where}: 'chat_template_kwargs' must be an object, e.g. {{\"thinking\": false}}")
    return fields


def parse_custom_line(raw: str, path: Path, line: int) -> FileItem:
    where = f"{path}:{line}"
    try:
        item = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise DatasetError(
            f"{where}: not valid JSON ({exc.msg} at column {exc.colno}); expected {CUSTOM_EXAMPLE}"
        ) from exc
    if not isinstance(item, dict):
        raise DatasetError(f"{where}: expected a JSON object such as {CUSTOM_EXAMPLE}, got {type(item).__name__}")
    prompt: str | ChatMessages
    if "prompt" in item:
        if not isinstance(item["prompt"], str) or not item["prompt"]:
            raise DatasetError(f"{where}: 'prompt' must be a non-empty string")
        prompt = item["prompt"]
    elif "messages" in item:
        prompt = check_messages(item["messages"], where)
    else:
        raise DatasetError(f"{where}: expected a 'prompt' or 'messages' key, as in {CUSTOM_EXAMPLE}")
    output = item.get("output_tokens")
    if output is not None and (isinstance(output, bool) or not isinstance(output, int) or output < 1):
        raise DatasetError(f"{where}: 'output_tokens' must be a positive integer, got {output!r}")
    return FileItem(line, prompt, output, extra_body=request_fields(item, where))


def load_custom_jsonl(path: Path) -> list[FileItem]:
    items = [
        parse_custom_line(raw, path, number)
        for number, raw in enumerate(read_text(path).splitlines(), start=1)
        if raw.strip()
    ]
    if not items:
        raise DatasetError(f"{path}: no requests; expected one JSON object per line, e.g. {CUSTOM_EXAMPLE}")
    return items


def _json_array_with_lines(text: str, path: Path, expected: str) -> list[tuple[int, Any]]:
    """The items of a top-level JSON array, each with the line it starts on (for error messages)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from exc
    if not isinstance(data, list):
        raise DatasetError(f"{path}:1: expected a JSON array: {expected}; got {type(data).__name__}")
    decoder = json.JSONDecoder()
    items: list[tuple[int, Any]] = []
    pos, line = text.index("[") + 1, 1 + text.count("\n", 0, text.index("["))
    for _ in data:
        start = pos
        while text[pos] in " \t\r\n,":
            pos += 1
        line += text.count("\n", start, pos)
        value, end = decoder.raw_decode(text, pos)
        items.append((line, value))
        line += text.count("\n", pos, end)
        pos = end
    return items


def parse_sharegpt_entry(entry: Any, path: Path, line: int) -> FileItem | None:
    """The first human turn and the first reply after it; None for entries vLLM also skips (fewer than two turns,
    no human turn, no reply)."""
    where = f"{path}:{line}"
    if not isinstance(entry, dict):
        raise DatasetError(f"{where}: expected an object with 'conversations', as in {SHAREGPT_EXAMPLE}")
    turns = entry.get("conversations")
    if turns is None:
        return None
    if not isinstance(turns, list):
        raise DatasetError(f'{where}: \'conversations\' must be a list of {{"from": ..., "value": ...}}')
    for i, turn in enumerate(turns):
        if not (isinstance(turn, dict) and isinstance(turn.get("from"), str) and isinstance(turn.get("value"), str)):
            raise DatasetError(f"{where}: conversations[{i}] must be an object with string 'from' and 'value'")
    if len(turns) < 2:
        return None
    human = next((i for i, t in enumerate(turns) if t["from"].lower() in HUMAN_ROLES), None)
    if human is None:
        return None
    reply = next((t for t in turns[human + 1 :] if t["from"].lower() in REPLY_ROLES), None)
    if reply is None:
        return None
    return FileItem(line, turns[human]["value"], None, reply["value"])


def load_sharegpt(path: Path) -> list[FileItem]:
    entries = _json_array_with_lines(read_text(path), path, SHAREGPT_EXAMPLE)
    items = [item for line, entry in entries if (item := parse_sharegpt_entry(entry, path, line)) is not None]
    if not items:
        raise DatasetError(f"{path}: no entry has a human turn followed by a reply; expected {SHAREGPT_EXAMPLE}")
    return items


def _ordered(items: list[FileItem], config: WorkloadConfig, ctx: DatasetContext) -> list[FileItem]:
    if config.disable_shuffle:
        return list(items)
    order = ctx.rng("shuffle").permutation(len(items))
    return [items[i] for i in order]


def _oversampled(
    requests: list[DraftRequest], num_prompts: int, config: WorkloadConfig, ctx: DatasetContext
) -> list[DraftRequest]:
    """vLLM's behaviour when a file has fewer usable requests than asked: repeat random ones (seeded)."""
    if config.no_oversample or len(requests) >= num_prompts or not requests:
        return requests
    picks = ctx.rng("oversample").integers(0, len(requests), size=num_prompts - len(requests))
    return requests + [requests[int(i)] for i in picks]


def _for_endpoint(prompt: str | ChatMessages, ctx: DatasetContext, where: str) -> str | ChatMessages:
    """Chat endpoints take messages (a bare prompt becomes one user message); completions take text, so messages
    are rendered with the local tokenizer's chat template."""
    if ctx.chat:
        return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if isinstance(prompt, str):
        return prompt
    rendered = ctx.counter.render_chat(prompt)
    if rendered is None:
        raise DatasetError(
            f"{where}: 'messages' on the completions endpoint need a chat template to render them; "
            "use --endpoint /v1/chat/completions, or pass --tokenizer DIR"
        )
    return rendered


def requires_chat(extra_body: dict[str, Any], ctx: DatasetContext, where: str) -> None:
    """Tools are a chat-completions field: refused on /v1/completions, where they would be sent and ignored."""
    if extra_body.get("tools") is not None and not ctx.chat:
        raise DatasetError(f"{where}: 'tools' need the chat endpoint; pass --endpoint /v1/chat/completions")


class CustomDataset:
    """vLLM's `custom`: JSONL, one {"prompt": ...} or {"messages": [...]} per line, optional "output_tokens"."""

    name = "custom"
    default_num_prompts = ALL_REQUESTS
    replays_trace = False

    def build(self, config: WorkloadConfig, ctx: DatasetContext, num_prompts: int) -> DatasetResult:
        path = require_path(config, self.name)
        items = _ordered(load_custom_jsonl(path), config, ctx)
        num_prompts = num_prompts or len(items)
        items = items[:num_prompts]
        fixed = config.custom_output_len if config.custom_output_len not in (None, -1) else None
        requests = []
        for item in items:
            where = f"{path}:{item.line}"
            prompt = _for_endpoint(item.prompt, ctx, where)
            output_len = fixed or item.output_len or CUSTOM_DEFAULT_OUTPUT_LEN
            requires_chat(item.extra_body, ctx, where)
            requests.append(DraftRequest(prompt, ctx.render_len(prompt), output_len, extra_body=item.extra_body))
        details = {"dataset_path": str(path), "file_requests": len(items)}
        return DatasetResult(_oversampled(requests, num_prompts, config, ctx), details)


class ShareGPTDataset:
    """vLLM's `sharegpt`: the first human turn is the prompt; the token length of the first reply is the output
    length unless --sharegpt-output-len is given. Pairs vLLM drops (prompt or reply under 4 tokens, prompt over
    1024, both over 2048) are dropped here too."""

    name = "sharegpt"
    default_num_prompts = ALL_REQUESTS
    replays_trace = False

    def build(self, config: WorkloadConfig, ctx: DatasetContext, num_prompts: int) -> DatasetResult:
        path = require_path(config, self.name)
        requests: list[DraftRequest] = []
        skipped = 0
        items = _ordered(load_sharegpt(path), config, ctx)
        for item in items:
            if num_prompts and len(requests) >= num_prompts:
                break
            assert isinstance(item.prompt, str) and item.reference_output is not None
            text_len = len(ctx.counter.prompt_ids(item.prompt))
            output_len = config.sharegpt_output_len or ctx.counter.count(item.reference_output)
            if not _valid_pair(text_len, output_len, check_output=config.sharegpt_output_len is None):
                skipped += 1
                continue
            prompt = _for_endpoint(item.prompt, ctx, f"{path}:{item.line}")
            prompt_len = ctx.render_len(prompt) if ctx.chat else text_len
            requests.append(DraftRequest(prompt, prompt_len, output_len))
        if not requests:
            raise DatasetError(f"{path}: every conversation was too short or too long ({skipped} skipped)")
        details = {"dataset_path": str(path), "skipped_by_length": skipped}
        return DatasetResult(_oversampled(requests, num_prompts or len(requests), config, ctx), details)


def _valid_pair(prompt_len: int, output_len: int, check_output: bool) -> bool:
    too_short = prompt_len < SHAREGPT_MIN_LEN or (check_output and output_len < SHAREGPT_MIN_LEN)
    too_long = prompt_len > SHAREGPT_MAX_PROMPT_LEN or prompt_len + output_len > SHAREGPT_MAX_TOTAL_LEN
    return not (too_short or too_long)
