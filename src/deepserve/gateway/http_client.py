"""A lean HTTP/1.1 client for the upstream pool: one asyncio Protocol per connection, httptools' response parser,
keep-alive connections per origin.

It is the gateway process's one HTTP client: requests, health checks, model listings and metrics scrapes all go
through it, with one timeout and error family. It does only what the gateway needs from an engine (POST a JSON body
or GET, read a response whole or as it arrives; `fetch`: a whole exchange within one deadline) and does it with
little work per event: the body chunk the parser hands over is queued as is, a read
wakes one future, and the read timeout is one timer per response that is moved only when it fires (an idle check),
not re-armed on every chunk, and paused while we stop reading for a slow reader. A request may also set a deadline
for the response head (the first-byte timeout), checked by the same timer. Host names are resolved once per
DNS_TTL_S, not per connection. Upstream failures are OSErrors (ConnectFailed, IncompleteResponse, TimeoutError,
FirstByteTimeout, Abandoned, ResponseTooLarge); the upstream pool maps them to the gateway's, and lets anything else
(our bugs) through.

Every deadline is computed from an injected clock (`clock`, time.monotonic by default); the event loop's timers
only decide when to look. Tests move a fake clock and call `check_timeouts` or `sweep_idle` instead of sleeping."""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import socket
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import cast

import httptools

from deepserve import _compat
from deepserve.gateway.clock import Clock

# Flow control: stop reading from the upstream while this many body chunks wait for the reader; go on at half that.
_PAUSE_AT_CHUNKS = 64
_RESUME_AT_CHUNKS = _PAUSE_AT_CHUNKS // 2
# Takes one read's body from the connection's read callback: True to go on, False when it can take no more now.
BodySink = Callable[[bytes], bool]
# A host name's addresses are reused this long (a Kubernetes service's name resolves on every new connection
# otherwise, in the default executor); a connect failure on a reused address resolves again at once.
DNS_TTL_S = 60.0

# The most a `fetch` reads of one answer (an engine's /metrics is about 100 KB): beyond it the answer is refused.
MAX_FETCH_BYTES = 16 << 20

# (host, port) -> the IP addresses to try, in order.
Resolver = Callable[[str, int], Awaitable[list[str]]]


async def system_resolve(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


class IncompleteResponse(ConnectionError):
    """The upstream closed the connection before the response was complete."""


class ConnectFailed(ConnectionError):
    """No connection could be opened (refused, unreachable, unknown host): nothing was sent."""


class FirstByteTimeout(TimeoutError):
    """The upstream accepted the request but sent no response head within the request's first-byte timeout."""


class Abandoned(ConnectionError):
    """The request was given up while it waited for the response head (`HttpClient.abort_waiting`)."""


class ResponseTooLarge(ConnectionError):
    """A `fetch` answer longer than its limit: the connection is dropped rather than read on."""


class HttpResponse:
    """A response whose head has arrived. Read it (`read`, `chunks`), then `release` (its connection goes back to the
    pool when the response was read to the end) or `close` (the connection is dropped: the server sees the abort)."""

    __slots__ = ("_connection", "_detached", "status")

    def __init__(self, connection: _Connection, status: int) -> None:
        self._connection = connection
        self._detached = False  # released or closed: the connection may already serve another request
        self.status = status

    def next_data(self, sink: BodySink | None = None) -> Awaitable[bytes]:
        """The body that arrived since the last call, as soon as there is some (every chunk waiting, joined), b""
        at the end: the relay's loop, with no generator between it and the connection. What the upstream sent
        together goes on together: a stream's role chunk and first token, which vLLM and SGLang write at once, reach
        the client in one write rather than two (the second one's time is the client's TTFT).

        With SINK, what arrives while the caller waits is handed to SINK from the connection's read callback, each
        read's body joined, instead of waking the caller: the caller's task sleeps until the response ends, it
        fails, or SINK answers False (it cannot take more now); then this returns b"" (see `complete`)."""
        return self._connection.next_data(sink)

    @property
    def complete(self) -> bool:
        """The whole body arrived and was read (or handed to a sink)."""
        connection = self._connection
        return connection._complete and not connection._chunks  # the module's own class

    async def chunks(self) -> AsyncIterator[bytes]:
        connection = self._connection
        while True:
            chunk = await connection.next_chunk()
            if not chunk:
                return
            yield chunk

    async def read(self) -> bytes:
        parts = [chunk async for chunk in self.chunks()]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def release(self) -> None:
        """Once only: a second call (or one after `close`) does nothing."""
        if not self._detached:
            self._detached = True
            self._connection.release()

    def close(self) -> None:
        if not self._detached:
            self._detached = True
            self._connection.close()

    @property
    def reading_paused(self) -> bool:
        """Whether the connection stopped reading from the upstream (the reader is behind: TCP pushes back)."""
        return self._connection.reading_paused

    @property
    def buffered_chunks(self) -> int:
        """Body chunks received and not read yet."""
        return len(self._connection._chunks)  # the module's own class


class _Connection(asyncio.Protocol):
    """One keep-alive connection to ORIGIN: the parser's callbacks fill a queue of body chunks that one reader
    awaits."""

    def __init__(self, pool: HttpClient, origin: tuple[str, int, bool], read_timeout_s: float) -> None:
        self._pool = pool
        self._clock = pool.clock
        self.origin = origin
        self._read_timeout_s = read_timeout_s
        self._head_deadline_s: float | None = None  # when the response head must have arrived (first-byte timeout)
        self.awaiting_head = False  # a request was sent and its response head has not arrived
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._chunks: collections.deque[bytes] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._sink: BodySink | None = None  # takes each read's body while the reader sleeps (next_data)
        self._head_done = False
        self._interim = False  # between an interim (1xx) head and its end
        self._complete = False
        self._error: BaseException | None = None
        self._framed = False
        self._keep_alive = True
        self._last_data_s = 0.0
        self._paused = False  # we stopped reading (our reader is behind): the upstream's silence is ours
        self._timer: asyncio.TimerHandle | None = None
        self.idle_since_s = 0.0

    # ---- asyncio.Protocol --------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's

    def data_received(self, data: bytes) -> None:
        self._last_data_s = self._clock()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(IncompleteResponse(f"malformed response from the upstream: {exc}"))
            self.close()
            return
        sink = self._sink
        if sink is not None and self._chunks:
            self._hand_to_sink(sink)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._pool.forget(self)
        if not self._complete and exc is None and self._head_done and not self._framed:
            self._complete = True  # neither length nor chunks: the body is whatever came before the close (RFC 9112)
            self._wake()
        elif not self._complete:
            self._fail(exc or IncompleteResponse("the upstream closed the connection before the response ended"))

    # ---- httptools callbacks -----------------------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() in (b"content-length", b"transfer-encoding"):
            self._framed = True

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            # An interim response (100 Continue, 103 Early Hints): the final one follows on the same connection.
            self._interim = True
            self._framed = False
            return
        self._head_done = True
        self._keep_alive = self._parser.should_keep_alive()
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        if len(self._chunks) == _PAUSE_AT_CHUNKS and self._transport is not None:
            self._transport.pause_reading()  # the reader (a slow client downstream) is behind: let TCP push back
            self._paused = True
        if self._sink is None:  # a sink gets the read's body, joined, once the parser is through it
            self._wake()

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self._complete = True
        self._wake()

    # ---- one exchange ------------------------------------------------------------------------------------------

    @property
    def reusable(self) -> bool:
        return self._transport is not None and not self._transport.is_closing()

    @property
    def reading_paused(self) -> bool:
        transport = self._transport
        return transport is not None and not transport.is_reading()

    async def exchange(self, head: bytes, body: bytes, head_timeout_s: float | None = None) -> HttpResponse:
        """Send a request; return once the response's head arrived (within HEAD_TIMEOUT_S, when given)."""
        if self._transport is None:  # the upstream closed it between connect (or the pool) and now
            raise IncompleteResponse("the upstream closed the connection before the request was sent")
        self._parser = httptools.HttpResponseParser(self)
        self._chunks.clear()
        self._head_done = self._complete = self._interim = False
        self._error = None
        self._framed = False
        self._transport.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            self._transport.write(body)
        now_s = self._last_data_s = self._clock()
        self._head_deadline_s = None if head_timeout_s is None else now_s + head_timeout_s
        self.awaiting_head = True
        self.check_deadlines()  # arms the timer for the nearer of the two deadlines
        try:
            while not self._head_done:
                await self._wait()
        finally:
            self.awaiting_head = False
            self._head_deadline_s = None
        status = self._parser.get_status_code()
        return HttpResponse(self, status)

    async def next_data(self, sink: BodySink | None = None) -> bytes:
        """Every body chunk waiting, joined, or b"" at the end of the response (the per-event path); with SINK, b""
        also once SINK has taken what arrived and the caller is to look again (HttpResponse.next_data)."""
        while True:
            if self._chunks:
                return self._take_chunks()
            if self._complete:
                return b""
            if self._error is not None:
                raise self._error
            if sink is None:
                await self._data_arrives()
                continue
            self._sink = sink
            try:
                await self._data_arrives()
            finally:
                self._sink = None
            if not self._chunks:
                if self._error is not None:
                    raise self._error
                return b""

    def _take_chunks(self) -> bytes:
        chunks = self._chunks
        if self._paused:
            self._resume()
        if len(chunks) == 1:
            return chunks.popleft()
        data = b"".join(chunks)
        chunks.clear()
        return data

    def _hand_to_sink(self, sink: BodySink) -> None:
        """Give SINK the body of one read, from the read callback; wake the reader when SINK takes no more."""
        try:
            go_on = sink(self._take_chunks())
        except Exception as exc:  # the sink's own failure: its reader raises it
            go_on = False
            self._fail(exc)
        if not go_on:
            self._sink = None
            self._wake()

    async def _data_arrives(self) -> None:
        """Until data_received, the end of the response or the connection's loss wakes this reader."""
        self._waiter = waiter = asyncio.get_running_loop().create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    async def next_chunk(self) -> bytes:
        """The next body chunk, or b"" at the end of the response."""
        chunks = self._chunks
        while not chunks:
            if self._complete:
                return b""
            if self._error is not None:
                raise self._error
            await self._data_arrives()
        if self._paused and len(chunks) <= _RESUME_AT_CHUNKS:
            self._resume()
        return chunks.popleft()

    async def _wait(self) -> None:
        if self._error is not None:
            raise self._error
        await self._data_arrives()
        if self._error is not None and not self._chunks:
            raise self._error

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _resume(self) -> None:
        self._paused = False
        self._last_data_s = self._clock()
        if self._transport is not None:
            self._transport.resume_reading()

    def check_deadlines(self) -> None:
        """Fail the exchange when its response head is overdue or the upstream was silent for the read timeout;
        otherwise arm the timer for the nearer deadline. One timer per response, moved only when it fires (not on
        every chunk)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._complete or self._transport is None:
            return
        now_s = self._clock()
        if self._paused:  # no data because we do not read: the upstream's clock starts again when we do
            self._last_data_s = now_s
        if self._head_deadline_s is not None and not self._head_done and now_s >= self._head_deadline_s:
            waited_s = now_s - self._last_data_s
            self._fail(FirstByteTimeout(f"no response head from the upstream within {waited_s:.1f} s"))
            self.close()
            return
        idle_s = now_s - self._last_data_s
        if idle_s >= self._read_timeout_s:
            self._fail(TimeoutError(f"no data from the upstream for {idle_s:.1f} s"))
            self.close()
            return
        due_in_s = self._read_timeout_s - idle_s
        if self._head_deadline_s is not None and not self._head_done:
            due_in_s = min(due_in_s, self._head_deadline_s - now_s)
        self._timer = asyncio.get_running_loop().call_later(due_in_s, self.check_deadlines)

    def abandon(self, reason: str) -> None:
        """Give up the request waiting on this connection: its reader gets Abandoned(REASON)."""
        self._fail(Abandoned(reason))
        self.close()

    def release(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        # Pooled only when read to the end: unread chunks (and a transport paused for them) would greet the next
        # request on this connection.
        if self._complete and not self._chunks and self._keep_alive and self.reusable:
            if self._paused:
                self._resume()
            self.idle_since_s = self._clock()
            self._pool.put_back(self)
        else:
            self.close()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        self._pool.forget(self)


class Origin:
    """Where requests go: scheme, host and port, parsed once; the Host header and TLS context are ready. NAME, when
    given, is the server's name for HOST (an address found under a DNS name): the Host header and TLS's server name."""

    __slots__ = ("host", "host_header", "is_address", "key", "port", "server_name", "tls")

    def __init__(self, host: str, port: int, tls: bool, name: str | None = None) -> None:
        self.host = host
        self.port = port
        self.tls = tls
        self.key = (host, port, tls)
        self.is_address = _is_ip_address(host)  # nothing to resolve
        self.server_name = name or host
        shown = self.server_name
        self.host_header = f"[{shown}]:{port}" if ":" in shown else f"{shown}:{port}"  # IPv6 literals in brackets


def _is_ip_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class HttpClient:
    """Keep-alive connections per origin; idle ones are closed after IDLE_S; host names resolved at most once per
    DNS_TTL_S."""

    def __init__(
        self,
        *,
        connect_timeout_s: float,
        read_timeout_s: float,
        idle_s: float,
        dns_ttl_s: float = DNS_TTL_S,
        resolve: Resolver = system_resolve,
        clock: Clock = time.monotonic,
    ) -> None:
        self.clock = clock
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.idle_s = idle_s
        self.dns_ttl_s = dns_ttl_s
        self._resolve = resolve
        self._addresses: dict[tuple[str, int], tuple[float, list[str]]] = {}  # (host, port) -> (expiry, addresses)
        self._idle: dict[tuple[str, int, bool], list[_Connection]] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self._all: set[_Connection] = set()
        self._ssl: ssl.SSLContext | None = None

    async def request(
        self,
        method: str,
        origin: Origin,
        target: str,
        body: bytes = b"",
        *,
        head_timeout_s: float | None = None,
        headers: bytes = b"",
    ) -> HttpResponse:
        """METHOD TARGET with a JSON BODY (and HEADERS: complete header lines, e.g. an Authorization); the response
        once its head arrived. Raises ConnectFailed (nothing was sent), ConnectionError (the connection dropped;
        Abandoned when `abort_waiting` gave it up), TimeoutError (connect or read; FirstByteTimeout when no head came
        within HEAD_TIMEOUT_S). Anything else is a bug of ours (e.g. a TARGET that is not latin-1) and is raised
        before a connection is taken."""
        head = (
            f"{method} {target} HTTP/1.1\r\nHost: {origin.host_header}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n"
        ).encode("latin-1")
        head += headers + b"\r\n" if headers else b"\r\n"
        connection = self._take_idle(origin.key) or await self._connect(origin)
        try:
            return await connection.exchange(head, body, head_timeout_s)
        except BaseException:
            connection.close()
            raise

    async def fetch(
        self,
        method: str,
        origin: Origin,
        target: str,
        body: bytes = b"",
        *,
        timeout_s: float,
        max_bytes: int = MAX_FETCH_BYTES,
        headers: bytes = b"",
    ) -> tuple[int, bytes]:
        """(status, body) of a whole exchange that must end within TIMEOUT_S (TimeoutError otherwise): health
        checks, model listings, metrics scrapes. An answer over MAX_BYTES raises ResponseTooLarge. Raises what
        `request` raises."""
        async with _compat.timeout(timeout_s):
            response = await self.request(method, origin, target, body, headers=headers)
            try:
                parts: list[bytes] = []
                size = 0
                async for chunk in response.chunks():
                    size += len(chunk)
                    if size > max_bytes:
                        raise ResponseTooLarge(f"the answer to {method} {target} is over {max_bytes} bytes")
                    parts.append(chunk)
            except BaseException:
                response.close()
                raise
            response.release()
            return response.status, b"".join(parts)

    def _take_idle(self, origin: tuple[str, int, bool]) -> _Connection | None:
        idle = self._idle.get(origin)
        now_s = self.clock()
        while idle:
            connection = idle.pop()
            if connection.reusable and now_s - connection.idle_since_s < self.idle_s:
                return connection
            connection.close()
        return None

    async def _connect(self, origin: Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        if self._sweeper is None:
            self._sweeper = asyncio.create_task(self._sweep(), name="upstream-idle-sweep")
        tls = self._tls_context() if origin.tls else None
        try:
            async with _compat.timeout(self.connect_timeout_s):
                if origin.is_address:
                    connection = await self._open(loop, origin, [origin.host], tls)
                else:
                    connection = await self._open_resolved(loop, origin, tls)
        except TimeoutError:
            raise
        except OSError as exc:
            raise ConnectFailed(str(exc) or type(exc).__name__) from exc
        self._all.add(connection)
        return connection

    async def _open_resolved(
        self, loop: asyncio.AbstractEventLoop, origin: Origin, tls: ssl.SSLContext | None
    ) -> _Connection:
        where = (origin.host, origin.port)
        cached = self._addresses.get(where)
        if cached is not None and self.clock() < cached[0]:
            try:
                return await self._open(loop, origin, cached[1], tls)
            except OSError:
                self._addresses.pop(where, None)  # the name may point elsewhere now (a rescheduled pod)
        addresses = await self._resolve(origin.host, origin.port)
        if not addresses:
            raise OSError(f"{origin.host} resolved to no address")
        self._addresses[where] = (self.clock() + self.dns_ttl_s, addresses)
        return await self._open(loop, origin, addresses, tls)

    async def _open(
        self, loop: asyncio.AbstractEventLoop, origin: Origin, addresses: list[str], tls: ssl.SSLContext | None
    ) -> _Connection:
        """A connection to the first of ADDRESSES that accepts one (the last failure is raised)."""
        failure: OSError | None = None
        for address in addresses:
            try:
                _, connection = await loop.create_connection(
                    lambda: _Connection(self, origin.key, self.read_timeout_s),
                    address,
                    origin.port,
                    ssl=tls,
                    server_hostname=origin.server_name if tls is not None else None,
                )
                return connection
            except OSError as exc:
                failure = exc
        raise failure or OSError(f"no address to connect to for {origin.host}")

    def _tls_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    def put_back(self, connection: _Connection) -> None:
        idle = self._idle.setdefault(connection.origin, [])
        if connection not in idle:
            idle.append(connection)

    def forget(self, connection: _Connection) -> None:
        self._all.discard(connection)
        idle = self._idle.get(connection.origin)
        if idle and connection in idle:
            idle.remove(connection)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.idle_s / 2)
            self.sweep_idle()

    def sweep_idle(self) -> None:
        """Close connections idle for longer than IDLE_S (before the server closes them under a request)."""
        now_s = self.clock()
        for idle in self._idle.values():
            for connection in [c for c in idle if now_s - c.idle_since_s >= self.idle_s]:
                connection.close()

    @property
    def open_connections(self) -> int:
        """Connections open now, in use or idle."""
        return len(self._all)

    @property
    def awaiting_head(self) -> int:
        """Requests sent whose response head has not arrived yet."""
        return sum(connection.awaiting_head for connection in self._all)

    def check_timeouts(self) -> None:
        """Check every open connection's deadlines now (what their timers do when they fire)."""
        for connection in list(self._all):
            connection.check_deadlines()

    def close_idle(self, origin: Origin) -> None:
        """Close ORIGIN's idle connections (it left the pool: nothing more will be sent there)."""
        for connection in list(self._idle.get(origin.key, ())):
            connection.close()

    def abort_waiting(self, origin: Origin, reason: str) -> int:
        """Give up every request to ORIGIN that still waits for its response head (the caller may send it
        elsewhere); responses already under way are left alone. Returns how many were given up."""
        waiting = [c for c in self._all if c.origin == origin.key and c.awaiting_head]
        for connection in waiting:
            connection.abandon(reason)
        return len(waiting)

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for connection in list(self._all):
            connection.close()
        self._idle.clear()
