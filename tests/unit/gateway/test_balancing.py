from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest

from deepserve.errors import ConfigError
from deepserve.gateway.balancing import POLICIES, RoutingHints, make_policy


@dataclass
class R:
    url: str
    outstanding: int = 0


def test_least_outstanding_picks_the_idlest_and_spreads_ties() -> None:
    policy = make_policy("least_outstanding")
    replicas = [R("a", 3), R("b", 1), R("c", 2)]
    assert all(policy.choose(replicas, RoutingHints()).url == "b" for _ in range(10))
    even = [R("a"), R("b"), R("c")]
    picks = Counter(policy.choose(even, RoutingHints()).url for _ in range(30))
    assert picks == {"a": 10, "b": 10, "c": 10}


def test_round_robin_cycles() -> None:
    policy = make_policy("round_robin")
    replicas = [R("a", 5), R("b"), R("c")]
    assert [policy.choose(replicas, RoutingHints()).url for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_prefix_affinity_is_sticky_and_only_moves_the_lost_replicas_keys() -> None:
    policy = make_policy("prefix_affinity")
    replicas = [R("http://a"), R("http://b"), R("http://c")]
    prefixes = [f"system prompt {i}" for i in range(300)]
    first = {p: policy.choose(replicas, RoutingHints(prefix=p)).url for p in prefixes}
    assert first == {p: policy.choose(replicas, RoutingHints(prefix=p)).url for p in prefixes}
    assert len(set(first.values())) == 3  # spread over all replicas
    without_b = [r for r in replicas if r.url != "http://b"]
    after = {p: policy.choose(without_b, RoutingHints(prefix=p)).url for p in prefixes}
    moved = [p for p in prefixes if after[p] != first[p]]
    assert all(first[p] == "http://b" for p in moved)


def test_session_affinity_follows_the_header_and_falls_back_to_least_outstanding() -> None:
    policy = make_policy("session_affinity")
    replicas = [R("http://a", 9), R("http://b", 0)]
    chosen = {policy.choose(replicas, RoutingHints(session="user-42")).url for _ in range(20)}
    assert len(chosen) == 1
    assert policy.choose(replicas, RoutingHints()).url == "http://b"


def test_unknown_policy_lists_the_valid_ones() -> None:
    with pytest.raises(ConfigError) as caught:
        make_policy("fastest")
    for name in POLICIES:
        assert name in str(caught.value)


def test_affinity_yields_to_load_when_the_preferred_replica_is_swamped() -> None:
    policy = make_policy("prefix_affinity")
    replicas = [R("http://a"), R("http://b")]
    preferred = policy.choose(replicas, RoutingHints(prefix="hot system prompt"))
    other = next(r for r in replicas if r is not preferred)
    preferred.outstanding = 16  # within 2 × 0 + 16: still preferred
    assert policy.choose(replicas, RoutingHints(prefix="hot system prompt")) is preferred
    preferred.outstanding = 17
    assert policy.choose(replicas, RoutingHints(prefix="hot system prompt")) is other


def test_chat_affinity_key_is_the_first_message() -> None:
    import json

    from deepserve.gateway.validation import CHAT_COMPLETIONS, parse_request

    def key(*messages: str) -> str:
        body = {"model": "m", "messages": [{"role": "user", "content": text} for text in messages]}
        return parse_request(CHAT_COMPLETIONS, json.dumps(body).encode(), {"m": None}, {}).affinity_text

    assert key("system", "question 1") == key("system", "question 2", "more") == "system"
    assert key("x" * 1000) == "x" * 256
