"""Reasoning and the Responses API in the gateway's own pieces: the request fields it accepts against the installed
vLLM's, the stream tap's counts, the usage shapes, the ledger's new columns, and the default thinking mode."""

from __future__ import annotations

import ast
import importlib.util
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from deepserve.errors import ConfigError
from deepserve.gateway.config import GatewayConfig
from deepserve.gateway.ledger import UsageLedger, UsageRow
from deepserve.gateway.streaming import CHAT_STREAM, RESPONSES_STREAM, StreamTap
from deepserve.gateway.usage import TokenCounts, read_usage
from deepserve.gateway.validation import CHAT_COMPLETIONS, COMPLETIONS, RESPONSES, ApiRoute, parse_request

# ---- the request fields of the installed vLLM ------------------------------------------------------------------

_VLLM_REQUESTS = [
    (CHAT_COMPLETIONS, "chat_completion/protocol.py", "ChatCompletionRequest"),
    (COMPLETIONS, "completion/protocol.py", "CompletionRequest"),
    (RESPONSES, "responses/protocol.py", "ResponsesRequest"),
]


def _vllm_request_fields(relative: str, class_name: str) -> set[str]:
    """The public fields of vLLM's request model CLASS_NAME, read from its source (importing vLLM takes half a
    minute); skips where vLLM is not installed."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed here: its request fields cannot be read")
    source = Path(next(iter(spec.submodule_search_locations))) / "entrypoints" / "openai" / relative
    tree = ast.parse(source.read_text())
    (model,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == class_name]
    fields = {
        item.target.id
        for item in model.body
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and not item.target.id.startswith("_")
    }
    assert len(fields) > 30, f"found too few fields in {source}: the reading no longer matches vLLM's code"
    return fields


@pytest.mark.parametrize(("endpoint", "relative", "class_name"), _VLLM_REQUESTS, ids=lambda value: str(value)[:30])
def test_every_field_the_installed_vllm_takes_is_accepted(endpoint: ApiRoute, relative: str, class_name: str) -> None:
    """A field vLLM takes and the gateway refuses would be a 400 for a request the engine serves: a new vLLM's
    fields must be added to validation's tables (with their checks)."""
    missing = _vllm_request_fields(relative, class_name) - set(endpoint.fields)
    assert not missing, f"{endpoint.path} refuses what vLLM's {class_name} takes: {sorted(missing)}"


# ---- the stream tap's counts -------------------------------------------------------------------------------------


def _chat_event(delta: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps({"choices": [{"index": 0, "delta": delta}]}).encode() + b"\n\n"


def test_reasoning_events_are_counted_in_either_field_and_null_ones_are_not() -> None:
    tap = StreamTap(strip_usage_chunk=False, shape=CHAT_STREAM)
    events = [
        _chat_event({"role": "assistant", "content": ""}),
        _chat_event({"reasoning": "a"}),
        b'data: {"choices":[{"delta":{"reasoning_content": "b"}}]}\n\n',  # json.dumps' spacing, as some servers
        _chat_event({"content": "c", "reasoning_content": None}),  # SGLang's null beside the answer
        _chat_event({"content": 'says "reasoning": "no"'}),  # text that mentions it, escaped
        b"data: [DONE]\n\n",
    ]
    assert tap.feed(b"".join(events)) == b"".join(events)
    assert tap.reasoning_events == 2 and tap.delivered_tokens() == 5


def test_a_responses_stream_counts_its_deltas_and_reads_its_usage_and_id() -> None:
    def event(kind: str, **data: Any) -> bytes:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()

    usage = {"input_tokens": 7, "output_tokens": 3, "output_tokens_details": {"reasoning_tokens": 1}}
    stream = [
        event("response.created", response={"id": "resp_1", "usage": None}),
        event("response.reasoning_text.delta", delta="a"),
        event("response.output_text.delta", delta="b"),
        event("response.output_text.delta", delta="c"),
        event("response.completed", response={"id": "resp_1", "usage": usage}),
    ]
    tap = StreamTap(strip_usage_chunk=False, shape=RESPONSES_STREAM)
    assert tap.feed(b"".join(stream)) + tap.finish() == b"".join(stream)  # nothing dropped: no [DONE], no chunk
    assert tap.delivered_tokens() == 3 and tap.reasoning_events == 1
    assert tap.response_id == "resp_1" and tap.usage == usage


def test_usage_reads_both_apis_shapes_and_distrusts_nonsense() -> None:
    chat = {"prompt_tokens": 5, "completion_tokens": 9, "completion_tokens_details": {"reasoning_tokens": 4}}
    assert read_usage(chat) == TokenCounts(5, 9, 4, "usage")
    responses = {"input_tokens": 5, "output_tokens": 9, "output_tokens_details": {"reasoning_tokens": 0}}
    assert read_usage(responses) == TokenCounts(5, 9, 0, "usage")
    assert read_usage({"prompt_tokens": 5, "completion_tokens": 9}) == TokenCounts(5, 9)
    assert read_usage({"prompt_tokens": -1, "completion_tokens": "9", "completion_tokens_details": []}) == TokenCounts()


# ---- the ledger --------------------------------------------------------------------------------------------------

_OLD_SCHEMA = """CREATE TABLE usage (ts REAL NOT NULL, key TEXT NOT NULL, model TEXT NOT NULL, endpoint TEXT NOT NULL,
stream INTEGER NOT NULL, status INTEGER NOT NULL, prompt_tokens INTEGER, completion_tokens INTEGER,
latency_ms REAL NOT NULL, ttft_ms REAL, upstream TEXT, error TEXT, request_body TEXT, response_body TEXT)"""


def test_an_older_ledger_gets_the_reasoning_columns_and_keeps_its_rows(tmp_path: Path) -> None:
    path = tmp_path / "usage.sqlite"
    with sqlite3.connect(path) as db:
        db.execute(_OLD_SCHEMA)
        db.execute("INSERT INTO usage VALUES (1, 'k', 'm', '/v1/completions', 0, 200, 1, 2, 3, NULL, NULL, NULL, "
                   "NULL, NULL)")  # fmt: skip
    ledger = UsageLedger(path, start_writer=False)
    row = UsageRow(2, "k", "m", "/v1/responses", True, 200, 5, 9, 4.0, 1.0, "u", None, None, None, 4, "deltas")
    ledger.record(row)
    assert ledger.flush()
    ledger.close()
    with sqlite3.connect(path) as db:
        rows = db.execute("SELECT endpoint, reasoning_tokens, reasoning_source FROM usage ORDER BY ts").fetchall()
    assert rows == [("/v1/completions", None, None), ("/v1/responses", 4, "deltas")]


# ---- the default thinking mode -----------------------------------------------------------------------------------


def test_default_template_options_come_as_flags_or_a_config_mapping_and_bad_ones_fail_fast() -> None:
    flags = GatewayConfig.model_validate({"default_chat_template_kwargs": ['m={"thinking": true}']})
    mapping = GatewayConfig.model_validate({"default_chat_template_kwargs": {"m": {"thinking": True}}})
    assert flags.chat_template_defaults() == mapping.chat_template_defaults() == {"m": {"thinking": True}}
    for bad in ("m", "m=thinking", "m=[1]", '={"thinking": true}'):
        with pytest.raises((ValueError, ConfigError), match="MODEL=JSON-OBJECT"):
            GatewayConfig.model_validate({"default_chat_template_kwargs": [bad]})


def test_defaults_fill_only_the_options_a_request_leaves_out() -> None:
    defaults = {"m": {"thinking": True, "effort": "high"}}

    def sent(**fields: Any) -> dict[str, Any]:
        raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], **fields}).encode()
        return json.loads(parse_request(CHAT_COMPLETIONS, raw, {"m": None}, {}, defaults).body)

    assert sent()["chat_template_kwargs"] == {"thinking": True, "effort": "high"}
    assert sent(chat_template_kwargs={"thinking": False})["chat_template_kwargs"] == {
        "thinking": False,
        "effort": "high",
    }
    assert "chat_template_kwargs" not in sent(reasoning_effort="low")
    completion = json.dumps({"model": "m", "prompt": "x"}).encode()
    assert parse_request(COMPLETIONS, completion, {"m": None}, {}, defaults).body is completion  # no chat template


# ---- the loop's histograms ---------------------------------------------------------------------------------------


def test_a_loop_histogram_is_exposed_exactly_as_prometheus_clients() -> None:
    """The gateway's request-path histograms are plain lists (metrics.LoopHistogram); a scrape must not tell them
    from prometheus_client's (its `_created` series aside)."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from deepserve.gateway.metrics import LoopHistogramFamily

    buckets = (0.001, 0.01, 0.1, 1.0)
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    reference = Histogram("x_seconds", "help text", ["model"], buckets=buckets, registry=theirs)
    loop = LoopHistogramFamily("x_seconds", "help text", ["model"], buckets=buckets, registry=ours)
    for model, value in [("a", 0.0005), ("a", 0.001), ("a", 0.05), ("b", 3.0), ("a", 1.0), ("b", 0.01)]:
        reference.labels(model).observe(value)
        loop.labels(model).observe(value)

    def lines(registry: CollectorRegistry) -> list[str]:
        return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]

    assert lines(ours) == lines(theirs)


def test_a_loop_counter_is_exposed_exactly_as_prometheus_clients() -> None:
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    from deepserve.gateway.metrics import LoopCounterFamily

    theirs, ours = CollectorRegistry(), CollectorRegistry()
    reference = Counter("y_requests", "help text", ["key", "status"], registry=theirs)
    loop = LoopCounterFamily("y_requests", "help text", ["key", "status"], registry=ours)
    for key, status, amount in [("a", "200", 1), ("a", "200", 2.5), ("b", "429", 1)]:
        reference.labels(key, status).inc(amount)
        loop.labels(key, status).inc(amount)

    def lines(registry: CollectorRegistry) -> list[str]:
        return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]

    assert lines(ours) == lines(theirs)
