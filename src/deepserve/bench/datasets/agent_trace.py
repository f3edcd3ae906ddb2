"""Agentic traces: tool-calling sessions replayed request by request, each with its recorded history.

One JSON object per line, one line per request (docs/WORKLOADS.md, "Agent traces"; an example:
tests/fixtures/traces/agent_trace_small.jsonl):

    {"timestamp": 1.5, "session": "s1", "messages": [...], "tools": [...], "tool_choice": "auto",
     "output_tokens": 64, "chat_template_kwargs": {"thinking": false}}

`messages` is the whole conversation up to the request, as the agent sent it: the user's turns, the assistant's
earlier answers and tool calls (`"tool_calls": [{"id", "type": "function", "function": {"name", "arguments"}}]`,
content null) and the tools' results (`{"role": "tool", "tool_call_id": …, "content": …}`). Replaying the recorded
history (rather than what the server under test answers) keeps every run's requests identical, as a Mooncake trace
does, while a prefix cache still sees each session's growing prefix. `timestamp` is the request's time in seconds
(× --timed-trace-sec-multiplier); requests go out at those times (or by --request-rate with --no-self-timed). Each
record is tagged with its session and its place in it, so the result has TTFT by turn; the responses' tool calls
are timed (docs/METRICS.md: time to the first tool-call delta and to the complete tool call).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deepserve.bench.datasets.base import DatasetContext, DatasetError, DatasetResult, DraftRequest
from deepserve.bench.datasets.files import ALL_REQUESTS, check_messages, read_text, request_fields, require_path
from deepserve.bench.types import ChatMessages

if TYPE_CHECKING:
    from deepserve.bench.workloads import WorkloadConfig

AGENT_TRACE_EXAMPLE = '{"timestamp": 0.0, "session": "s1", "messages": [...], "tools": [...], "output_tokens": 64}'
DEFAULT_OUTPUT_TOKENS = 256


@dataclass(frozen=True)
class AgentRequest:
    line: int
    timestamp: float
    session: str
    messages: ChatMessages
    output_tokens: int
    extra_body: dict[str, Any]


def parse_agent_line(raw: str, path: Path, line: int) -> AgentRequest:
    where = f"{path}:{line}"
    try:
        item = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{where}: not valid JSON ({exc.msg}); expected {AGENT_TRACE_EXAMPLE}") from exc
    if not isinstance(item, dict):
        raise DatasetError(f"{where}: expected a JSON object such as {AGENT_TRACE_EXAMPLE}")
    timestamp = item.get("timestamp", 0.0)
    if isinstance(timestamp, bool) or not isinstance(timestamp, int | float) or timestamp < 0:
        raise DatasetError(f"{where}: 'timestamp' must be a number of seconds, not negative; got {timestamp!r}")
    output = item.get("output_tokens", DEFAULT_OUTPUT_TOKENS)
    if isinstance(output, bool) or not isinstance(output, int) or output < 1:
        raise DatasetError(f"{where}: 'output_tokens' must be a positive integer, got {output!r}")
    session = item.get("session", f"line-{line}")
    if not isinstance(session, str | int):
        raise DatasetError(f"{where}: 'session' must be a string or a number, got {session!r}")
    messages = check_messages(item.get("messages"), where)
    return AgentRequest(line, float(timestamp), str(session), messages, output, request_fields(item, where))


def load_agent_trace(path: Path, limit: int = 0) -> list[AgentRequest]:
    """The trace's first LIMIT requests (0: all), in file order."""
    requests: list[AgentRequest] = []
    for number, raw in enumerate(read_text(path).splitlines(), start=1):
        if raw.strip():
            requests.append(parse_agent_line(raw, path, number))
            if limit and len(requests) >= limit:
                break
    if not requests:
        raise DatasetError(f"{path}: no requests; expected one JSON object per line, e.g. {AGENT_TRACE_EXAMPLE}")
    return requests


class AgentTraceDataset:
    """Tool-calling sessions replayed at their times, each request with its recorded history, tools and options."""

    name = "agent_trace"
    default_num_prompts = ALL_REQUESTS
    replays_trace = True

    def build(self, config: WorkloadConfig, ctx: DatasetContext, num_prompts: int) -> DatasetResult:
        path = require_path(config, self.name)
        if not ctx.chat:
            raise DatasetError(
                f"{path}: an agent trace is chat messages with tools; pass --endpoint /v1/chat/completions"
            )
        requests = sorted(load_agent_trace(path, num_prompts), key=lambda request: request.timestamp)
        unit_s = (config.timed_trace_sec_multiplier or 1.0) * config.trace_time_scale
        first = requests[0].timestamp
        sessions: dict[str, int] = {}
        turns: dict[str, int] = {}
        drafts = []
        for request in requests:
            session = sessions.setdefault(request.session, len(sessions))
            turns[request.session] = turns.get(request.session, 0) + 1
            drafts.append(
                DraftRequest(
                    request.messages,
                    ctx.render_len(request.messages),  # the tools' schema is not counted: usage says the truth
                    request.output_tokens,
                    (request.timestamp - first) * unit_s,
                    request.extra_body,
                    session,
                    turns[request.session],
                )
            )
        details = {
            "dataset_path": str(path),
            "trace_requests": len(drafts),
            "sessions": len(sessions),
            "requests_with_tools": sum(1 for request in requests if request.extra_body.get("tools")),
            "trace_span_s": drafts[-1].arrival_s if drafts else 0.0,
        }
        return DatasetResult(drafts, details)
