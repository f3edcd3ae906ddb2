"""The upstream HTTP client against small raw servers on loopback: keep-alive reuse, idle closing, timeouts, and the
errors that decide whether the gateway retries.

Deadlines are tested with a fake clock: the test moves it and calls the client's checks (`check_timeouts`,
`sweep_idle`) that its timers would call, instead of sleeping through them."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest

from deepserve.gateway.http_client import (
    Abandoned,
    ConnectFailed,
    FirstByteTimeout,
    HttpClient,
    HttpResponse,
    IncompleteResponse,
    Origin,
    ResponseTooLarge,
    system_resolve,
)
from deepserve.gateway.server import running_gateway
from deepserve.net import free_port
from tests.helpers import FAKE_MODEL, FakeClock, until

from .conftest import gateway_config

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def raw_server(handler: Handler) -> AsyncIterator[tuple[Origin, list[int]]]:
    """A TCP server running HANDLER per connection; yields its origin and a list that grows by one per connection."""
    connections: list[int] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        try:
            await handler(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    try:
        yield Origin("127.0.0.1", server.sockets[0].getsockname()[1], tls=False), connections
    finally:
        server.close()


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    return head + await reader.readexactly(length)


async def _chunked_answers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Keep-alive: answer every request with two chunks that echo its body."""
    while True:
        try:
            request = await _read_request(reader)
        except asyncio.IncompleteReadError:
            return
        body = request.partition(b"\r\n\r\n")[2]
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        for part in (b"got:", body):
            writer.write(b"%x\r\n%s\r\n" % (len(part), part))
        writer.write(b"0\r\n\r\n")
        await writer.drain()


def _client(clock: FakeClock | None = None, *, read_timeout_s: float = 5.0, idle_s: float = 4.0) -> HttpClient:
    return HttpClient(connect_timeout_s=2.0, read_timeout_s=read_timeout_s, idle_s=idle_s, clock=clock or FakeClock())


async def test_responses_are_read_whole_or_in_chunks_over_one_kept_alive_connection() -> None:
    client = _client()
    async with raw_server(_chunked_answers) as (origin, connections):
        first = await client.request("POST", origin, "/v1/x", b'{"a":1}')
        assert first.status == 200
        assert [chunk async for chunk in first.chunks()] == [b"got:", b'{"a":1}']
        first.release()
        second = await client.request("POST", origin, "/v1/x", b"{}")
        assert await second.read() == b"got:{}"
        second.release()
        assert len(connections) == 1
    await client.close()


async def test_next_data_joins_what_arrived_together_and_waits_for_the_rest() -> None:
    """The relay's read: chunks the upstream wrote at once (a stream's role chunk and first token) come back as one
    piece, so that they reach the client in one write; a later chunk is waited for; b"" ends the body."""
    later = asyncio.Event()

    async def role_and_token_then_more(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        writer.write(head + b"5\r\nrole\n\r\n6\r\ntoken\n\r\n")
        await writer.drain()
        await later.wait()
        writer.write(b"5\r\nnext\n\r\n0\r\n\r\n")
        await writer.drain()

    client = _client()
    async with raw_server(role_and_token_then_more) as (origin, _):
        response = await client.request("POST", origin, "/v1/x", b"{}")
        await until(lambda: response.buffered_chunks == 2)
        assert await response.next_data() == b"role\ntoken\n"
        later.set()
        assert await response.next_data() == b"next\n"
        assert await response.next_data() == b""
        response.release()
    await client.close()


def _stream_in_three_writes(steps: list[asyncio.Event]) -> Handler:
    """An upstream that writes a stream's role chunk and first token at once, then one event per step of STEPS,
    then ends the body."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        writer.write(head + b"5\r\nrole\n\r\n6\r\ntoken\n\r\n")
        await writer.drain()
        for index, step in enumerate(steps):
            await step.wait()
            writer.write(b"6\r\nnext%d\n\r\n" % index)
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    return handler


async def _next_event_through(response: HttpResponse, sink: Callable[[bytes], bool], send_next: asyncio.Event) -> bytes:
    """Read what came with the head, then wait with SINK given while the upstream sends its next event."""
    assert await response.next_data() == b"role\ntoken\n"
    reading = asyncio.ensure_future(response.next_data(sink))
    await asyncio.sleep(0.05)  # the reader is asleep, its sink given
    send_next.set()
    return await asyncio.wait_for(reading, 5)


async def test_a_sink_gets_each_read_from_the_read_callback_while_the_reader_sleeps() -> None:
    """The relay's fast path: what arrives while the reader waits goes to the sink, a read's chunks joined, and the
    reader's task is not woken for it; it wakes once, at the end of the body."""
    steps = [asyncio.Event(), asyncio.Event()]
    taken: list[bytes] = []

    def sink(data: bytes) -> bool:
        taken.append(data)
        steps[1].set()  # the next event is sent once this one was taken
        return True

    client = _client()
    async with raw_server(_stream_in_three_writes(steps)) as (origin, _):
        response = await client.request("POST", origin, "/v1/x", b"{}")
        reads = 0
        while True:
            reads += 1
            data = await asyncio.wait_for(response.next_data(sink), 5)
            if data:
                taken.append(data)  # arrived with the head, before the sink was given
                steps[0].set()
            elif response.complete:
                break
        assert b"".join(taken) == b"role\ntoken\nnext0\nnext1\n"
        assert reads <= 2  # one read at most for what came with the head, then one wake at the end
        response.release()
    await client.close()


async def test_a_sink_that_can_take_no_more_hands_the_rest_back_to_its_reader() -> None:
    """A sink answering False (the client downstream pushes back) stops the callbacks: the reader wakes with b"",
    and what arrives next waits for it in the queue, in order."""
    steps = [asyncio.Event(), asyncio.Event()]
    taken: list[bytes] = []

    def sink_once(data: bytes) -> bool:
        taken.append(data)
        return False

    client = _client()
    async with raw_server(_stream_in_three_writes(steps)) as (origin, _):
        response = await client.request("POST", origin, "/v1/x", b"{}")
        assert await _next_event_through(response, sink_once, steps[0]) == b""
        assert taken == [b"next0\n"] and not response.complete
        steps[1].set()
        assert await asyncio.wait_for(response.next_data(), 5) == b"next1\n"
        assert await asyncio.wait_for(response.next_data(), 5) == b""
        assert response.complete and taken == [b"next0\n"]
        response.release()
    await client.close()


async def test_a_sink_that_fails_fails_its_reader() -> None:
    steps = [asyncio.Event(), asyncio.Event()]

    def broken_sink(data: bytes) -> bool:
        raise ValueError("the sink broke")

    client = _client()
    async with raw_server(_stream_in_three_writes(steps)) as (origin, _):
        response = await client.request("POST", origin, "/v1/x", b"{}")
        with pytest.raises(ValueError, match="the sink broke"):
            await _next_event_through(response, broken_sink, steps[0])
        response.close()
    await client.close()


async def test_idle_connections_are_closed_before_the_server_would() -> None:
    clock = FakeClock()
    client = _client(clock, idle_s=4.0)
    async with raw_server(_chunked_answers) as (origin, connections):
        for idle_s in (3.9, 4.0):  # reused just before IDLE_S, not at it
            response = await client.request("POST", origin, "/", b"{}")
            await response.read()
            response.release()
            clock.now_s += idle_s
        response = await client.request("POST", origin, "/", b"{}")
        await response.read()
        response.release()
        assert len(connections) == 2
        clock.now_s += 4.0
        client.sweep_idle()  # what the sweeper task does every IDLE_S / 2
        assert client.open_connections == 0  # closed without waiting for a request
    await client.close()


async def test_a_closed_response_is_not_reused() -> None:
    client = _client()
    async with raw_server(_chunked_answers) as (origin, connections):
        response = await client.request("POST", origin, "/", b"{}")
        response.close()  # mid-response: the server must see the connection go
        response = await client.request("POST", origin, "/", b"{}")
        assert await response.read() == b"got:{}"
        assert len(connections) == 2
    await client.close()


async def test_nothing_listening_is_a_connect_failure() -> None:
    client = _client()
    with pytest.raises(ConnectFailed):
        await client.request("POST", Origin("127.0.0.1", free_port(), tls=False), "/", b"{}")
    await client.close()


async def test_a_connection_dropped_mid_body_is_an_incomplete_response() -> None:
    async def drop_after_one_chunk(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n4\r\ndata\r\n")
        await writer.drain()

    client = _client()
    async with raw_server(drop_after_one_chunk) as (origin, _):
        response = await client.request("POST", origin, "/", b"{}")
        chunks = response.chunks()
        assert await anext(chunks) == b"data"
        with pytest.raises(IncompleteResponse):
            await anext(chunks)
        response.close()
    await client.close()


async def _stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answer the head and one chunk, then say nothing more."""
    await _read_request(reader)
    writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n4\r\ndata\r\n")
    await writer.drain()
    await asyncio.sleep(30)


async def test_silence_mid_response_times_out_after_the_read_timeout() -> None:
    clock = FakeClock()
    client = _client(clock, read_timeout_s=5.0)
    async with raw_server(_stall) as (origin, _):
        response = await client.request("POST", origin, "/", b"{}")
        chunks = response.chunks()
        assert await anext(chunks) == b"data"
        clock.now_s += 4.9
        client.check_timeouts()  # not yet
        reading = asyncio.ensure_future(anext(chunks))
        await asyncio.sleep(0)
        assert not reading.done()
        clock.now_s += 0.1
        client.check_timeouts()
        with pytest.raises(TimeoutError):
            await reading
        assert client.open_connections == 0  # the connection was closed
        response.close()
    await client.close()


async def test_the_read_timeout_fires_by_itself_on_the_loops_timer() -> None:
    client = HttpClient(connect_timeout_s=2.0, read_timeout_s=0.2, idle_s=4.0)  # the real clock
    async with raw_server(_stall) as (origin, _):
        response = await client.request("POST", origin, "/", b"{}")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(response.read(), 20)  # the bound only keeps a broken timer from hanging the run
        response.close()
    await client.close()


async def test_a_reader_that_falls_behind_pauses_the_upstream_and_loses_nothing() -> None:
    parts = [b"event %03d;" % index for index in range(200)]

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for part in parts:
            writer.write(b"%x\r\n%s\r\n" % (len(part), part))
            await writer.drain()
            await asyncio.sleep(0)  # one chunk per segment, as a streaming engine sends them
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    client = _client()
    async with raw_server(flood) as (origin, _):
        response = await client.request("POST", origin, "/", b"{}")
        await until(lambda: response.reading_paused)  # the reader is busy elsewhere: TCP pushes back
        assert response.buffered_chunks < 100  # instead of memory growing
        assert await response.read() == b"".join(parts)
        response.release()
    await client.close()


async def test_a_body_without_length_or_chunks_ends_when_the_server_closes() -> None:
    async def close_delimited(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it")
        await writer.drain()

    client = _client()
    async with raw_server(close_delimited) as (origin, _):
        response = await client.request("POST", origin, "/", b"{}")
        assert await response.read() == b"all of it"
        response.release()
    await client.close()


def test_an_ipv6_origin_gets_a_bracketed_host_header() -> None:
    assert Origin("::1", 8000, tls=False).host_header == "[::1]:8000"
    assert Origin("127.0.0.1", 8000, tls=False).host_header == "127.0.0.1:8000"


@pytest.mark.parametrize("one_write", [True, False])
async def test_an_interim_103_is_skipped_and_the_final_response_is_returned(one_write: bool) -> None:
    early_hints = b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload\r\n\r\n"
    final = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{"ok":true}'

    async def hints_then_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                await _read_request(reader)
            except asyncio.IncompleteReadError:
                return
            writer.write(early_hints)
            if not one_write:
                await writer.drain()
                await asyncio.sleep(0.05)
            writer.write(final)
            await writer.drain()

    client = _client()
    async with raw_server(hints_then_answer) as (origin, connections):
        for _ in range(2):  # the second request on the pooled connection gets its own answer, not a leftover
            response = await client.request("POST", origin, "/", b"{}")
            assert response.status == 200
            assert await response.read() == b'{"ok":true}'
            response.release()
        assert len(connections) == 1
    await client.close()


async def test_our_own_backpressure_is_not_taken_for_upstream_silence() -> None:
    parts = [b"event %03d;" % index for index in range(200)]

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for part in parts:
            writer.write(b"%x\r\n%s\r\n" % (len(part), part))
            await writer.drain()
            await asyncio.sleep(0)
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    clock = FakeClock()
    client = _client(clock, read_timeout_s=5.0)
    async with raw_server(flood) as (origin, _):
        response = await client.request("POST", origin, "/", b"{}")
        await until(lambda: response.reading_paused)
        for _ in range(3):  # a slow client downstream: reading stays paused for three read timeouts
            clock.now_s += 5.0
            client.check_timeouts()
        assert await response.read() == b"".join(parts)
        response.release()
    await client.close()


async def test_releasing_twice_pools_the_connection_once() -> None:
    client = _client()
    async with raw_server(_chunked_answers) as (origin, connections):
        response = await client.request("POST", origin, "/", b"{}")
        await response.read()
        response.release()
        response.release()
        both = [client.request("POST", origin, "/", b'{"n":%d}' % n) for n in range(2)]
        responses = await asyncio.wait_for(asyncio.gather(*both), 3)
        bodies = await asyncio.wait_for(asyncio.gather(*(r.read() for r in responses)), 3)
        assert bodies == [b'got:{"n":0}', b'got:{"n":1}']  # two requests never share one connection
        assert len(connections) == 2
        for response in responses:
            response.release()
    await client.close()


async def test_a_response_released_unread_does_not_pool_its_connection() -> None:
    parts = [b"event %03d;" % index for index in range(100)]  # past the pause mark, all in one segment

    async def answer_at_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                await _read_request(reader)
            except asyncio.IncompleteReadError:
                return
            chunks = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in parts)
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n")
            await writer.drain()

    client = _client(read_timeout_s=1.0)
    async with raw_server(answer_at_once) as (origin, connections):
        unread = await client.request("POST", origin, "/", b"{}")
        await until(lambda: unread.reading_paused)  # the answer is queued and reading is paused
        unread.release()
        response = await client.request("POST", origin, "/", b"{}")
        assert await response.read() == b"".join(parts)
        response.release()
        assert len(connections) == 2
    await client.close()


class CountingResolver:
    """Resolves every name to the addresses in `answer` (the system resolver for 'localhost'), counting calls."""

    def __init__(self, answer: list[str] | None = None) -> None:
        self.answer = answer
        self.calls = 0

    async def __call__(self, host: str, port: int) -> list[str]:
        self.calls += 1
        return list(self.answer) if self.answer is not None else await system_resolve(host, port)


async def _serve(host: str, port: int) -> asyncio.Server:
    return await asyncio.start_server(_chunked_answers, host, port)


async def test_a_host_name_is_resolved_once_per_ttl_not_per_connection() -> None:
    resolver = CountingResolver()
    clock = FakeClock()
    client = HttpClient(
        connect_timeout_s=2.0, read_timeout_s=5.0, idle_s=4.0, dns_ttl_s=60.0, resolve=resolver, clock=clock
    )
    server = await _serve("127.0.0.1", 0)
    origin = Origin("localhost", server.sockets[0].getsockname()[1], tls=False)
    try:
        for _ in range(3):
            response = await client.request("POST", origin, "/", b"{}")
            response.close()  # a new connection each time
        assert resolver.calls == 1
        clock.now_s += 60.0  # the TTL is over
        response = await client.request("POST", origin, "/", b"{}")
        assert await response.read() == b"got:{}"
        response.release()
        assert resolver.calls == 2
    finally:
        await client.close()
        server.close()


async def test_a_refused_cached_address_is_resolved_again() -> None:
    resolver = CountingResolver(["127.0.0.1"])
    client = HttpClient(connect_timeout_s=2.0, read_timeout_s=5.0, idle_s=4.0, resolve=resolver)
    first = await _serve("127.0.0.1", 0)
    port = first.sockets[0].getsockname()[1]
    origin = Origin("engine.internal", port, tls=False)
    try:
        response = await client.request("POST", origin, "/", b"{}")
        response.close()
        first.close()
        await first.wait_closed()
        moved = await _serve("127.0.0.2", port)  # the service moved to another address
        resolver.answer = ["127.0.0.2"]
        try:
            response = await client.request("POST", origin, "/", b"{}")
            assert await response.read() == b"got:{}"
            response.release()
        finally:
            moved.close()
        assert resolver.calls == 2
    finally:
        await client.close()


async def test_the_loop_is_the_one_asked_for(request: pytest.FixtureRequest) -> None:
    """conftest runs every test in this module on asyncio's loop and on uvloop's (the gateway's), whose transports
    differ."""
    loop_module = type(asyncio.get_running_loop()).__module__
    assert ("uvloop" in loop_module) == request.node.name.endswith("[uvloop]")


async def _never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await _read_request(reader)
    await asyncio.sleep(30)


async def _sent(client: HttpClient, request: asyncio.Future[HttpResponse]) -> None:
    """Wait until REQUEST's connection has sent it and waits for the head."""
    await until(lambda: client.awaiting_head > 0 or request.done())


async def test_silence_before_the_response_head_times_out() -> None:
    clock = FakeClock()
    client = _client(clock, read_timeout_s=5.0)
    async with raw_server(_never_answer) as (origin, _):
        request = asyncio.ensure_future(client.request("POST", origin, "/", b"{}"))
        await _sent(client, request)
        clock.now_s += 5.0
        client.check_timeouts()
        with pytest.raises(TimeoutError):
            await request
        assert client.open_connections == 0  # the connection was closed, not pooled
    await client.close()


async def test_a_first_byte_timeout_is_shorter_than_the_read_timeout() -> None:
    clock = FakeClock()
    client = _client(clock, read_timeout_s=600.0)
    async with raw_server(_never_answer) as (origin, _):
        request = asyncio.ensure_future(client.request("POST", origin, "/", b"{}", head_timeout_s=2.0))
        await _sent(client, request)
        clock.now_s += 1.9
        client.check_timeouts()
        assert not request.done()
        clock.now_s += 0.1
        client.check_timeouts()
        with pytest.raises(FirstByteTimeout):
            await request
        assert client.open_connections == 0
    await client.close()


async def test_a_first_byte_timeout_does_not_limit_a_response_that_started() -> None:
    clock = FakeClock()
    client = _client(clock, read_timeout_s=600.0)
    async with raw_server(_stall) as (origin, _):
        response = await client.request("POST", origin, "/", b"{}", head_timeout_s=2.0)
        chunks = response.chunks()
        assert await anext(chunks) == b"data"
        clock.now_s += 100.0  # silent mid-response, well past the first-byte timeout, within the read timeout
        client.check_timeouts()
        assert client.open_connections
        response.close()
    await client.close()


async def test_the_first_byte_timeout_fires_by_itself_on_the_loops_timer() -> None:
    client = HttpClient(connect_timeout_s=2.0, read_timeout_s=600.0, idle_s=4.0)  # the real clock
    async with raw_server(_never_answer) as (origin, _):
        with pytest.raises(FirstByteTimeout):
            await asyncio.wait_for(client.request("POST", origin, "/", b"{}", head_timeout_s=0.1), 20)
    await client.close()


async def test_requests_waiting_for_a_head_can_be_abandoned_and_answers_under_way_are_kept() -> None:
    client = _client()
    async with raw_server(_never_answer) as (silent, _), raw_server(_stall) as (streaming, _):
        started = await client.request("POST", streaming, "/", b"{}")
        waiting = asyncio.ensure_future(client.request("POST", silent, "/", b"{}"))
        await _sent(client, waiting)
        assert client.abort_waiting(streaming, "replica left") == 0  # its answer is under way
        assert client.abort_waiting(silent, "replica left") == 1
        with pytest.raises(Abandoned, match="replica left"):
            await waiting
        assert await anext(started.chunks()) == b"data"
        started.close()
    await client.close()


async def test_a_204_has_no_body_and_keeps_the_connection() -> None:
    async def no_content(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                await _read_request(reader)
            except asyncio.IncompleteReadError:
                return
            writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
            await writer.drain()

    client = _client(read_timeout_s=1.0)
    async with raw_server(no_content) as (origin, connections):
        for _ in range(2):
            response = await client.request("POST", origin, "/", b"{}")
            assert response.status == 204
            assert await asyncio.wait_for(response.read(), 2) == b""
            response.release()
        assert len(connections) == 1
    await client.close()


async def _read_any_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """(request line, body) of a request with or without a body."""
    head = await reader.readuntil(b"\r\n\r\n")
    lengths = [int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")]
    return head.split(b"\r\n")[0], await reader.readexactly(lengths[0]) if lengths else b""


async def test_the_gateway_retries_a_request_whose_pooled_connection_the_upstream_closed() -> None:
    """An engine closing an idle keep-alive connection just as a request is sent on it (uvicorn after 5 s): the
    request fails without an answer, and the gateway sends it again on a new connection."""
    models = b'{"object":"list","data":[{"id":"%s","object":"model","max_model_len":4096}]}' % FAKE_MODEL.encode()
    answer = b'{"id":"x","object":"chat.completion","choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1}}'
    posts: list[int] = []  # the connection number of every generation request received
    numbers = itertools.count()

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        number, served = next(numbers), 0
        while True:
            try:
                line, _ = await _read_any_request(reader)
            except asyncio.IncompleteReadError:
                return
            if line.startswith(b"POST"):
                posts.append(number)
                served += 1
                if served > 1:
                    return  # closes on the second request over this connection, answering nothing
                body = answer
            else:
                body = models if b"/v1/models" in line else b"{}"
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body))
            writer.write(body)
            await writer.drain()

    chat = {"model": FAKE_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    async with raw_server(engine) as (origin, _):
        # no health loop during the test: its checks share the keep-alive pool and could take the idle connection
        config = gateway_config(f"http://127.0.0.1:{origin.port}/v1", health_check_interval_s=3600)
        async with running_gateway(config) as (app, url), httpx.AsyncClient(base_url=url) as client:
            statuses = [(await client.post("/chat/completions", json=chat)).status_code for _ in range(2)]
            assert statuses == [200, 200]
            assert len(posts) == 3 and posts[0] == posts[1] != posts[2]  # dropped on the reused one, then a new one
            assert app.pool.replicas[0].healthy


async def test_fetch_reads_a_whole_answer_within_its_deadline_and_reuses_the_connection() -> None:
    async with raw_server(_chunked_answers) as (origin, connections):
        client = _client()
        try:
            assert await client.fetch("POST", origin, "/metrics", b"[]", timeout_s=5) == (200, b"got:[]")
            assert await client.fetch("POST", origin, "/x", b"{}", timeout_s=5, headers=b"X-A: 1\r\n") == (
                200,
                b"got:{}",
            )
            assert len(connections) == 1  # health checks and scrapes share the requests' keep-alive pool
        finally:
            await client.close()


async def test_fetch_gives_up_at_its_deadline_with_a_timeout_and_drops_the_connection() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await asyncio.sleep(30)

    async with raw_server(silent) as (origin, _):
        client = _client()
        try:
            with pytest.raises(TimeoutError):
                await client.fetch("GET", origin, "/health", timeout_s=0.2)
            assert client.open_connections == 0  # the late exchange's connection is not kept for another request
        finally:
            await client.close()


async def test_fetch_refuses_an_answer_over_its_limit() -> None:
    async with raw_server(_chunked_answers) as (origin, _):
        client = _client()
        try:
            with pytest.raises(ResponseTooLarge):
                await client.fetch("POST", origin, "/x", b"x" * 100, timeout_s=5, max_bytes=50)
        finally:
            await client.close()


def test_the_gateway_has_one_http_client() -> None:
    """Issue 23: health checks, model listings and metrics scrapes went through aiohttp beside the gateway's own
    client; now every call to an engine goes through the pool's one HttpClient. No gateway module imports aiohttp."""
    import importlib
    import pkgutil
    import sys

    import deepserve.gateway

    for module in pkgutil.iter_modules(deepserve.gateway.__path__, "deepserve.gateway."):
        importlib.import_module(module.name)
    importers = [
        name
        for name, module in sys.modules.items()
        if name.startswith("deepserve.gateway") and "aiohttp" in vars(module)
    ]
    assert not importers, f"gateway modules import aiohttp: {importers}"
