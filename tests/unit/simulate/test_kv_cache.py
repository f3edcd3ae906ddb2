"""KV blocks: allocation, the hash-chain prefix cache, eviction order."""

from __future__ import annotations

from deepserve.simulate.kv_cache import BlockPool, KVCacheManager
from deepserve.simulate.scheduler import SimRequest

BLOCK = 4


def request(name: str, tokens: list[int]) -> SimRequest:
    return SimRequest(name, tokens, max_tokens=8)


def admit(kv: KVCacheManager, req: SimRequest) -> int:
    """What the scheduler does for a waiting request: take the cached prefix, allocate the rest; returns the hit."""
    cached = kv.cached_prefix(req)
    hit = len(cached) * BLOCK
    assert kv.allocate(req, req.num_tokens - hit, cached)
    req.num_computed_tokens = req.num_tokens
    return hit


def test_blocks_are_allocated_by_the_block_and_a_full_cache_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=BLOCK, max_model_len=64, enable_caching=False)
    first = request("a", list(range(9)))  # 9 tokens: 3 blocks
    assert kv.allocate(first, 9)
    assert len(kv.blocks_of("a")) == 3 and kv.pool.num_free == 2
    second = request("b", list(range(100, 112)))  # 3 blocks, only 2 free
    assert not kv.allocate(second, 12)
    assert kv.pool.num_free == 2 and kv.blocks_of("b") == []
    first.num_computed_tokens = 9
    assert kv.allocate(first, 3)  # tokens 10-12 fit in its third block
    assert len(kv.blocks_of("a")) == 3
    assert kv.allocate(first, 4)  # 13-16 need a fourth
    assert len(kv.blocks_of("a")) == 4
    assert kv.usage == 4 / 5
    kv.free(first)
    assert kv.pool.num_free == 5 and kv.usage == 0.0


def test_a_shared_prefix_hits_its_full_blocks_but_never_the_last_token() -> None:
    kv = KVCacheManager(num_blocks=20, block_size=BLOCK, max_model_len=64, enable_caching=True)
    prefix = list(range(8))
    assert admit(kv, request("a", [*prefix, 50, 51, 52])) == 0
    assert admit(kv, request("b", [*prefix, 60, 61])) == 8  # two full blocks shared
    # the whole prompt is cached, but its last token must be computed: the hit stops a block short
    assert admit(kv, request("c", prefix)) == 4
    assert kv.pool.num_free == 20 - 3 - 1 - 1  # a: 3 blocks; b: 1 new; c: 1 new


def test_the_hash_chain_makes_a_block_depend_on_everything_before_it() -> None:
    kv = KVCacheManager(num_blocks=20, block_size=BLOCK, max_model_len=64, enable_caching=True)
    admit(kv, request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # same second block, different first block: no hit at all
    assert admit(kv, request("b", [0, 2, 3, 4, 5, 6, 7, 8, 9])) == 0


def test_freed_blocks_stay_cached_until_reused_and_the_tail_is_evicted_first() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK, max_model_len=64, enable_caching=True)
    first = request("a", list(range(16)))  # 4 full blocks
    admit(kv, first)
    kv.free(first)
    assert kv.pool.num_free == 4
    again = request("a2", list(range(16)))
    assert admit(kv, again) == 12  # still cached after the free
    kv.free(again)
    # a new request needs 2 blocks: the two freed last (the tail: blocks 3 and 4 of the prompt) go first
    other = request("b", list(range(100, 108)))
    admit(kv, other)
    kv.free(other)
    assert admit(kv, request("a3", list(range(16)))) == 8  # blocks 1-2 survived, 3-4 were evicted


def test_block_pool_evicts_least_recently_freed_and_shares_references() -> None:
    pool = BlockPool(3)
    blocks = pool.take(3)
    for block, block_hash in zip(blocks, (11, 22, 33), strict=True):
        pool.commit(block, block_hash)
    pool.release([blocks[1], blocks[0], blocks[2]])
    assert pool.cached_block(22) == blocks[1]
    pool.share([blocks[2]])  # a hit takes it out of the free queue
    assert pool.num_free == 2
    assert pool.take(1) == [blocks[1]]  # the least recently freed
    assert pool.cached_block(22) is None and pool.cached_block(11) == blocks[0]
    assert pool.clear_cache() == 1 and pool.cached_block(11) is None


def test_a_huge_pool_costs_nothing_until_used_and_takes_unused_blocks_before_freed_ones() -> None:
    pool = BlockPool(10**12)
    first = pool.take(2)
    pool.commit(first[0], 7)
    pool.release(first)
    assert pool.num_free == 10**12
    assert pool.take(1) == [2]  # a never-used block, not the freed ones that still cache a prefix
    assert pool.cached_block(7) == first[0]


def test_per_request_state_blocks_are_held_until_the_request_finishes() -> None:
    """DeepSeek-V4: windows and compressor state come from the same pool, a fixed number of blocks per request."""
    kv = KVCacheManager(
        num_blocks=10, block_size=BLOCK, max_model_len=64, enable_caching=False, state_blocks_per_sequence=3
    )
    first, second, third = (request(name, list(range(BLOCK))) for name in "abc")
    assert kv.allocate(first, BLOCK) and kv.pool.num_free == 10 - 3 - 1
    assert kv.allocate(second, BLOCK) and kv.pool.num_free == 2
    assert not kv.allocate(third, BLOCK) and kv.pool.num_free == 2  # 3 state + 1 block do not fit: nothing taken
    kv.free(first)
    assert kv.pool.num_free == 6 and kv.allocate(third, BLOCK)
