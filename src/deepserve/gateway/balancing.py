"""Balancing policies: which healthy replica gets a request. A Protocol plus a registry keyed by name.

Affinity policies use rendezvous (highest-random-weight) hashing: each (key, replica) pair gets a score and the
highest wins, so when a replica leaves only its own keys move, and when it returns they move back to it — the
prefix cache it warmed is reused.

`engine_aware` scores replicas the way llm-d's inference scheduler does: several scorers each give every candidate a
score in [0, 1], a weighted sum ranks them, the best wins (ties rotate). Its scorers read the engines' own load
(waiting requests, KV-cache use; scraped from their /metrics by engine_load.EngineLoadScraper), the gateway's live
count of requests in flight per replica, and an approximate index of which prompt prefixes each replica has seen."""

from __future__ import annotations

import collections
import itertools
import json
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from deepserve.errors import ConfigError, unknown_name
from deepserve.gateway.clock import Clock


class Replica(Protocol):
    """What a policy may look at: its identity and its load."""

    url: str
    outstanding: int


class RoutingHints(NamedTuple):
    """What a request offers for routing: the start of its prompt and a session id, if any; the prompt itself
    (its first PREFIX_MAX_CHARS) only for a policy that `wants_prompt`. (A named tuple: one per request.)"""

    prefix: str = ""
    session: str | None = None
    prompt: str = ""


@dataclass(frozen=True)
class EngineLoad:
    """A replica's load as its engine reports it (engine_load.py scrapes it)."""

    waiting: float
    running: float
    kv_cache_usage: float  # 0..1
    scraped_at_s: float  # when it was scraped, by the gateway's clock (time.monotonic by default)


class BalancingPolicy(Protocol):
    name: str
    wants_prompt: bool  # RoutingHints.prompt is filled in (costs a little per request)
    wants_prefix: bool  # RoutingHints.prefix is filled in (the start of the prompt, for affinity)
    engine_load: dict[str, EngineLoad] | None  # {replica URL: load}: kept current for a policy that has one

    def choose(self, replicas: Sequence[Replica], hints: RoutingHints) -> Replica:
        """Pick one of REPLICAS (non-empty, all healthy and not yet tried for this request)."""
        ...


class LeastOutstanding:
    """The replica with the fewest requests in flight; ties go round-robin so that idle replicas share work."""

    name = "least_outstanding"
    wants_prompt = False
    wants_prefix = False
    engine_load: dict[str, EngineLoad] | None = None

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
    wants_prompt = False
    wants_prefix = False
    engine_load: dict[str, EngineLoad] | None = None

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

    wants_prompt = False
    wants_prefix = False
    engine_load: dict[str, EngineLoad] | None = None

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
    wants_prefix = True

    def key(self, hints: RoutingHints) -> str | None:
        return hints.prefix


class SessionAffinity(_Affinity):
    """Requests with the same session header go to the same replica; others go to the least loaded."""

    name = "session_affinity"

    def key(self, hints: RoutingHints) -> str | None:
        return hints.session


# ---- engine_aware ---------------------------------------------------------------------------------------------

# llm-d's default weights (prefix-cache 3, kv-cache-utilization 2, queue 2) plus the gateway's own live count of
# requests in flight, which moves between two scrapes of the engines' metrics.
DEFAULT_SCORE_WEIGHTS: dict[str, float] = {"prefix": 3.0, "queue": 2.0, "kv_cache": 2.0, "outstanding": 1.0}
# The prefix index hashes the prompt in blocks of this many characters (about vLLM's 16-token KV block at ~4
# characters a token), chained so that a block's hash stands for the whole prompt up to it.
PREFIX_BLOCK_CHARS = 64
PREFIX_MAX_BLOCKS = 256
PREFIX_MAX_CHARS = PREFIX_BLOCK_CHARS * PREFIX_MAX_BLOCKS
# Blocks remembered per replica, least recently used forgotten first (llm-d's default: 31,250 blocks, about what
# an 80 GB GPU caches for an 8B model).
PREFIX_BLOCKS_PER_REPLICA = 31250
# A replica whose load is unknown (not scraped yet, or its scrape failed) gets this score from the load scorers.
UNKNOWN_LOAD_SCORE = 0.5


class PrefixIndex:
    """An approximation of each replica's prefix cache: the chained block hashes of the prompts sent to it."""

    def __init__(self, blocks_per_replica: int = PREFIX_BLOCKS_PER_REPLICA) -> None:
        self.blocks_per_replica = blocks_per_replica
        self._blocks: dict[str, collections.OrderedDict[int, None]] = {}

    @staticmethod
    def hashes(prompt: str) -> list[int]:
        """One hash per complete block of PROMPT; each covers every character before it too."""
        chained = 0
        hashes = []
        for start in range(0, min(len(prompt), PREFIX_MAX_CHARS) - PREFIX_BLOCK_CHARS + 1, PREFIX_BLOCK_CHARS):
            chained = hash((chained, prompt[start : start + PREFIX_BLOCK_CHARS]))
            hashes.append(chained)
        return hashes

    def matched_blocks(self, url: str, hashes: Sequence[int]) -> int:
        """How many leading blocks of the prompt REPLICA has seen."""
        blocks = self._blocks.get(url)
        if not blocks:
            return 0
        count = 0
        for block in hashes:
            if block not in blocks:
                break
            count += 1
        return count

    def record(self, url: str, hashes: Sequence[int]) -> None:
        blocks = self._blocks.setdefault(url, collections.OrderedDict())
        for block in hashes:
            blocks[block] = None
            blocks.move_to_end(block)
        while len(blocks) > self.blocks_per_replica:
            blocks.popitem(last=False)


def _min_max_scores(values: Sequence[float | None]) -> list[float]:
    """Lower is better: the lowest known value scores 1, the highest 0, all equal 1 (llm-d's queue scorer);
    unknown values score UNKNOWN_LOAD_SCORE."""
    known = [value for value in values if value is not None]
    if not known:
        return [UNKNOWN_LOAD_SCORE] * len(values)
    low, high = min(known), max(known)
    return [
        UNKNOWN_LOAD_SCORE if value is None else 1.0 if high == low else (high - value) / (high - low)
        for value in values
    ]


class EngineAware:
    """Scores each replica with four scorers in [0, 1] and takes the best weighted sum (see the module docstring):

    * prefix: the fraction of the prompt's leading blocks that the replica has seen (PrefixIndex), so that requests
      sharing a prefix go where it is cached;
    * queue: requests waiting in the engine, min-max normalised over the candidates (fewest waiting: 1);
    * kv_cache: 1 − the engine's KV-cache usage;
    * outstanding: the gateway's own requests in flight on the replica, min-max normalised (live between scrapes).
    """

    name = "engine_aware"
    wants_prompt = True
    wants_prefix = False

    def __init__(
        self,
        weights: Mapping[str, float] | None = None,
        stale_after_s: float = 2.0,
        clock: Clock = time.monotonic,
    ) -> None:
        self.weights = {**DEFAULT_SCORE_WEIGHTS, **(weights or {})}
        self.stale_after_s = stale_after_s
        self.engine_load: dict[str, EngineLoad] | None = {}
        self.prefix_index = PrefixIndex()
        self._clock = clock
        self._turn = itertools.count()

    def choose(self, replicas: Sequence[Replica], hints: RoutingHints) -> Replica:
        hashes = PrefixIndex.hashes(hints.prompt) if self.weights["prefix"] else []
        totals = [
            sum(self.weights[name] * score for name, score in scores.items())
            for scores in self.scores(replicas, hashes)
        ]
        best = max(totals)
        tied = [replica for replica, total in zip(replicas, totals, strict=True) if total >= best - 1e-9]
        chosen = tied[next(self._turn) % len(tied)]
        if hashes:
            self.prefix_index.record(chosen.url, hashes)
        return chosen

    def scores(self, replicas: Sequence[Replica], hashes: Sequence[int]) -> list[dict[str, float]]:
        """Each replica's score from each scorer (for choose, tests and debugging)."""
        loads = [self._load(replica.url) for replica in replicas]
        queue = _min_max_scores([load.waiting if load else None for load in loads])
        outstanding = _min_max_scores([float(replica.outstanding) for replica in replicas])
        return [
            {
                "prefix": self.prefix_index.matched_blocks(replica.url, hashes) / len(hashes) if hashes else 0.0,
                "queue": queue[index],
                "kv_cache": 1.0 - load.kv_cache_usage if load else UNKNOWN_LOAD_SCORE,
                "outstanding": outstanding[index],
            }
            for index, (replica, load) in enumerate(zip(replicas, loads, strict=True))
        ]

    def _load(self, url: str) -> EngineLoad | None:
        load = self.engine_load.get(url) if self.engine_load is not None else None
        if load is None or self._clock() - load.scraped_at_s > self.stale_after_s:
            return None
        return load


def prompt_text_for_routing(request: Mapping[str, Any], prompt_field: str, max_chars: int = PREFIX_MAX_CHARS) -> str:
    """The start of the prompt as the engine will see it, in order (chat: each message's role and content), for
    the prefix index. Only its first MAX_CHARS matter."""
    prompt = request.get(prompt_field)
    if isinstance(prompt, str):
        return prompt[:max_chars]
    if not isinstance(prompt, list):
        return ""
    parts: list[str] = []
    size = 0
    for item in prompt:
        if isinstance(item, dict):
            content = item.get("content")
            text = f"{item.get('role')}:{content if isinstance(content, str) else json.dumps(content)}\n"
        else:
            text = item if isinstance(item, str) else json.dumps(item)
        parts.append(text)
        size += len(text)
        if size >= max_chars:
            break
    return "".join(parts)[:max_chars]


# ---- the registry ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PolicySettings:
    """What a policy may be configured with (GatewayConfig's fields for it)."""

    score_weights: Mapping[str, float] = field(default_factory=dict)
    engine_metrics_interval_s: float = 0.2
    clock: Clock = time.monotonic  # what the engines' load is timed by (the gateway's clock)


POLICIES: dict[str, Callable[[PolicySettings], BalancingPolicy]] = {
    LeastOutstanding.name: lambda settings: LeastOutstanding(),
    RoundRobin.name: lambda settings: RoundRobin(),
    PrefixAffinity.name: lambda settings: PrefixAffinity(),
    SessionAffinity.name: lambda settings: SessionAffinity(),
    EngineAware.name: lambda settings: EngineAware(
        settings.score_weights,
        stale_after_s=max(1.0, 5 * settings.engine_metrics_interval_s),
        clock=settings.clock,
    ),
}


def make_policy(name: str, settings: PolicySettings | None = None) -> BalancingPolicy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ConfigError(unknown_name("balancing policy", name, list(POLICIES))) from None
    return factory(settings or PolicySettings())
