"""One KV cache, several KV cache groups: the coordinator makes them act as one.

KVCacheCoordinator owns the BlockPool and one single-type manager per group (in the order of
KVCacheConfig.kv_cache_groups). A request grows in every group at once or not at all: the free
blocks of the shared pool are counted for all groups before any group takes one. A prefix cache
hit is the longest prefix that every group has cached. Results come per group, as tuples with
one entry per group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from minivllm.core.block_pool import BlockPool
from minivllm.core.single_type_kv_cache_manager import get_manager_for_kv_cache_spec

if TYPE_CHECKING:
    from minivllm.core.block_pool import KVCacheBlock
    from minivllm.core.kv_cache_interface import KVCacheConfig
    from minivllm.core.kv_cache_utils import BlockHash
    from minivllm.core.request import Request


class KVCacheCoordinator:
    def __init__(self, kv_cache_config: KVCacheConfig) -> None:
        self.block_pool = BlockPool(kv_cache_config.num_blocks)
        self.single_type_managers = tuple(
            get_manager_for_kv_cache_spec(group.kv_cache_spec, self.block_pool, group_id)
            for group_id, group in enumerate(kv_cache_config.kv_cache_groups)
        )

    def allocate_slots(
        self,
        request_id: str,
        num_computed_tokens: int,
        num_tokens: int,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
    ) -> tuple[list[KVCacheBlock], ...] | None:
        """Give the request slots for `num_tokens` tokens in every group, after taking its
        prefix cache hit `new_computed_blocks`; the new blocks per group, or None (and nothing
        touched but the blocks that fell out of a sliding window, given back first so that they
        count as free) when the pool cannot give all groups what they need."""
        for manager in self.single_type_managers:
            manager.remove_skipped_blocks(request_id, num_computed_tokens)
        num_blocks_to_allocate = sum(
            manager.get_num_blocks_to_allocate(request_id, num_tokens, computed)
            for manager, computed in zip(
                self.single_type_managers, new_computed_blocks, strict=True
            )
        )
        if num_blocks_to_allocate > self.block_pool.get_num_free_blocks():
            return None
        # NOTE: every group takes its hit before any group gets new blocks, so that new blocks
        # never evict another group's hit from the free queue.
        for manager, computed in zip(self.single_type_managers, new_computed_blocks, strict=True):
            manager.save_new_computed_blocks(request_id, computed)
        return tuple(
            manager.allocate_new_blocks(request_id, num_tokens)
            for manager in self.single_type_managers
        )

    def cache_blocks(
        self, request: Request, block_hashes: list[BlockHash], num_tokens: int
    ) -> None:
        """Enter the blocks that are full once the first `num_tokens` tokens are computed."""
        for manager in self.single_type_managers:
            manager.cache_blocks(request, block_hashes, num_tokens)

    def free(self, request_id: str) -> None:
        for manager in self.single_type_managers:
            manager.free(request_id)

    def trim(self, request_id: str, num_tokens: int) -> None:
        for manager in self.single_type_managers:
            manager.trim(request_id, num_tokens)

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        return tuple(
            manager.req_to_blocks.get(request_id, []) for manager in self.single_type_managers
        )

    def find_longest_cache_hit(
        self, block_hashes: list[BlockHash], max_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """The hit blocks of every group for the longest prefix of at most `max_length` tokens
        that all groups have cached, and its length in tokens.

        NOTE: each pass asks every group for its longest hit within the length all groups have
        agreed on so far; the length only shrinks, so this ends, after one pass when the groups
        agree (always, for one group). Asking again rather than cutting a longer hit short keeps
        it right for groups whose hits are not prefixes of each other (a sliding window).
        """
        while True:
            hits = tuple(
                manager.find_longest_cache_hit(block_hashes, max_length)
                for manager in self.single_type_managers
            )
            lengths = {
                len(blocks) * manager.block_size
                for blocks, manager in zip(hits, self.single_type_managers, strict=True)
            }
            if len(lengths) == 1:
                return hits, lengths.pop()
            max_length = min(lengths)
