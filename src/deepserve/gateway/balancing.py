"""Balancing policies: which healthy replica gets a request. A Protocol plus a registry keyed by name.

Affinity policies use rendezvous (highest-random-weight) hashing: each (key, replica) pair gets a score and the
highest wins, so when a replica leaves only its own keys move, and when it returns they move back to it — the
prefix cache it warmed is reused."""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from deepserve.errors import ConfigError, unknown_name


class Replica(Protocol):
    """What a policy may look at: its identity and its load."""

    url: str
    outstanding: int


@dataclass(frozen=True)
class RoutingHints:
    """What a request offers for routing: the start of its prompt and a session id, if any."""

    prefix: str = ""
    session: str | None = None


class BalancingPolicy(Protocol):
    name: str

    def choose(self, replicas: Sequence[Replica], hints: RoutingHints) -> Replica:
        """Pick one of REPLICAS (non-empty, all healthy and not yet tried for this request)."""
        ...


class LeastOutstanding:
    """The replica with the fewest requests in flight; ties go round-robin so that idle replicas share work."""

    name = "least_outstanding"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, replicas: Sequence[Replica], hints: RoutingHints) -> Replica:
        start = next(self._turn) % len(replicas)
        best = replicas[start]
        for offset in range(1, len(replicas)):
            candidate = replicas[(start + offset) % len(replicas)]
            if candidate.outstanding < best.outstanding:
                best = candidate
        return best


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, replicas: Sequence[Replica], hints: RoutingHints) -> Replica:
        return replicas[next(self._turn) % len(replicas)]


def rendezvous(key: str, replicas: Sequence[Replica]) -> Replica:
    """The replica with the highest hash of (key, replica): stable while the set of replicas is."""
    key_hash = zlib.crc32(key.encode())
    return max(replicas, key=lambda replica: zlib.crc32(replica.url.encode(), key_hash))


def overloaded(replica: Replica, replicas: Sequence[Replica]) -> bool:
    """Affinity yields to load when the preferred replica has more than twice the requests (plus slack) of the
    idlest: one hot system prompt must not pile everything onto one replica while others idle."""
    least = min(candidate.outstanding for candidate in replicas)
    return replica.outstanding > 2 * least + AFFINITY_SLACK_REQUESTS


AFFINITY_SLACK_REQUESTS = 16


class _Affinity:
    """Rendezvous-hash a key to a replica; least outstanding without a key or when the preferred one is overloaded."""

    def __init__(self) -> None:
        self._fallback = LeastOutstanding()

    def key(self, hints: RoutingHints) -> str | None:
        raise NotImplementedError

    def choose(self, replicas: Sequence[Replica], hints: RoutingHints) -> Replica:
        key = self.key(hints)
        if not key:
            return self._fallback.choose(replicas, hints)
        preferred = rendezvous(key, replicas)
        if overloaded(preferred, replicas):
            return self._fallback.choose(replicas, hints)
        return preferred


class PrefixAffinity(_Affinity):
    """Requests whose prompts start alike go to the same replica, to reuse its prefix cache."""

    name = "prefix_affinity"

    def key(self, hints: RoutingHints) -> str | None:
        return hints.prefix


class SessionAffinity(_Affinity):
    """Requests with the same session header go to the same replica; others go to the least loaded."""

    name = "session_affinity"

    def key(self, hints: RoutingHints) -> str | None:
        return hints.session


POLICIES: dict[str, Callable[[], BalancingPolicy]] = {
    LeastOutstanding.name: LeastOutstanding,
    RoundRobin.name: RoundRobin,
    PrefixAffinity.name: PrefixAffinity,
    SessionAffinity.name: SessionAffinity,
}


def make_policy(name: str) -> BalancingPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ConfigError(unknown_name("balancing policy", name, list(POLICIES))) from None
