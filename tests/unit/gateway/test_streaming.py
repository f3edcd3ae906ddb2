from __future__ import annotations

import json

from deepserve.gateway.streaming import StreamTap

CHUNK = b'data: {"choices":[{"index":0,"delta":{"content":"t"}}]}\n\n'
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3,"total_tokens":10}}\n\n'
DONE = b"data: [DONE]\n\n"


def test_complete_events_pass_through_unchanged() -> None:
    tap = StreamTap(strip_usage_chunk=False)
    assert tap.feed(CHUNK + CHUNK) == CHUNK + CHUNK


def test_a_split_event_is_forwarded_when_complete() -> None:
    tap = StreamTap(strip_usage_chunk=False)
    assert tap.feed(CHUNK[:10]) == b""
    assert tap.feed(CHUNK[10:] + CHUNK[:5]) == CHUNK
    assert tap.feed(CHUNK[5:]) == CHUNK
    assert tap.finish() == b""


def test_usage_is_read_and_kept_when_the_client_asked() -> None:
    tap = StreamTap(strip_usage_chunk=False)
    out = tap.feed(CHUNK + USAGE + DONE)
    assert out == CHUNK + USAGE + DONE
    assert tap.usage == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}


def test_usage_chunk_is_dropped_when_the_gateway_asked() -> None:
    tap = StreamTap(strip_usage_chunk=True)
    out = tap.feed(CHUNK) + tap.feed(USAGE[:20]) + tap.feed(USAGE[20:] + DONE) + tap.finish()
    assert out == CHUNK + DONE
    assert tap.usage is not None and tap.usage["completion_tokens"] == 3


def test_crlf_events() -> None:
    tap = StreamTap(strip_usage_chunk=True)
    usage = USAGE.replace(b"\n\n", b"\r\n\r\n")
    out = tap.feed(CHUNK.replace(b"\n\n", b"\r\n\r\n") + usage + b"data: [DONE]\r\n\r\n")
    assert b"usage" not in out and out.endswith(b"[DONE]\n\n")
    assert tap.usage is not None


def test_a_content_chunk_that_mentions_usage_is_kept() -> None:
    tap = StreamTap(strip_usage_chunk=True)
    text = json.dumps({"choices": [{"delta": {"content": 'the "usage" field'}}]}).encode()
    event = b"data: " + text + b"\n\n"
    assert tap.feed(event) == event
    assert tap.usage is None
