"""`GET /metrics/engines`: the Prometheus text of every healthy upstream replica, each sample labelled with its
replica, so that a client of the gateway (`deepserve bench` among them) sees the engines' own series (running and
waiting requests, KV-cache usage, prefix-cache hits, preemptions) without knowing their internal URLs.

Samples are regrouped by metric family across replicas (one HELP/TYPE header per family), because Prometheus text
format requires a family's samples to be contiguous. A replica that does not answer is named in a comment line and
left out; the endpoint itself always answers 200 (an empty body when no replica is healthy). Like the gateway's own
/metrics it needs no key: engines put model names and counts in their series, never secrets (docs/GATEWAY.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import aiohttp

from deepserve.gateway.upstreams import UpstreamPool, UpstreamReplica

ENGINE_METRICS_PATH = "/metrics/engines"
REPLICA_LABEL = "replica"
SCRAPE_TIMEOUT_S = 5.0
CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
Handler = Callable[[Scope, Receive, Send], Awaitable[None]]


class _Family:
    __slots__ = ("headers", "samples")

    def __init__(self) -> None:
        self.headers: dict[str, str] = {}  # HELP and TYPE lines, from the first replica that had them
        self.samples: list[str] = []


def label_sample(line: str, replica: str) -> str:
    """LINE (one Prometheus sample) with replica="REPLICA" as its first label."""
    label = f'{REPLICA_LABEL}="{_escape(replica)}"'
    brace, space = line.find("{"), line.find(" ")
    if brace != -1 and (space == -1 or brace < space):
        inner_start = brace + 1
        separator = "" if line[inner_start : inner_start + 1] == "}" else ","
        return f"{line[:inner_start]}{label}{separator}{line[inner_start:]}"
    if space == -1:
        return line
    return f"{line[:space]}{{{label}}}{line[space:]}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def merge_exposition(texts: dict[str, str], errors: dict[str, str] | None = None) -> str:
    """One exposition from several replicas' texts ({replica URL: text}), samples labelled with their replica."""
    families: dict[str, _Family] = {}
    for replica, text in texts.items():
        family: _Family | None = None
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = families.setdefault(parts[2], _Family())
                    family.headers.setdefault(parts[1], line)
                continue  # other comments are dropped
            if family is None:  # a sample before any header: a family of its own
                family = families.setdefault(_sample_name(line), _Family())
            family.samples.append(label_sample(line, replica))
    lines = [f"# replica {replica} left out: {reason}" for replica, reason in (errors or {}).items()]
    for family in families.values():
        lines += family.headers.values()
        lines += family.samples
    return "\n".join(lines) + "\n" if lines else ""


def _sample_name(line: str) -> str:
    ends = [i for i in (line.find("{"), line.find(" ")) if i >= 0]
    return line[: min(ends)] if ends else line


async def scrape_replicas(pool: UpstreamPool) -> tuple[dict[str, str], dict[str, str]]:
    """({replica URL: its /metrics text}, {replica URL: why it is missing}) over the healthy replicas."""
    healthy = [replica for replica in pool.replicas if replica.healthy]
    answers = await asyncio.gather(*(_scrape(pool, replica) for replica in healthy))
    texts = {replica.url: text for replica, (text, _) in zip(healthy, answers, strict=True) if text is not None}
    errors = {replica.url: error for replica, (_, error) in zip(healthy, answers, strict=True) if error is not None}
    return texts, errors


async def _scrape(pool: UpstreamPool, replica: UpstreamReplica) -> tuple[str | None, str | None]:
    timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)
    try:
        async with pool.session.get(replica.root + "/metrics", timeout=timeout) as response:
            if response.status != 200:
                return None, f"HTTP {response.status}"
            return await response.text(), None
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return None, f"{exc.__class__.__name__}: {exc}".rstrip(": ")


def engine_metrics_route(pool: UpstreamPool) -> Handler:
    """The ASGI handler of ENGINE_METRICS_PATH for POOL's replicas."""

    async def handle(scope: Scope, receive: Receive, send: Send) -> None:
        texts, errors = await scrape_replicas(pool)
        body = merge_exposition(texts, errors).encode()
        headers = [(b"content-type", CONTENT_TYPE), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return handle
