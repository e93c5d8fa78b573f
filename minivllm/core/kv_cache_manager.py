"""The scheduler's only view of the KV cache: which blocks each request holds, and which of a
new request's blocks are already computed (prefix caching).

KVCacheManager maps request ids to lists of blocks from the BlockPool and answers the
scheduler's questions: "how much of this prompt is cached?" (get_computed_blocks), "can this
request grow by N tokens?" (allocate_slots, which allocates the blocks if so and enters the
blocks that become full into the prefix cache) and "this request is done or preempted" (free).
It returns block ids, never pool internals, so that SchedulerOutput stays plain data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from minivllm.core.block_pool import BlockPool, KVCacheBlock
from minivllm.core.kv_cache_utils import get_hash_fn, update_block_hashes

if TYPE_CHECKING:
    from minivllm.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    """Cumulative, in tokens: prompt tokens looked up, and how many were found cached."""

    requests: int = 0
    queries: int = 0
    hits: int = 0


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool = False,
        hash_algo: str = "sha256",
    ) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.hash_fn = get_hash_fn(hash_algo)
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks at the start of the request's tokens, and the
        number of tokens they hold.

        NOTE: never the whole sequence: at least one token must be computed to get logits. A
        request that wants prompt logprobs must compute its whole prompt, so it gets no hit.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = update_block_hashes(request, self.block_size, self.hash_fn)
        blocks = []
        for block_hash in hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def record_admission(self, request: Request, num_cached_tokens: int) -> None:
        """Count one lookup in the stats (once per admission, not per retry); requests that
        skip the cache (prompt logprobs) are not lookups."""
        if self.enable_caching and request.sampling_params.prompt_logprobs is None:
            self.prefix_cache_stats.requests += 1
            self.prefix_cache_stats.queries += request.num_tokens
            self.prefix_cache_stats.hits += num_cached_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens of `request` after its computed ones
        (and after `new_computed_blocks`, the cache hit of a request being admitted).

        Returns the ids of the newly allocated blocks (possibly empty), or None when the pool
        does not have enough free blocks — the scheduler then preempts or waits. Nothing is
        allocated or touched on failure.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be positive, got {num_new_tokens}")
        computed = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed) * self.block_size
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = max(0, num_required - len(blocks) - len(computed))
        # Cached blocks nobody uses sit in the free queue: touching them uses up free blocks.
        num_evictable_computed = sum(1 for b in computed if b.ref_cnt == 0)
        if num_new_blocks + num_evictable_computed > self.block_pool.get_num_free_blocks():
            return None
        self.block_pool.touch(computed)
        blocks.extend(computed)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, num_computed + num_new_tokens)
        return [block.block_id for block in new_blocks]

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        """Enter the blocks that are full once this step's tokens are computed.

        NOTE: their KV is written during this step's forward pass, before any attention of the
        same layer reads it, so a request admitted later in the same step may already share them.
        """
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = update_block_hashes(request, self.block_size, self.hash_fn)
        self.block_pool.cache_full_blocks(blocks[start:num_full], hashes[start:num_full])
        self.num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Return all blocks of a finished or preempted request to the pool.

        NOTE: blocks are freed tail first, so that the end of a sequence is evicted before its
        (more shareable) beginning.
        """
        self.num_cached_blocks.pop(request.request_id, None)
        blocks = self.req_to_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]
