"""The scheduler's only view of the KV cache: which blocks each request holds, and which of a
new request's blocks are already computed (prefix caching).

KVCacheManager answers the scheduler's questions: "how much of this prompt is cached?"
(get_computed_blocks), "can this request grow by N tokens?" (allocate_slots, which allocates the
blocks if so and enters the blocks that become full into the prefix cache) and "this request is
done or preempted" (free). Below it, a KVCacheCoordinator keeps one block table per KV cache group
(core/kv_cache_interface.py) over one shared BlockPool. The scheduler gets block ids, one list
per group, or an opaque KVCacheBlocks that it only passes back, never pool internals, so that
SchedulerOutput stays plain data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from minivllm.core.kv_cache_coordinator import KVCacheCoordinator
from minivllm.core.kv_cache_utils import HASH_FUNCTIONS, update_block_hashes

if TYPE_CHECKING:
    from minivllm.core.block_pool import KVCacheBlock
    from minivllm.core.kv_cache_interface import KVCacheConfig
    from minivllm.core.request import Request


@dataclass
class PrefixCacheStats:
    """Cumulative, in tokens: prompt tokens looked up, and how many were found cached."""

    requests: int = 0
    queries: int = 0
    hits: int = 0


@dataclass(frozen=True)
class KVCacheBlocks:
    """A request's prefix cache hit, one list of blocks per KV cache group: what
    get_computed_blocks gives the scheduler and allocate_slots takes back."""

    blocks: tuple[Sequence[KVCacheBlock], ...]


class KVCacheManager:
    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        enable_caching: bool = False,
        hash_algo: str = "sha256",
    ) -> None:
        self.block_size = kv_cache_config.block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.hash_fn = HASH_FUNCTIONS[hash_algo]
        self.coordinator = KVCacheCoordinator(kv_cache_config)
        self.block_pool = self.coordinator.block_pool
        self.empty_kv_cache_blocks = KVCacheBlocks(((),) * len(kv_cache_config.kv_cache_groups))
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest run of cached full blocks at the start of the request's tokens (in every
        group), and the number of tokens they hold.

        NOTE: never the whole sequence: at least one token must be computed to get logits. A
        request that wants prompt logprobs must compute its whole prompt, so it gets no hit.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return self.empty_kv_cache_blocks, 0
        block_hashes = update_block_hashes(request, self.block_size, self.hash_fn)
        hit_blocks, num_hit_tokens = self.coordinator.find_longest_cache_hit(
            block_hashes, request.num_tokens - 1
        )
        return KVCacheBlocks(hit_blocks), num_hit_tokens

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
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
    ) -> tuple[list[int], ...] | None:
        """Make room for `num_new_tokens` more tokens of `request` after its computed ones
        (and after `new_computed_blocks`, the cache hit of a request being admitted). The new
        tokens may include draft tokens (speculative decoding): they get slots too, and so do
        `num_lookahead_tokens` more after them, where a drafter writes the KV of its drafts.

        Returns the ids of the newly allocated blocks per KV cache group (possibly empty lists),
        or None when the pool does not have enough free blocks for all groups — the scheduler
        then preempts or waits. Nothing is allocated or touched on failure; only the blocks that
        fell out of a sliding window are given back either way (no token reads them again).
        """
        hit_blocks = (new_computed_blocks or self.empty_kv_cache_blocks).blocks
        num_computed = request.num_computed_tokens + len(hit_blocks[0]) * self.block_size
        num_tokens = num_computed + num_new_tokens
        if num_new_tokens <= 0 or num_tokens > self.max_model_len:
            raise ValueError(
                f"Cannot allocate {num_new_tokens} new tokens after {num_computed} computed ones "
                f"(at least 1, and at most max_model_len={self.max_model_len} in all)."
            )
        new_blocks = self.coordinator.allocate_slots(
            request.request_id,
            request.num_computed_tokens,
            num_tokens + num_lookahead_tokens,
            hit_blocks,
        )
        if new_blocks is None:
            return None
        if self.enable_caching:
            # NOTE: only blocks full of known tokens are cached (drafts are never hashed). The
            # KV of those blocks is written during this step's forward pass, before any
            # attention of the same layer reads it, so a request admitted later in the same
            # step may already share them.
            block_hashes = update_block_hashes(request, self.block_size, self.hash_fn)
            num_known_tokens = min(num_tokens, request.num_tokens)
            self.coordinator.cache_blocks(request, block_hashes, num_known_tokens)
        return tuple([block.block_id for block in blocks] for blocks in new_blocks)

    def trim(self, request: Request) -> None:
        """Speculative decoding, after a step: give back the blocks past the request's computed
        tokens, which only rejected drafts and lookahead slots used. A running request then
        holds exactly the blocks of its computed tokens (the worker trims its tables alike)."""
        self.coordinator.trim(request.request_id, request.num_computed_tokens)

    def free(self, request: Request) -> None:
        """Return all blocks of a finished or preempted request to the pool (tail first)."""
        self.coordinator.free(request.request_id)

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block table of each KV cache group."""
        blocks_per_group = self.coordinator.get_blocks(request_id)
        return tuple([block.block_id for block in blocks] for blocks in blocks_per_group)
