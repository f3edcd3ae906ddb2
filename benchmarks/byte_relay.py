"""A TCP relay that only copies bytes, on the gateway's event loop (uvloop): the least any proxy written in Python on
this stack can add. benchmarks/gateway_overhead.py measures it as the `byte-relay` path, beside the gateway, so that
what the gateway adds is read against the floor of the hop itself (two sockets per stream, two system calls per
event) and not against zero.

    .venv/bin/python benchmarks/byte_relay.py --port 8001 --upstream 127.0.0.1:8000

Each client connection gets a connection of its own to the upstream; what either side sends is written to the other
from the read callback. When one side's writes back up, the other side stops being read until they drain."""

from __future__ import annotations

import argparse
import asyncio


class _Side(asyncio.Protocol):
    """One of the relay's two connections; `peer` is the other."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None
        self.pending: list[bytes] = []  # what arrived before the two sides were joined

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports do not subclass asyncio's

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is None or peer.transport is None:
            self.pending.append(data)
            return
        peer.transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()

    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()


class _Client(_Side):
    def __init__(self, upstream: tuple[str, int]) -> None:
        super().__init__()
        self._upstream = upstream

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, upstream = await loop.create_connection(_Side, *self._upstream)
        except OSError:
            if self.transport is not None:
                self.transport.close()
            return
        upstream.peer, self.peer = self, upstream
        if self.transport is None:  # the client left while we connected
            if upstream.transport is not None:
                upstream.transport.close()
            return
        assert upstream.transport is not None
        for side, to in ((self, upstream.transport), (upstream, self.transport)):  # what came before both were up
            for data in side.pending:
                to.write(data)
            side.pending.clear()


async def serve(port: int, upstream: tuple[str, int]) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Client(upstream), "127.0.0.1", port, backlog=4096)
    print(f"RELAY READY on 127.0.0.1:{port} -> {upstream[0]}:{upstream[1]}", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="HOST:PORT")
    args = parser.parse_args()
    host, _, port = args.upstream.rpartition(":")
    if not host or not port.isdigit():
        parser.error(f"--upstream {args.upstream!r}: give HOST:PORT, e.g. 127.0.0.1:8000")
    import uvloop

    uvloop.run(serve(args.port, (host, int(port))))


if __name__ == "__main__":
    main()
