"""Roll call across nodes: how `deepserve serve` on several machines knows who has joined, and who has left.

vLLM's multi-node runtime does the distributed work; it does not tell node 0 which node it is still waiting for,
and a headless worker whose head has gone keeps running. So each node's deepserve also keeps one TCP connection to
node 0's deepserve (on the join port), over which:

    worker → head   JOIN {"rank": R, "host": ..., "deployment": {...}}      once, then PING every few seconds
    head → worker   OK {...} | REFUSED {"reason": ...}                      the answer to JOIN
    head → worker   READY {"base_url": ...} | STOP {"reason": ...}          the service is up / going down
    head → worker   PING                                                    every few seconds

A peer silent for longer than PEER_SILENCE_S, or a closed connection, is gone. The deployment dicts must be equal
on every node (same model, layout, context), so that a node started with other flags is refused with the
difference instead of hanging in the engine's rendezvous.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from deepserve.engines.config import EngineConfig
from deepserve.errors import ConfigError, EngineError

PING_INTERVAL_S = 2.0
PEER_SILENCE_S = 15.0
CONNECT_RETRY_S = 1.0
CONNECT_TIMEOUT_S = 5.0
# The fields every node must agree on; node-specific ones (rank, host, ports of this node's API) are left out.
SHARED_FIELDS = (
    "engine",
    "model",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "data_parallel_size",
    "enable_expert_parallel",
    "nnodes",
    "master_port",
    "max_model_len",
    "quantization",
    "kv_cache_dtype",
    "dtype",
    "block_size",
    "distributed_executor_backend",
    "role",  # the nodes of one prefill or decode replica run the same side, with the same connector
    "kv_connector",
)


def deployment_of(config: EngineConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in SHARED_FIELDS}


def differences(head: dict[str, Any], worker: dict[str, Any]) -> list[str]:
    return [
        f"{name}: node 0 has {head.get(name)!r}, this node {worker.get(name)!r}"
        for name in sorted(set(head) | set(worker))
        if head.get(name) != worker.get(name)
    ]


def _send(conn: socket.socket, verb: str, payload: dict[str, Any] | None = None) -> None:
    line = verb if payload is None else f"{verb} {json.dumps(payload)}"
    conn.sendall(line.encode() + b"\n")


def _parse(line: bytes) -> tuple[str, dict[str, Any]]:
    verb, _, rest = line.decode(errors="replace").strip().partition(" ")
    try:
        payload = json.loads(rest) if rest else {}
    except ValueError:
        payload = {}
    return verb, payload if isinstance(payload, dict) else {}


class _Lines:
    """Lines from a socket, with a silence limit: None when the peer closed or stayed silent too long."""

    def __init__(self, conn: socket.socket, silence_s: float) -> None:
        conn.settimeout(silence_s)
        self._file = conn.makefile("rb")

    def next(self) -> bytes | None:
        try:
            line = self._file.readline()
        except (OSError, ValueError):  # timeout, reset, or closed under us
            return None
        return line or None


@dataclass
class _Member:
    rank: int
    host: str
    conn: socket.socket


@dataclass
class RollCall:
    """Node 0's side: accepts the other nodes, answers their JOIN, tells them when the service is ready or
    stopping, and notices when one leaves."""

    config: EngineConfig
    bind_host: str
    members: dict[int, _Member] = field(default_factory=dict)
    left: list[tuple[int, str]] = field(default_factory=list)  # (rank, why) of nodes gone after joining
    _server: socket.socket | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _ready_payload: dict[str, Any] | None = None
    _closing: bool = False

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.getsockname()[1])

    def start(self) -> RollCall:
        family = socket.AF_INET6 if ":" in self.bind_host else socket.AF_INET
        server = socket.socket(family, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            server.bind((self.bind_host, self.config.effective_join_port))
        except OSError as exc:
            server.close()
            raise ConfigError(
                f"cannot listen for the other nodes on {self.bind_host}:{self.config.effective_join_port} "
                f"({exc.strerror}); choose a free port with --join-port on every node"
            ) from None
        server.listen(64)
        self._server = server
        threading.Thread(target=self._accept_loop, name="rollcall-accept", daemon=True).start()
        return self

    def missing(self) -> list[int]:
        with self._lock:
            return [rank for rank in range(1, self.config.nnodes) if rank not in self.members]

    def announce_ready(self, base_url: str) -> None:
        self._ready_payload = {"base_url": base_url}
        self._broadcast("READY", self._ready_payload)

    def stop(self, reason: str) -> None:
        if self._closing:
            return
        self._closing = True
        self._broadcast("STOP", {"reason": reason})
        self.close()

    def close(self) -> None:
        """Drop every node's connection and stop listening, without a word (`stop` says STOP first): to the other
        nodes this looks as if node 0 crashed."""
        self._closing = True
        with self._lock:
            members = list(self.members.values())
        for member in members:
            with contextlib.suppress(OSError):
                member.conn.shutdown(socket.SHUT_RDWR)
            member.conn.close()
        if self._server is not None:
            self._server.close()

    def raise_if_one_left(self) -> None:
        if self.left:
            rank, why = self.left[0]
            raise EngineError(
                f"node {rank} left the deployment ({why}); the engine cannot serve without it, so node 0 stops too. "
                f"Restart node {rank}, then node 0"
            )

    def _broadcast(self, verb: str, payload: dict[str, Any]) -> None:
        with self._lock:
            members = list(self.members.values())
        for member in members:
            with contextlib.suppress(OSError):
                _send(member.conn, verb, payload)

    def _accept_loop(self) -> None:
        assert self._server is not None
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # closed by stop()
            threading.Thread(target=self._serve_member, args=(conn,), name="rollcall-member", daemon=True).start()

    def _serve_member(self, conn: socket.socket) -> None:
        lines = _Lines(conn, PEER_SILENCE_S)
        member = self.admit(conn, lines.next())
        if member is None:
            conn.close()
            return
        pinger = threading.Thread(target=self._ping, args=(member,), daemon=True)
        pinger.start()
        while lines.next() is not None:
            pass
        with self._lock:
            still_member = self.members.get(member.rank) is member
            if still_member:
                del self.members[member.rank]
        if still_member and not self._closing:
            self.left.append((member.rank, f"{member.host} closed its connection or went silent"))

    def admit(self, conn: socket.socket, line: bytes | None) -> _Member | None:
        """Answer a JOIN. The rank is checked and taken under one lock, so two nodes claiming the same rank at once
        cannot both get in; a node whose connection fails before it hears OK is not kept as a member."""
        if line is None:
            return None
        verb, payload = _parse(line)
        rank = payload.get("rank")
        member = None
        with self._lock:
            reason = self._refusal(verb, rank, payload.get("deployment") or {})
            if reason is None and isinstance(rank, int):
                member = _Member(rank, str(payload.get("host") or "?"), conn)
                self.members[rank] = member
        try:
            if member is None:
                _send(conn, "REFUSED", {"reason": reason})
                return None
            _send(conn, "OK", {"nnodes": self.config.nnodes})
            if self._ready_payload is not None:
                _send(conn, "READY", self._ready_payload)
        except OSError:
            if member is not None:
                with self._lock:
                    if self.members.get(member.rank) is member:
                        del self.members[member.rank]
            return None
        return member

    def _refusal(self, verb: str, rank: Any, deployment: dict[str, Any]) -> str | None:
        """Why a JOIN is refused, or None; called with the lock held."""
        if verb != "JOIN" or not isinstance(rank, int):
            return "not a deepserve node (expected JOIN with a rank)"
        if not 1 <= rank < self.config.nnodes:
            return f"node rank {rank} is out of range: node 0 expects ranks 1 to {self.config.nnodes - 1}"
        if rank in self.members:
            return f"node rank {rank} has already joined (from {self.members[rank].host}); ranks must be unique"
        mismatch = differences(deployment_of(self.config), deployment)
        if mismatch:
            return "this node was started with a different deployment than node 0: " + "; ".join(mismatch)
        return None

    def _ping(self, member: _Member) -> None:
        while True:
            time.sleep(PING_INTERVAL_S)
            with self._lock:
                if self.members.get(member.rank) is not member:
                    return
            try:
                _send(member.conn, "PING")
            except OSError:
                return


@dataclass
class CheckIn:
    """A worker node's side: joins node 0, then learns when the service is ready or stopping, or that node 0 has
    gone."""

    config: EngineConfig
    host_name: str = field(default_factory=socket.gethostname)
    clock: Callable[[], float] = time.monotonic
    ready_url: str | None = None
    stop_reason: str | None = None
    head_gone: bool = False
    _conn: socket.socket | None = None

    @property
    def head_address(self) -> str:
        return f"{self.config.master_addr}:{self.config.effective_join_port}"

    def join(self, on_progress: Callable[[str, float], None] | None = None) -> None:
        """Connect to node 0 (retrying until --join-timeout-s) and be admitted, or raise with the reason."""
        started = self.clock()
        conn = self._connect(started, on_progress)
        lines = _Lines(conn, PEER_SILENCE_S)
        join = {"rank": self.config.node_rank, "host": self.host_name, "deployment": deployment_of(self.config)}
        with contextlib.suppress(OSError):  # node 0 dropped the connection: the missing answer below says so
            _send(conn, "JOIN", join)
        verb, payload = _parse(lines.next() or b"")
        if verb != "OK":
            conn.close()
            why = payload.get("reason") or "node 0 closed the connection without an answer"
            raise ConfigError(f"node 0 at {self.head_address} refused node {self.config.node_rank}: {why}")
        self._conn = conn
        threading.Thread(target=self._listen, args=(lines,), name="checkin-listen", daemon=True).start()
        threading.Thread(target=self._ping, name="checkin-ping", daemon=True).start()

    def raise_if_head_gone(self) -> None:
        if self.stop_reason is not None:
            raise HeadStopped(f"node 0 stopped the service ({self.stop_reason}); this worker stops too")
        if self.head_gone:
            raise EngineError(
                f"node 0 at {self.head_address} went away (its deepserve exited or the network failed); "
                "this worker stops too. Restart node 0, then this node"
            )

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.shutdown(socket.SHUT_RDWR)
            self._conn.close()

    def _connect(self, started: float, on_progress: Callable[[str, float], None] | None) -> socket.socket:
        host, port = self.config.master_addr or "", self.config.effective_join_port
        while True:
            try:
                return socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
            except OSError as exc:
                waited = self.clock() - started
                if waited > self.config.join_timeout_s:
                    raise EngineError(
                        f"node 0 at {host}:{port} did not answer within {self.config.join_timeout_s:.0f} s "
                        f"({exc.strerror or exc}); start node 0 first (`deepserve serve … --node-rank 0`), check "
                        "that --master-addr is its address on a network this node reaches, and that the port is open"
                    ) from None
                if on_progress:
                    on_progress(f"waiting for node 0 at {host}:{port}", waited)
                time.sleep(CONNECT_RETRY_S)

    def _listen(self, lines: _Lines) -> None:
        while (line := lines.next()) is not None:
            verb, payload = _parse(line)
            if verb == "READY":
                self.ready_url = str(payload.get("base_url") or "")
            elif verb == "STOP":
                self.stop_reason = str(payload.get("reason") or "stopped")
                return
        self.head_gone = True

    def _ping(self) -> None:
        while self._conn is not None and not self.head_gone and self.stop_reason is None:
            time.sleep(PING_INTERVAL_S)
            try:
                _send(self._conn, "PING")
            except OSError:
                return


class HeadStopped(EngineError):
    """Node 0 stopped the service on purpose: a worker that follows it exits with this message."""
