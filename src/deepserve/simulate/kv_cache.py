"""The KV cache as vLLM's V1 engine manages it: fixed-size blocks, reference counts, and a prefix cache keyed by a
hash chain over full blocks of tokens.

- A request holds ceil(tokens / block_size) blocks. A block becomes reusable by other requests (it is "committed"
  under its hash) once it is full; the hash of block i covers its tokens and the hash of block i-1, so equal hashes
  mean equal prefixes.
- Freed blocks keep their contents and hash: they sit in a free queue in least-recently-freed order, and a new
  request whose prefix hashes to them takes them back (a prefix-cache hit). Allocation takes blocks from the head
  of the queue and evicts whatever they cached. A request's blocks are freed tail first, so its last blocks (the
  least shareable) are evicted before its first ones.
- A hit never covers a whole prompt: the last prompt token is always computed, so the model has logits to sample
  from (vLLM's max_cache_hit_length = num_tokens - 1).
- A model with per-request state besides its context (DeepSeek-V4's sliding windows and compressor state, which
  vLLM's hybrid manager draws from the same pool) holds STATE_BLOCKS_PER_SEQUENCE more blocks from its first
  allocation until it finishes (plan/memory.py's kv_state_blocks_per_sequence).

Written from vLLM's policy (vllm/v1/core/kv_cache_manager.py, block_pool.py); the code is deepserve's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Protocol


class CachedSequence(Protocol):
    """What the cache needs of a request."""

    request_id: str
    num_computed_tokens: int
    block_hashes: list[int]

    @property
    def num_tokens(self) -> int: ...

    def token_slice(self, start: int, end: int) -> tuple[int, ...]: ...


class BlockPool:
    """NUM_BLOCKS blocks; a free queue (least recently freed first) and the hash → block map of the prefix cache.

    Blocks never used yet are not listed: they stand at the head of the free queue (vLLM's initial order), so
    they are taken first, by number; a pool of billions of blocks (a fixed-timing simulator) costs nothing."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._unused = num_blocks  # blocks never taken: numbers num_blocks - _unused ... num_blocks - 1
        self._free: OrderedDict[int, None] = OrderedDict()  # freed blocks, least recently freed first
        self._refs: dict[int, int] = {}
        self._hash_of: dict[int, int] = {}
        self._by_hash: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        """Blocks no request holds (some still cache a prefix until they are reused)."""
        return self._unused + len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests: vLLM's kv_cache_usage_perc (1.0 = full)."""
        return 1.0 - self.num_free / self.num_blocks if self.num_blocks else 0.0

    def cached_block(self, block_hash: int) -> int | None:
        return self._by_hash.get(block_hash)

    def is_free(self, block: int) -> bool:
        return self._refs.get(block, 0) == 0

    def take(self, count: int) -> list[int]:
        """COUNT blocks from the head of the free queue; what they cached is evicted."""
        blocks = []
        for _ in range(count):
            if self._unused:
                block = self.num_blocks - self._unused
                self._unused -= 1
            else:
                block, _ = self._free.popitem(last=False)
                self._evict(block)
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def share(self, blocks: Iterable[int]) -> None:
        """Take a reference to cached BLOCKS (a prefix hit); a free one leaves the free queue."""
        for block in blocks:
            if self._refs.get(block, 0) == 0:
                del self._free[block]
            self._refs[block] = self._refs.get(block, 0) + 1

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each of BLOCKS, in order; a block nobody holds joins the tail of the free queue."""
        for block in blocks:
            refs = self._refs[block] - 1
            if refs:
                self._refs[block] = refs
            else:
                del self._refs[block]
                self._free[block] = None

    def commit(self, block: int, block_hash: int) -> None:
        """BLOCK is full and holds the tokens hashed to BLOCK_HASH: later requests may share it. When another block
        already caches that prefix (two requests computed it at once), this one stays private."""
        if block_hash not in self._by_hash and block not in self._hash_of:
            self._by_hash[block_hash] = block
            self._hash_of[block] = block_hash

    def clear_cache(self) -> int:
        """Forget every cached prefix of free blocks (vLLM's /reset_prefix_cache); returns how many."""
        cached = [block for block in self._free if block in self._hash_of]
        for block in cached:
            self._evict(block)
        return len(cached)

    def _evict(self, block: int) -> None:
        block_hash = self._hash_of.pop(block, None)
        if block_hash is not None and self._by_hash.get(block_hash) == block:
            del self._by_hash[block_hash]


class KVCacheManager:
    """Blocks per request on top of a BlockPool; prefix caching when ENABLE_CACHING."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool,
        state_blocks_per_sequence: int = 0,
    ) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.state_blocks_per_sequence = state_blocks_per_sequence
        self._state: dict[str, list[int]] = {}  # each request's fixed state blocks (never shared or cached)
        self._blocks: dict[str, list[int]] = {}
        self._committed: dict[str, int] = {}  # blocks of each request already in the prefix cache

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_of(self, request_id: str) -> list[int]:
        return self._blocks.get(request_id, [])

    def cached_prefix(self, request: CachedSequence) -> list[int]:
        """Blocks of the prefix cache that hold the longest cached prefix of REQUEST's tokens (never all of them:
        the last token must be computed to sample the next)."""
        if not self.enable_caching:
            return []
        usable = (request.num_tokens - 1) // self.block_size
        self._extend_hashes(request, usable)
        hits: list[int] = []
        for block_hash in request.block_hashes[:usable]:
            block = self.pool.cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate(self, request: CachedSequence, num_new_tokens: int, cached: list[int] | None = None) -> bool:
        """Room for NUM_NEW_TOKENS more tokens of REQUEST after its computed ones (and after CACHED, a prefix hit
        found by cached_prefix). False, with nothing changed, when the free blocks do not suffice."""
        held = self._blocks.get(request.request_id)
        if held is None:
            held = self._blocks[request.request_id] = []
        elif not cached:  # the common case, a decode token: it fits in the blocks held, no block became full
            end = request.num_computed_tokens + num_new_tokens
            if end <= len(held) * self.block_size and (
                not self.enable_caching or end // self.block_size <= self._committed.get(request.request_id, 0)
            ):
                return True
        hits = len(cached) if cached else 0
        computed = request.num_computed_tokens + hits * self.block_size
        needed_tokens = min(computed + num_new_tokens, self.max_model_len)
        new_blocks = max(-(-needed_tokens // self.block_size) - len(held) - hits, 0)
        state = 0 if request.request_id in self._state else self.state_blocks_per_sequence
        if cached:
            reclaimed = sum(1 for block in cached if self.pool.is_free(block))  # hits that leave the free queue
            if new_blocks + reclaimed + state > self.pool.num_free:
                return False
            self.pool.share(cached)
            held.extend(cached)
            self._committed.setdefault(request.request_id, len(held))
        elif new_blocks + state > self.pool.num_free:
            return False
        if request.request_id not in self._state:
            self._state[request.request_id] = self.pool.take(state)
        if new_blocks:
            held.extend(self.pool.take(new_blocks))
        if self.enable_caching:
            self._commit_full_blocks(request, min(computed + num_new_tokens, request.num_tokens))
        return True

    def free(self, request: CachedSequence) -> None:
        """Give back REQUEST's blocks, last first (so its tail is evicted before its shareable head)."""
        blocks = self._blocks.pop(request.request_id, [])
        self._committed.pop(request.request_id, None)
        self.pool.release(reversed(blocks))
        self.pool.release(self._state.pop(request.request_id, []))

    def _commit_full_blocks(self, request: CachedSequence, tokens: int) -> None:
        full = tokens // self.block_size
        done = self._committed.get(request.request_id, 0)
        if full <= done:
            return
        self._extend_hashes(request, full)
        held = self._blocks[request.request_id]
        for index in range(done, full):
            self.pool.commit(held[index], request.block_hashes[index])
        self._committed[request.request_id] = full

    def _extend_hashes(self, request: CachedSequence, blocks: int) -> None:
        """Hashes of REQUEST's first BLOCKS full blocks (each chained to the one before), computed once."""
        hashes = request.block_hashes
        size = self.block_size
        parent = hashes[-1] if hashes else 0
        for index in range(len(hashes), min(blocks, request.num_tokens // size)):
            parent = hash((parent, request.token_slice(index * size, (index + 1) * size)))
            hashes.append(parent)
