"""The gateway's Python work for one relayed stream event, without sockets: the upstream connection's read callback
(httptools' chunked-body parse), the stream tap (event boundaries, usage, counting), the relay (time to first
event, the ITL histogram) and the client side's chunk framing, into transports that drop the bytes. What a relayed
event costs beyond this is the event loop's and the kernel's (one read and one write system call): compare it with
`server CPU ms/stream` in benchmarks/gateway_overhead.py, which counts everything.

    .venv/bin/python benchmarks/relay_event_cost.py            # a few seconds

The upstream connection is the gateway's own (`http_client._Connection`), driven as uvloop drives it: its
`data_received` with one engine event per read, as a lockstep step delivers them."""

from __future__ import annotations

import argparse
import time

from deepserve.gateway import http_client
from deepserve.gateway.relay import StreamRelay
from deepserve.gateway.streaming import StreamTap

EVENT = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"deepseek","choices":[{"index":0,'
    b'"delta":{"content":" token"},"logprobs":null,"finish_reason":null}]}\n\n'
)


class _Pool:
    clock = staticmethod(time.monotonic)

    def forget(self, connection: object) -> None:
        pass


class _DroppingTransport:
    def write(self, data: bytes) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        pass

    def is_reading(self) -> bool:
        return True


class _Exchange:
    response_started = True
    started_s = 0.0
    ttft_s = 0.0
    logged_body = None


class _Histogram:
    def observe(self, amount: float) -> None:
        pass


def per_event_us(events: int, with_relay: bool) -> float:
    """Microseconds per event through the read callback; WITH_RELAY: on to the client's framing, else the parse
    alone (the sink takes the bytes and does nothing)."""
    transport = _DroppingTransport()
    connection = http_client._Connection(_Pool(), ("engine", 8000, False), 30.0)  # type: ignore[arg-type]
    connection.connection_made(transport)  # type: ignore[arg-type]
    connection._parser.feed_data(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )

    def send_now(message: dict[str, object]) -> bool:
        body = message["body"]
        assert isinstance(body, bytes)
        transport.write(b"%x\r\n%s\r\n" % (len(body), body))  # the client side's chunk framing, as http_server does
        return True

    relay = StreamRelay(_Exchange(), StreamTap(False), _Histogram(), send_now)  # type: ignore[arg-type]
    connection._sink = relay.offer if with_relay else (lambda data: True)
    frame = b"%x\r\n%s\r\n" % (len(EVENT), EVENT)
    started = time.perf_counter()
    for _ in range(events):
        connection.data_received(frame)
    return (time.perf_counter() - started) / events * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=200_000, help="events per timing")
    parser.add_argument("--repeats", type=int, default=5, help="timings per case; the best is shown")
    args = parser.parse_args()
    print("| case | µs per event (best of repeats) | all repeats |")
    print("|---|---:|---|")
    for name, with_relay in (("read callback and chunk parse only", False), ("the whole relay path", True)):
        times = [per_event_us(args.events, with_relay) for _ in range(args.repeats)]
        print(f"| {name} | {min(times):.2f} | {' / '.join(f'{t:.2f}' for t in times)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
