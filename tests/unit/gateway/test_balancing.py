from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest

from deepserve.errors import ConfigError
from deepserve.gateway.balancing import (
    POLICIES,
    PREFIX_MAX_BLOCKS,
    EngineAware,
    EngineLoad,
    PolicySettings,
    PrefixIndex,
    RoutingHints,
    make_policy,
    prompt_text_for_routing,
)
from deepserve.gateway.config import GatewayConfig
from tests.helpers import FakeClock


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


# ---- engine_aware --------------------------------------------------------------------------------------------------


def engine_aware(clock: FakeClock, **weights: float) -> EngineAware:
    policy = EngineAware(weights, stale_after_s=1.0, clock=clock)
    assert policy.engine_load is not None
    return policy


def load(policy: EngineAware, url: str, waiting: float, kv: float, at: float) -> None:
    assert policy.engine_load is not None
    policy.engine_load[url] = EngineLoad(waiting=waiting, running=0, kv_cache_usage=kv, scraped_at_s=at)


def test_engine_aware_sends_work_where_the_engine_queue_is_shortest() -> None:
    clock = FakeClock(100.0)
    policy = engine_aware(clock)
    replicas = [R("a"), R("b"), R("c")]
    load(policy, "a", 12, 0.5, clock.now_s)
    load(policy, "b", 0, 0.5, clock.now_s)
    load(policy, "c", 6, 0.5, clock.now_s)
    assert {policy.choose(replicas, RoutingHints()).url for _ in range(10)} == {"b"}
    assert [scores["queue"] for scores in policy.scores(replicas, [])] == [0.0, 1.0, 0.5]


def test_engine_aware_avoids_a_full_kv_cache() -> None:
    clock = FakeClock(100.0)
    policy = engine_aware(clock)
    load(policy, "a", 0, 0.95, clock.now_s)
    load(policy, "b", 0, 0.20, clock.now_s)
    assert policy.choose([R("a"), R("b")], RoutingHints()).url == "b"


def test_engine_aware_reads_the_gateways_own_in_flight_count_between_scrapes() -> None:
    clock = FakeClock(100.0)
    policy = engine_aware(clock)
    load(policy, "a", 0, 0.1, clock.now_s)
    load(policy, "b", 0, 0.1, clock.now_s)  # both idle at the last scrape …
    assert policy.choose([R("a", outstanding=30), R("b", outstanding=2)], RoutingHints()).url == "b"  # … not now


def test_engine_aware_keeps_a_shared_prefix_on_the_replica_that_has_it_unless_that_one_is_swamped() -> None:
    clock = FakeClock(100.0)
    policy = engine_aware(clock)
    system = "You are a helpful assistant who answers in French. " * 40  # about 2,000 characters: 32 blocks
    replicas = [R("a"), R("b")]
    for url in ("a", "b"):
        load(policy, url, 0, 0.3, clock.now_s)
    first = policy.choose(replicas, RoutingHints(prompt=system + "question one")).url
    other = "b" if first == "a" else "a"
    for index in range(10):  # the same system prompt, different questions; slightly busier than the other replica
        load(policy, first, 1, 0.35, clock.now_s)
        assert policy.choose(replicas, RoutingHints(prompt=f"{system}question {index}")).url == first
    load(policy, first, 40, 0.97, clock.now_s)  # now it is swamped: the prefix is not worth the wait
    assert policy.choose(replicas, RoutingHints(prompt=system + "question 11")).url == other


def test_engine_aware_treats_a_stale_or_missing_load_as_unknown() -> None:
    clock = FakeClock(100.0)
    policy = engine_aware(clock)
    load(policy, "a", 50, 0.9, clock.now_s)
    clock.now_s += 5  # past stale_after_s: that scrape no longer describes replica a
    scores = policy.scores([R("a"), R("b")], [])
    assert scores[0]["queue"] == scores[1]["queue"] == 0.5
    assert scores[0]["kv_cache"] == scores[1]["kv_cache"] == 0.5


def test_engine_aware_weights_come_from_the_config_and_zero_switches_a_scorer_off() -> None:
    config = GatewayConfig.model_validate(
        {"balancing": "engine_aware", "score_weight": ["queue=5", "prefix=0"], "engine_metrics_interval_s": 0.5}
    )
    assert config.score_weights() == {"prefix": 0.0, "queue": 5.0, "kv_cache": 2.0, "outstanding": 1.0}
    policy = make_policy("engine_aware", PolicySettings(config.score_weights(), config.engine_metrics_interval_s))
    assert isinstance(policy, EngineAware) and policy.weights["queue"] == 5.0 and policy.stale_after_s == 2.5
    with pytest.raises(ValueError, match="outstanding"):
        GatewayConfig.model_validate({"score_weight": ["latency=1"]})
    with pytest.raises(ValueError, match="at least 0"):
        GatewayConfig.model_validate({"score_weight": ["queue=-1"]})


def test_prefix_hashes_are_chained_so_that_a_block_stands_for_everything_before_it() -> None:
    a = PrefixIndex.hashes("x" * 64 + "y" * 64)
    b = PrefixIndex.hashes("z" * 64 + "y" * 64)
    assert len(a) == 2 and a[1] != b[1]  # same second block, different history
    assert PrefixIndex.hashes("x" * 63) == []  # no complete block
    assert len(PrefixIndex.hashes("x" * 10**6)) == PREFIX_MAX_BLOCKS
    index = PrefixIndex(blocks_per_replica=3)
    index.record("r", a)
    index.record("r", PrefixIndex.hashes("q" * 128))  # 4 blocks in all: the oldest is forgotten
    assert index.matched_blocks("r", a) == 0 and index.matched_blocks("r", PrefixIndex.hashes("q" * 128)) == 2


def test_prompt_text_for_routing_keeps_the_order_the_engine_sees() -> None:
    chat = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text"}]}]}
    assert prompt_text_for_routing(chat, "messages") == 'system:S\nuser:[{"type": "text"}]\n'
    assert prompt_text_for_routing({"prompt": "abc" * 10}, "prompt", max_chars=5) == "abcab"
    assert prompt_text_for_routing({"prompt": [[1, 2], [3]]}, "prompt") == "[1, 2][3]"
    assert prompt_text_for_routing({"prompt": None}, "prompt") == ""
