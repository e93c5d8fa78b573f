"""The scheduler's only view of the KV cache: which blocks each request holds.

KVCacheManager maps request ids to lists of blocks from the BlockPool and answers two
questions for the scheduler: "can this request grow by N tokens?" (allocate_slots, which
allocates the blocks if so) and "this request is done or preempted" (free). It returns block
ids, never pool internals, so that SchedulerOutput stays plain data.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from minivllm.core.block_pool import BlockPool, KVCacheBlock

if TYPE_CHECKING:
    from minivllm.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens of `request` after its computed ones.

        Returns the ids of the newly allocated blocks (possibly empty), or None when the pool
        does not have enough free blocks — the scheduler then preempts or waits. Nothing is
        allocated on failure.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be positive, got {num_new_tokens}")
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_required = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        num_new_blocks = num_required - len(blocks)
        if num_new_blocks <= 0:
            return []
        if num_new_blocks > self.block_pool.get_num_free_blocks():
            return None
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        blocks.extend(new_blocks)
        return [block.block_id for block in new_blocks]

    def free(self, request: Request) -> None:
        """Return all blocks of a finished or preempted request to the pool.

        NOTE: blocks are freed tail first, so that when prefix caching keeps freed blocks as an
        LRU cache, the end of a sequence is evicted before its (more shareable) beginning.
        """
        blocks = self.req_to_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]
