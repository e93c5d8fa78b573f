"""The block bookkeeping of one KV cache group: which blocks each request holds, and which of
them are in the prefix cache.

The KVCacheCoordinator owns one manager per group, all drawing from one shared BlockPool. What
depends on how the group's layers attend is a method here: which blocks a request no longer
needs, and what counts as a prefix cache hit. Full attention keeps every block and needs the
whole prefix cached; a sliding window gives back the blocks that fell out of the window (their
place in the request's list taken by the null block) and needs only the last window cached.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

from minivllm.core.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from minivllm.utils import cdiv

if TYPE_CHECKING:
    from minivllm.core.block_pool import BlockPool, KVCacheBlock
    from minivllm.core.kv_cache_interface import KVCacheSpec
    from minivllm.core.kv_cache_utils import BlockHash
    from minivllm.core.request import Request


class SingleTypeKVCacheManager(ABC):
    """Per-request block lists of one KV cache group."""

    def __init__(
        self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, kv_cache_group_id: int
    ) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.block_pool = block_pool
        self.kv_cache_group_id = kv_cache_group_id
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        """Free blocks it takes for the request to have slots for `num_tokens` tokens, its
        prefix cache hit `new_computed_blocks` included."""
        num_held = len(self.req_to_blocks.get(request_id, ())) + len(new_computed_blocks)
        num_new_blocks = max(0, cdiv(num_tokens, self.block_size) - num_held)
        # Cached blocks nobody uses sit in the free queue: touching them uses up free blocks.
        num_evictable_computed = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        return num_new_blocks + num_evictable_computed

    def save_new_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> None:
        """Take the prefix cache hit of a request being admitted (before any new block)."""
        self.block_pool.touch(new_computed_blocks)
        self.req_to_blocks.setdefault(request_id, []).extend(new_computed_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Give the request slots for `num_tokens` tokens; returns the blocks added."""
        blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new_blocks = max(0, cdiv(num_tokens, self.block_size) - len(blocks))
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(
        self, request: Request, block_hashes: list[BlockHash], num_tokens: int
    ) -> None:
        """Enter the request's blocks that are full once its first `num_tokens` tokens are
        computed (`block_hashes` covers at least those)."""
        num_full = num_tokens // self.block_size
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        blocks = self.req_to_blocks[request.request_id]
        self.block_pool.cache_full_blocks(
            blocks[start:num_full], block_hashes[start:num_full], self.kv_cache_group_id
        )
        self.num_cached_blocks[request.request_id] = num_full

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Free the request's blocks past its first `num_tokens` tokens (tail first).

        NOTE: they hold no cached block: only blocks of computed known tokens are cached."""
        blocks = self.req_to_blocks[request_id]
        num_kept = cdiv(num_tokens, self.block_size)
        if len(blocks) > num_kept:
            self.block_pool.free_blocks(reversed(blocks[num_kept:]))
            del blocks[num_kept:]

    def free(self, request_id: str) -> None:
        """Return all blocks of the request to the pool.

        NOTE: blocks are freed tail first, so that the end of a sequence is evicted before its
        (more shareable) beginning.
        """
        self.num_cached_blocks.pop(request_id, None)
        blocks = self.req_to_blocks.pop(request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    @abstractmethod
    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the blocks that no later token will read, before the request grows."""

    @abstractmethod
    def find_longest_cache_hit(
        self, block_hashes: list[BlockHash], max_length: int
    ) -> list[KVCacheBlock]:
        """The cached blocks a new request of these hashes can start from: the longest hit of
        at most `max_length` tokens (len(result) * block_size tokens)."""


class FullAttentionManager(SingleTypeKVCacheManager):
    """Every token attends to all earlier ones: a request keeps a block for each of its tokens."""

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Nothing to free: every block is read again by the next token."""

    def find_longest_cache_hit(
        self, block_hashes: list[BlockHash], max_length: int
    ) -> list[KVCacheBlock]:
        """The leading blocks that are all cached (a hit needs the whole prefix)."""
        hit_blocks = []
        for block_hash in block_hashes[: max_length // self.block_size]:
            block = self.block_pool.get_cached_block(block_hash, self.kv_cache_group_id)
            if block is None:
                break
            hit_blocks.append(block)
        return hit_blocks


class SlidingWindowManager(SingleTypeKVCacheManager):
    """A token attends to the last `sliding_window` tokens (itself included): a request keeps the
    blocks its next token's window reaches; earlier entries of its list are the null block."""

    def __init__(
        self, kv_cache_spec: SlidingWindowSpec, block_pool: BlockPool, kv_cache_group_id: int
    ) -> None:
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id)
        self.sliding_window = kv_cache_spec.sliding_window

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the blocks wholly before the window of the token at `num_computed_tokens`.

        NOTE: freed blocks keep their prefix cache entry (they go to the free queue's tail):
        another request whose window ends there can still hit them. Walking back from the last
        skipped block stops at the first null block, since everything before it went earlier.
        """
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        first_needed_token = max(0, num_computed_tokens - self.sliding_window + 1)
        removed = []
        for i in range(min(first_needed_token // self.block_size, len(blocks)) - 1, -1, -1):
            if blocks[i] is self.block_pool.null_block:
                break
            removed.append(blocks[i])
            blocks[i] = self.block_pool.null_block
        self.block_pool.free_blocks(removed)

    def find_longest_cache_hit(
        self, block_hashes: list[BlockHash], max_length: int
    ) -> list[KVCacheBlock]:
        """The longest hit whose last `sliding_window - 1` tokens' blocks are cached, searched
        from the right: the next token reads only those. Earlier blocks are the null block.

        NOTE: a hit at the very start (shorter than the window) needs all its blocks, as with
        full attention; cdiv(window - 1, block_size) blocks cover the window of the next token.
        """
        num_blocks = max_length // self.block_size
        needed = cdiv(self.sliding_window - 1, self.block_size)
        hit_blocks: list[KVCacheBlock] = [self.block_pool.null_block] * num_blocks
        run = 0  # cached blocks in a row, ending at block i
        for i in range(num_blocks - 1, -1, -1):
            block = self.block_pool.get_cached_block(block_hashes[i], self.kv_cache_group_id)
            if block is None:
                run = 0
                continue
            hit_blocks[i] = block
            run += 1
            if run >= needed:
                # Blocks i .. i + run - 1 are cached and the hit ends after them.
                del hit_blocks[i + run :]
                return hit_blocks
        # Fewer than `needed` blocks in a row anywhere: a hit from the start, if any.
        num_leading = next((i for i, b in enumerate(hit_blocks) if b is self.block_pool.null_block), num_blocks)
        return hit_blocks[:num_leading]


spec_manager_map: dict[type[KVCacheSpec], type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
}


def get_manager_for_kv_cache_spec(
    kv_cache_spec: KVCacheSpec, block_pool: BlockPool, kv_cache_group_id: int
) -> SingleTypeKVCacheManager:
    """The manager for a group of layers with this spec."""
    return spec_manager_map[type(kv_cache_spec)](kv_cache_spec, block_pool, kv_cache_group_id)
