"""The scheduler's policy, step by step: token budget, chunked prefill, max_num_seqs, running first, prefix hits,
preemption by recomputation, stop conditions."""

from __future__ import annotations

import pytest

from deepserve.simulate.kv_cache import KVCacheManager
from deepserve.simulate.scheduler import (
    ScheduledBatch,
    Scheduler,
    SchedulerLimits,
    SimRequest,
    StepOutput,
)
from deepserve.simulate.tokenizer import EOS_ID, generated_token


def scheduler(
    num_blocks: int = 1000,
    block_size: int = 16,
    max_num_seqs: int = 8,
    budget: int = 64,
    max_model_len: int = 4096,
    chunked: bool = True,
    caching: bool = False,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, max_model_len, caching)
    return Scheduler(SchedulerLimits(max_num_seqs, budget, max_model_len, chunked), kv)


def req(name: str, prompt_len: int, max_tokens: int = 4, first: int = 0, **kwargs: object) -> SimRequest:
    return SimRequest(name, list(range(first, first + prompt_len)), max_tokens, **kwargs)  # type: ignore[arg-type]


def step(s: Scheduler) -> tuple[ScheduledBatch, list[StepOutput]]:
    batch = s.schedule()
    return batch, s.update(batch)


def scheduled(batch: ScheduledBatch) -> list[tuple[str, int]]:
    return [(request.request_id, tokens) for request, tokens, _ in batch.entries]


def run_to_end(s: Scheduler, limit: int = 1000) -> list[ScheduledBatch]:
    batches = []
    while s.has_unfinished and limit:
        batches.append(step(s)[0])
        limit -= 1
    assert not s.has_unfinished, "did not finish"
    return batches


def test_the_token_budget_cuts_prompts_into_chunks_and_running_requests_go_first() -> None:
    s = scheduler(budget=64)
    long, short = req("long", 100), req("short", 30)
    s.add(long)
    s.add(short)
    batch, outputs = step(s)
    assert scheduled(batch) == [("long", 64)] and outputs == []  # a chunk samples nothing
    batch, outputs = step(s)
    assert scheduled(batch) == [("long", 36), ("short", 28)]  # the rest of long, then short cut to the budget
    assert [o.request.request_id for o in outputs] == ["long"]
    batch, outputs = step(s)
    assert scheduled(batch) == [("long", 1), ("short", 2)]
    assert (batch.decode_tokens, batch.prefill_tokens) == (1, 2)
    assert batch.context_len == 101  # long decodes its 101st token
    assert {o.request.request_id for o in outputs} == {"long", "short"}


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        scheduler(budget=64, max_model_len=128, chunked=False)
    s = scheduler(budget=64, max_model_len=64, chunked=False)
    s.add(req("a", 40))
    s.add(req("b", 40))
    batch, _ = step(s)
    assert scheduled(batch) == [("a", 40)]  # b does not fit the 24 tokens left and is not cut
    batch, _ = step(s)
    assert scheduled(batch) == [("a", 1), ("b", 40)]


def test_max_num_seqs_caps_the_running_batch() -> None:
    s = scheduler(max_num_seqs=2)
    for name in "abc":
        s.add(req(name, 5, max_tokens=2))
    batch, _ = step(s)
    assert scheduled(batch) == [("a", 5), ("b", 5)]
    batch, outputs = step(s)
    assert scheduled(batch) == [("a", 1), ("b", 1)]  # c still waits
    assert all(o.finish_reason == "length" for o in outputs)
    batch, _ = step(s)
    assert scheduled(batch) == [("c", 5)]


def test_waiting_requests_are_admitted_in_arrival_order() -> None:
    s = scheduler(budget=10)
    s.add(req("first", 8))
    s.add(req("second", 8))
    s.add(req("third", 2))
    batch, _ = step(s)
    # second is cut to the 2 tokens left; third, which would fit whole, does not jump the queue
    assert scheduled(batch) == [("first", 8), ("second", 2)]


def test_a_shared_prefix_is_served_from_the_cache_and_counted() -> None:
    s = scheduler(block_size=16, caching=True, budget=256)
    s.add(req("a", 40))
    step(s)
    twin = SimRequest("b", [*range(40)], 4)  # the same 40 tokens: two full blocks cached, the rest computed
    s.add(twin)
    batch, _ = step(s)
    assert ("b", 8) in scheduled(batch)
    assert twin.num_cached_tokens == 32
    assert (s.counters.prefix_queries, s.counters.prefix_hits) == (80, 32)


def test_a_full_cache_preempts_the_latest_request_which_is_recomputed_later() -> None:
    s = scheduler(num_blocks=6, block_size=4, max_num_seqs=4, budget=64)
    first, second = req("first", 8, max_tokens=10), req("second", 8, max_tokens=10, first=100)
    s.add(first)
    s.add(second)
    batches = []
    while not s.counters.preemptions:
        batches.append(step(s)[0])
    preempting = batches[-1]
    assert preempting.preempted == [second] and scheduled(preempting) == [("first", 1)]
    assert second.num_computed_tokens == 0 and list(s.waiting) == [second]
    generated = len(second.output_token_ids)
    s.add(third := req("third", 2, max_tokens=1, first=200))  # arrives later: must not overtake second
    rest = run_to_end(s)
    resumed = next(b for b in rest if any(r is second for r, _, _ in b.entries))
    assert ("second", 8 + generated) in scheduled(resumed)  # prompt and outputs so far, computed again
    assert s.counters.preemptions == 1 and second.num_preemptions == 1
    assert len(first.output_token_ids) == len(second.output_token_ids) == 10
    assert second.output_token_ids == [generated_token(i) for i in range(10)]  # recomputing changed nothing
    assert third.first_token_s is not None and third.finish_reason == "length"
    assert s.kv.pool.num_free == 6


def test_stop_conditions() -> None:
    s = scheduler()
    natural = req("natural", 4, max_tokens=10, eos_after=3)
    late = req("late", 4, max_tokens=10, eos_after=3, min_tokens=5)
    forced = req("forced", 4, max_tokens=6, eos_after=3, ignore_eos=True)
    for r in (natural, late, forced):
        s.add(r)
    run_to_end(s)
    assert (len(natural.output_token_ids), natural.finish_reason, natural.output_token_ids[-1]) == (3, "stop", EOS_ID)
    assert (len(late.output_token_ids), late.finish_reason) == (5, "stop")
    assert (len(forced.output_token_ids), forced.finish_reason) == (6, "length")
    assert EOS_ID not in forced.output_token_ids


def test_a_request_stops_when_the_context_is_full() -> None:
    s = scheduler(max_model_len=12)
    full = req("full", 10, max_tokens=100)
    s.add(full)
    run_to_end(s)
    assert (full.num_tokens, full.finish_reason) == (12, "length")
    with pytest.raises(ValueError, match="max_model_len"):
        s.add(req("too-long", 12))


def test_abort_frees_the_cache_wherever_the_request_is() -> None:
    s = scheduler(num_blocks=10, block_size=4)
    running, waiting = req("running", 8, max_tokens=50), req("waiting", 8)
    s.add(running)
    step(s)
    s.add(waiting)
    assert s.abort(running) and running.finish_reason == "abort"
    assert s.kv.pool.num_free == 10 and s.running == []
    assert s.abort(waiting) and not s.has_unfinished
    assert not s.abort(waiting)


def test_a_request_in_a_step_still_in_flight_is_not_scheduled_again() -> None:
    s = scheduler()
    s.add(req("a", 5))
    first = s.schedule()
    assert scheduled(first) == [("a", 5)]
    assert s.schedule().empty  # pipeline parallelism: its token is not known until the first step ends
    s.update(first)
    assert scheduled(s.schedule()) == [("a", 1)]


def test_a_prompt_prefilled_elsewhere_is_loaded_not_computed_but_holds_its_blocks() -> None:
    """A decode instance of a prefill/decode pair: the connector loads the prompt's KV cache, the step computes only
    the last prompt token (vLLM's connectors leave it to the decode), and the cache holds the whole prompt."""
    s = scheduler(budget=64, block_size=16)
    remote = req("remote", 100)
    remote.num_external_tokens = 100
    s.add(remote)
    batch, outputs = step(s)
    assert scheduled(batch) == [("remote", 1)] and [output.request for output in outputs] == [remote]
    assert s.kv.pool.num_free == 1000 - 7  # ceil(101 / 16): the prompt and the first output token
