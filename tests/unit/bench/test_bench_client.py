"""The streaming client's pieces without a network: HTTP parsing over arbitrary read boundaries, SSE framing,
event decoding (tokens and text per chunk, usage, errors). How chunks' tokens are attributed: test_attribution.py."""

from __future__ import annotations

import json

import pytest

from deepserve.bench.client import (
    Endpoint,
    RawResponse,
    Tally,
    _ResponseParser,
    build_payload,
    build_request_bytes,
    decode_events,
    frame_events,
    http_error_message,
)
from deepserve.bench.types import RequestSpec


def sse(payload) -> bytes:
    return b"data: " + (payload if isinstance(payload, bytes) else json.dumps(payload).encode()) + b"\n\n"


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


def completion_chunk(text, **extra):
    return {"choices": [{"index": 0, "text": text, "finish_reason": None, **extra}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def feed_in_pieces(data: bytes, size: int) -> _ResponseParser:
    parser = _ResponseParser(Tally())
    for step, start in enumerate(range(0, len(data), size)):
        parser.feed(data[start : start + size], float(step))
    return parser


@pytest.mark.parametrize("read_size", [1, 7, 64, 100_000])
def test_parser_frames_chunked_sse_whatever_the_read_boundaries(read_size):
    body = chunked(sse(completion_chunk("a")), sse(completion_chunk("b")), sse(USAGE), sse(b"[DONE]"))
    parser = feed_in_pieces(HEAD + body, read_size)
    assert parser.done and parser.keep_alive
    response = parser.response
    assert response.status == 200
    assert response.error is None
    assert response.event_payloads[-1] == b"[DONE]"
    assert len(response.event_payloads) == 4
    assert response.event_times == sorted(response.event_times)


def test_events_take_the_time_of_the_read_that_completed_them():
    parts = [b'data: {"a"', b': 1}\n\ndata: {"b": 2}\n', b"\n", b": comment\n\n", b'data: {"c": 3}\r\n\r\n']
    response = RawResponse(status=200)
    frame_events(parts, [1.0, 2.0, 3.0, 4.0, 5.0], response)
    assert response.event_payloads == [b'{"a": 1}', b'{"b": 2}', b'{"c": 3}']
    assert response.event_times == [2.0, 3.0, 5.0]  # the comment event carries no data and is skipped


def test_error_response_body_is_kept_and_explained():
    body = json.dumps({"error": {"message": "bad key", "type": "auth"}}).encode()
    head = b"HTTP/1.1 401 Unauthorized\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
    parser = feed_in_pieces(head + body, 10)
    assert parser.done
    decoded = decode_events(parser.response)
    assert decoded.error == "HTTP 401: bad key"
    assert http_error_message(500, b"plain text") == "HTTP 500: plain text"
    assert http_error_message(404, b'{"detail": "Not Found"}') == "HTTP 404: Not Found"


def test_connection_cut_mid_stream_is_an_error():
    parser = _ResponseParser(Tally())
    parser.feed(HEAD + b"%x\r\n%s\r\n" % (len(sse(completion_chunk("a"))), sse(completion_chunk("a"))), 1.0)
    parser.close(2.0, "connection closed by server mid-response")
    assert parser.done and not parser.keep_alive
    decoded = decode_events(parser.response)
    assert decoded.error == "connection closed by server mid-response"
    assert decoded.chunk_times == [1.0]  # what arrived is kept, for the record


def test_decode_counts_one_token_per_chunk_and_reads_usage():
    response = RawResponse(
        status=200,
        event_payloads=[json.dumps(completion_chunk(t)).encode() for t in ("a", "", "c")] + [
            json.dumps(USAGE).encode(), b"[DONE]"],
        event_times=[1.0, 2.0, 3.0, 3.0, 3.0],
    )  # fmt: skip
    decoded = decode_events(response)
    assert decoded.error is None
    assert decoded.chunk_times == [1.0, 2.0, 3.0]  # an empty-text chunk still carried a token
    assert decoded.chunk_tokens == [1, 1, 1]
    assert decoded.text == "ac"
    assert decoded.chunk_text_lens == [1, 0, 1]
    assert (decoded.usage_completion_tokens, decoded.usage_prompt_tokens) == (3, 7)
    assert decoded.counted_chunks == 0 and not decoded.all_chunks_counted


def test_decode_uses_token_ids_or_logprobs_when_present():
    ids = RawResponse(200, [json.dumps(completion_chunk("ab", token_ids=[5, 6])).encode()], [1.0])
    assert decode_events(ids).chunk_tokens == [2]
    assert decode_events(ids).all_chunks_counted
    logprobs = completion_chunk("abc", logprobs={"tokens": ["a", "b", "c"], "token_logprobs": [0, 0, 0]})
    decoded = decode_events(RawResponse(200, [json.dumps(logprobs).encode()], [1.0]))
    assert (decoded.chunk_tokens, decoded.counted_chunks) == ([3], 1)


def test_vllm_chat_chunks_with_and_without_token_ids():
    """As vLLM 0.32 streamed them with --stream-interval 4 (tiny model, 10 tokens): the first token alone, then
    four per chunk; without return_token_ids, `token_ids` is null and only the text tells the chunks apart."""
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}

    def chunk(text, ids, finish=None):
        return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish, "token_ids": ids}]}

    with_ids = [role, chunk("r", [117]), chunk("x", [213, 130, 175, 297]), chunk("yz!", [1, 2, 3, 4]),
                chunk("n", [113], "length"), {"choices": [], "usage": {"completion_tokens": 10}}]  # fmt: skip
    decoded = decode_events(RawResponse(200, [json.dumps(e).encode() for e in with_ids], [1, 2, 3, 4, 5, 5]))
    assert decoded.chunk_tokens == [1, 4, 4, 1] and decoded.all_chunks_counted
    without = [role, chunk("1", None), chunk("}&", None), chunk("*c", None), chunk("", None, "length")]
    decoded = decode_events(RawResponse(200, [json.dumps(e).encode() for e in without], [1, 2, 3, 4, 5]))
    assert decoded.chunk_tokens == [1, 1, 1, 1] and decoded.counted_chunks == 0
    assert decoded.chunk_text_lens == [1, 2, 2, 0]


def test_chat_role_header_chunk_carries_no_token():
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    token = {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}
    decoded = decode_events(RawResponse(200, [json.dumps(role).encode(), json.dumps(token).encode()], [1.0, 1.5]))
    assert decoded.chunk_times == [1.5]
    assert decoded.text == "hi"


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"{not json", "malformed SSE event"),
        (b"[1, 2]", "malformed SSE event"),
        (json.dumps({"error": {"message": "engine died"}}).encode(), "stream error: engine died"),
    ],
)
def test_bad_events_fail_the_request(payload, message):
    good = json.dumps(completion_chunk("a")).encode()
    decoded = decode_events(RawResponse(200, [good, payload], [1.0, 2.0]))
    assert decoded.error is not None and decoded.error.startswith(message)


def test_a_stream_without_tokens_fails():
    decoded = decode_events(RawResponse(200, [json.dumps(USAGE).encode(), b"[DONE]"], [1.0, 1.0]))
    assert decoded.error == "no token in the response stream"


def test_payload_and_request_bytes():
    spec = RequestSpec(index=0, prompt="hi", prompt_len=2, output_len=9, min_output_len=3, ignore_eos=True)
    payload = build_payload(spec, "m", chat=False, extra_body={"temperature": 0})
    assert payload["prompt"] == "hi" and payload["max_tokens"] == 9 and payload["min_tokens"] == 3
    assert payload["ignore_eos"] is True and payload["stream"] is True
    assert payload["stream_options"] == {"include_usage": True}
    chat = build_payload(spec, "m", chat=True)
    assert chat["messages"] == [{"role": "user", "content": "hi"}]
    endpoint = Endpoint.from_url("http://127.0.0.1:9/v1/completions")
    wire = build_request_bytes(endpoint, payload, {"Authorization": "Bearer k"}, "bench-0")
    head, body = wire.split(b"\r\n\r\n", 1)
    assert head.startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert b"Authorization: Bearer k" in head and b"x-request-id: bench-0" in head
    assert json.loads(body) == payload
    assert b"Content-Length: %d" % len(body) in head


def test_chat_content_parts_do_not_break_decoding():
    parts = {"choices": [{"index": 0, "delta": {"content": [{"type": "text", "text": "x"}]}, "finish_reason": None}]}
    decoded = decode_events(RawResponse(200, [json.dumps(parts).encode()], [1.0]))
    assert decoded.error is None and decoded.chunk_tokens == [1] and decoded.text == ""


def test_a_read_that_drained_several_writes_keeps_the_first_ones_arrival():
    parser = _ResponseParser(Tally())
    parser.feed(HEAD, 0.5)
    first, second = sse(completion_chunk("a")), sse(completion_chunk("b"))
    parser.feed(b"%x\r\n%s\r\n%x\r\n%s\r\n" % (len(first), first, len(second), second), now=2.0, first_now=1.0)
    parser.feed(b"0\r\n\r\n", 2.5)
    assert parser.response.event_times == [1.0, 2.0]


def test_a_read_that_starts_with_the_head_stamps_the_body_with_its_newest_arrival():
    """The head was written when the request arrived; the first token a TTFT later. A read that drained both has
    the head's arrival as its oldest: giving it to the first token would make TTFT that much too short."""
    parser = _ResponseParser(Tally())
    first = sse(completion_chunk("a"))
    parser.feed(HEAD + b"%x\r\n%s\r\n" % (len(first), first), now=2.0, first_now=0.5)
    parser.feed(b"0\r\n\r\n", 2.5)
    assert parser.response.event_times == [2.0]
