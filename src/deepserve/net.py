"""Small network helpers every part shares: a free loopback port, a check that a port can be bound, and the
kernel's receive timestamps of socket reads (what the bench client and the simulator time arrivals with)."""

from __future__ import annotations

import math
import random
import socket
import struct
import time
from pathlib import Path

from deepserve.errors import ConfigError

SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux's value; Python's socket module does not export it
TIMESTAMP_SPACE = socket.CMSG_SPACE(16)  # one struct timespec


# Ray's workers bind 10002-19999 unless told otherwise (`ray start --min-worker-port/--max-worker-port`), and
# `ray start` refuses a GCS or component port inside that range; below it, registered services crowd the space.
LOWEST_CHOSEN_PORT = 20000
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL_RANGE = (32768, 60999)  # Linux's default ip_local_port_range


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on HOST now, chosen between Ray's worker ports and the kernel's ephemeral range. The ports the OS
    hands out for bind(0) and for every outgoing connection come from that range, so a port found free there can be
    taken by any process's next connection before the server it was chosen for binds it (vLLM's workers open dozens
    while a multi-node engine starts, which takes minutes on a CPU). Another process may still bind the port chosen
    here on purpose."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    low = _ephemeral_range()[0]
    if low - LOWEST_CHOSEN_PORT >= 1000:
        for port in random.sample(range(LOWEST_CHOSEN_PORT, low), 64):
            if _can_bind(family, host, port):
                return port
    with socket.socket(family, socket.SOCK_STREAM) as probe:  # a kernel whose ephemeral range leaves no room
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(part) for part in EPHEMERAL_RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL_RANGE
    return low, high


def _can_bind(family: socket.AddressFamily, host: str, port: int) -> bool:
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def ensure_port_free(host: str, port: int) -> None:
    """Raise ConfigError, with how to find the holder, when PORT on HOST cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ConfigError(
                f"port {port} on {host} is already in use ({exc.strerror}); stop what listens there "
                f"(`ss -ltnp 'sport = :{port}'` shows it) or choose another with --port"
            ) from None


class ArrivalClock:
    """Kernel receive timestamps (SO_TIMESTAMPNS: CLOCK_REALTIME) on the perf_counter (CLOCK_MONOTONIC) scale.
    The offset between the two clocks is re-read every second, so clock slewing cannot accumulate."""

    def __init__(self) -> None:
        self._offset_ns = 0
        self._refreshed_s = -math.inf

    def perf_s(self, realtime_ns: int, now_s: float) -> float:
        if now_s - self._refreshed_s > 1.0:
            self._offset_ns = min(_clock_offset_ns() for _ in range(3))  # the tightest of three back-to-back reads
            self._refreshed_s = now_s
        return min((realtime_ns - self._offset_ns) / 1e9, now_s)

    def received_s(self, ancillary: list[tuple[int, int, bytes]], now_s: float) -> float:
        """When a read's bytes reached the socket, from its SO_TIMESTAMPNS message; NOW_S where it has none."""
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(payload) >= 16:
                seconds, nanoseconds = struct.unpack_from("qq", payload)
                return self.perf_s(seconds * 1_000_000_000 + nanoseconds, now_s)
        return now_s


def _clock_offset_ns() -> int:
    realtime_ns = time.clock_gettime_ns(time.CLOCK_REALTIME)
    return realtime_ns - time.clock_gettime_ns(time.CLOCK_MONOTONIC)
