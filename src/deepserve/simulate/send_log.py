"""Ground truth for measuring benchmark clients (`--log-sends`): when each request arrived and when each chunk of its
stream was written, on the perf_counter clock (CLOCK_MONOTONIC, one clock for every process of the machine), so
that a client's TTFT and inter-token gaps can be compared with what the server really did
(benchmarks/bench_client_accuracy.py).

A request's arrival is the kernel's receive timestamp (SO_TIMESTAMPNS) of the read that completed it, not the
moment the event loop got round to it: the truth must not include this server's own loop lag. For that the
connections are served by a small transport over the raw socket (recvmsg with its ancillary timestamp) instead of
the loop's own. Each write is timed (a write that took long was preempted inside it) and followed by the bytes the
kernel has not transmitted yet (SIOCOUTQNSD): a write still queued there reaches the client later than the write
call, so its time is no ground truth either. The benchmark leaves such samples out and counts them.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, cast

from deepserve.net import SO_TIMESTAMPNS, TIMESTAMP_SPACE, ArrivalClock

SIOCOUTQNSD = 0x894B  # Linux: bytes in a TCP socket's send queue not yet sent


@dataclass
class StreamSends:
    """One stream: its request's arrival, then per token chunk when it was written, how long the write took, the
    bytes left unsent after it (-1: unknown) and the chunk's tokens."""

    recv_s: float
    sends_s: list[float] = field(default_factory=list)
    send_windows_s: list[float] = field(default_factory=list)
    unsent_bytes: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    def timed_write(self, transport: asyncio.Transport | None, data: bytes, chunk_tokens: list[int]) -> None:
        """Write DATA, which holds token chunks of CHUNK_TOKENS tokens each (all leave in this one write)."""
        if transport is None:
            return
        before_s = time.perf_counter()
        transport.write(data)
        window_s = time.perf_counter() - before_s
        unsent = unsent_bytes(transport)
        for tokens in chunk_tokens:
            self.sends_s.append(before_s)
            self.send_windows_s.append(window_s)
            self.unsent_bytes.append(unsent)
            self.tokens.append(tokens)


class SendLog:
    """Every logged stream, by request id (its x-request-id, or the simulator's own)."""

    def __init__(self) -> None:
        self.streams: dict[str, StreamSends] = {}

    def open(self, request_id: str, recv_s: float) -> StreamSends:
        entry = self.streams[request_id] = StreamSends(recv_s)
        return entry

    def to_json(self) -> dict[str, Any]:
        return {request_id: asdict(entry) for request_id, entry in self.streams.items()}


def unsent_bytes(transport: asyncio.Transport) -> int:
    """Bytes written but not yet transmitted by the kernel (-1 when unknown: only the raw transport can tell)."""
    if not isinstance(transport, KernelStampedTransport) or transport.closed:
        return -1
    if transport.out:
        return len(transport.out)
    try:
        raw = fcntl.ioctl(transport.fd, SIOCOUTQNSD, b"\0\0\0\0")
    except OSError:
        return -1
    return int(struct.unpack("i", raw)[0])


class StampedProtocol(Protocol):
    """What KernelStampedTransport drives: an asyncio protocol that takes each read's kernel receive time."""

    read_s_hint: float | None  # set just before data_received

    def connection_made(self, transport: asyncio.BaseTransport) -> None: ...

    def data_received(self, data: bytes) -> None: ...

    def connection_lost(self, exc: Exception | None) -> None: ...

    def pause_writing(self) -> None: ...

    def resume_writing(self) -> None: ...


class KernelStampedTransport:
    """A minimal asyncio transport over a raw socket read with recvmsg, handing the protocol the kernel's receive
    time of each read (`protocol.read_s_hint`) just before `data_received`. Writes go out at once when the socket
    takes them; the rest is buffered, with pause_writing/resume_writing around a high-water mark."""

    HIGH_WATER = 256 * 1024
    LOW_WATER = 64 * 1024

    def __init__(self, sock: socket.socket, protocol: StampedProtocol, on_close: Callable[[Any], None]) -> None:
        self.sock = sock
        self.protocol = protocol
        self.loop = asyncio.get_running_loop()
        self.fd = sock.fileno()
        self.out = bytearray()
        self.paused = False
        self.closed = False
        self.closing = False  # close() asked: closed once the buffer is out
        self.clock = ArrivalClock()
        self._on_close = on_close
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        protocol.connection_made(cast(asyncio.Transport, self))
        self.loop.add_reader(self.fd, self._on_readable)

    def _on_readable(self) -> None:
        try:
            data, ancillary, _, _ = self.sock.recvmsg(256 * 1024, TIMESTAMP_SPACE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.abort()
            return
        if not data:
            self.abort()
            return
        self.protocol.read_s_hint = self.clock.received_s(ancillary, time.perf_counter())
        self.protocol.data_received(data)

    def write(self, data: bytes) -> None:
        if self.closed or self.closing:
            return
        if not self.out:
            try:
                sent = self.sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self.abort()
                return
            if sent == len(data):
                return
            data = data[sent:]
            self.loop.add_writer(self.fd, self._on_writable)
        self.out += data
        if len(self.out) > self.HIGH_WATER and not self.paused:
            self.paused = True
            self.protocol.pause_writing()

    def _on_writable(self) -> None:
        try:
            sent = self.sock.send(self.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.abort()
            return
        del self.out[:sent]
        if not self.out:
            self.loop.remove_writer(self.fd)
            if self.closing:
                self.abort()
                return
        if self.paused and len(self.out) < self.LOW_WATER:
            self.paused = False
            self.protocol.resume_writing()

    def is_closing(self) -> bool:
        return self.closed or self.closing

    def close(self) -> None:
        """Close once what was written is out."""
        if not self.out:
            self.abort()
        else:
            self.closing = True

    def abort(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.loop.remove_reader(self.fd)
        if self.out:
            self.loop.remove_writer(self.fd)
        self.sock.close()
        self._on_close(self)
        self.protocol.connection_lost(None)


class KernelStampedServer:
    """Listens on HOST:PORT and serves each connection through a KernelStampedTransport."""

    def __init__(self, protocol_factory: Callable[[], StampedProtocol], host: str, port: int) -> None:
        self.listener = socket.create_server((host, port), backlog=4096)
        self.listener.setblocking(False)
        self.loop = asyncio.get_running_loop()
        self.connections: set[KernelStampedTransport] = set()
        self._factory = protocol_factory
        self.loop.add_reader(self.listener.fileno(), self._accept)

    @property
    def port(self) -> int:
        return int(self.listener.getsockname()[1])

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            self.connections.add(KernelStampedTransport(conn, self._factory(), self.connections.discard))

    def close(self) -> None:
        """Stop listening and drop every connection."""
        with contextlib.suppress(ValueError, OSError):
            self.loop.remove_reader(self.listener.fileno())
        self.listener.close()
        for transport in list(self.connections):
            transport.abort()
