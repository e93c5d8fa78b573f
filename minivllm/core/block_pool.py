"""The physical KV cache blocks, their free list, and the prefix cache's hash -> block map.

BlockPool owns every KVCacheBlock, one pool for all KV cache groups. It hands out free blocks,
takes them back when their reference count drops to zero, and knows nothing about requests: the
per-group managers (core/single_type_kv_cache_manager.py) decide which request holds which
blocks. Block 0 is the null block, never handed out, so that padded block tables can point
somewhere harmless.

With prefix caching, a full block keeps its hash after its last user frees it: it sits in the
free queue with its content intact, and a later request with the same prefix can take it back
(touch). The free queue is therefore also the eviction order: blocks are taken from its head
(least recently freed) and lose their hash only then. The prefix cache is keyed by (block hash,
KV cache group id): the same tokens give each group its own block (other layers, other KV), so
groups never share a block through the cache.

A freed block with nothing worth keeping (no hash: prefix caching off, a partly filled last
block, or after reset_prefix_cache) goes to the head instead, so the queue reads: empty blocks
freed most recently first, then never-used blocks, then cached blocks oldest first. Reusing an
empty block before a never-used one costs the cache nothing and keeps the KV memory in use warm:
its pages are already mapped (a first write to a never-used page is a page fault, about 1-2.5
ms per MiB in a VM that backs guest memory lazily) and likely still in the CPU caches.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minivllm.core.kv_cache_utils import BlockHash, BlockHashWithGroupId


class KVCacheBlock:
    """Metadata of one physical block; the K/V tensors themselves live in the worker."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # The prefix cache key, (block hash, KV cache group id), while the block is cached.
        self.block_hash: BlockHashWithGroupId | None = None
        # Links of the intrusive free list; None while the block is in use.
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks: O(1) popleft, append and removal from the middle.

    NOTE: the links live in the blocks themselves (intrusive list), so manipulating the queue
    allocates no Python objects. Two sentinel nodes remove the empty-list special cases.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self._tail
        self._tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is self._tail or block is None:
            raise ValueError("No free blocks available")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free_block
        assert last is not None
        self._insert(block, last, self._tail)

    def appendleft(self, block: KVCacheBlock) -> None:
        first = self._head.next_free_block
        assert first is not None
        self._insert(block, self._head, first)

    def _insert(self, block: KVCacheBlock, prev: KVCacheBlock, nxt: KVCacheBlock) -> None:
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise RuntimeError(f"{block} is already in the free queue")
        prev.next_free_block = block
        block.prev_free_block = prev
        block.next_free_block = nxt
        nxt.prev_free_block = block
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        """All free block ids in queue order (for tests and debugging)."""
        ids = []
        block = self._head.next_free_block
        while block is not None and block is not self._tail:
            ids.append(block.block_id)
            block = block.next_free_block
        return ids


class BlockPool:
    """All KV cache blocks of the engine, with reference counts, a free queue and the prefix cache."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"The KV cache needs at least 2 blocks (one is the null block), got {num_blocks}.")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.null_block = self.free_block_queue.popleft()
        self.null_block.ref_cnt = 1  # NOTE: held forever, so it is never freed or handed out.
        self.cached_block_hash_to_block: dict[BlockHashWithGroupId, KVCacheBlock] = {}
        # Ids of the blocks whose holders or hash changed, while an EventCollector
        # (core/events.py) watches; None otherwise, and nothing is recorded.
        self.changed_block_ids: set[int] | None = None

    def get_num_free_blocks(self) -> int:
        """Blocks that can be handed out now, cached-but-unused ones included."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks (all but the null block) in use."""
        return 1.0 - self.get_num_free_blocks() / (self.num_blocks - 1)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take blocks from the head of the free queue, evicting their cached content."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            assert block.ref_cnt == 0, block
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        if self.changed_block_ids is not None:
            self.changed_block_ids.update(block.block_id for block in blocks)
        return blocks

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            del self.cached_block_hash_to_block[block.block_hash]
            block.block_hash = None

    def get_cached_block(
        self, block_hash: BlockHash, kv_cache_group_id: int
    ) -> KVCacheBlock | None:
        """The block that holds this content for this KV cache group, if any."""
        return self.cached_block_hash_to_block.get((block_hash, kv_cache_group_id))

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference to cached blocks; unused ones leave the free queue (no longer evictable)."""
        changed = self.changed_block_ids
        for block in blocks:
            if block is self.null_block:  # a sliding window's skipped blocks: nothing to hold
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1
            if changed is not None:
                changed.add(block.block_id)

    def cache_full_blocks(
        self, blocks: list[KVCacheBlock], block_hashes: list[BlockHash], kv_cache_group_id: int
    ) -> None:
        """Enter full blocks of one KV cache group into the prefix cache under their hashes.

        NOTE: if another block already holds a key (two requests computed the same prefix at
        the same time), the existing entry stays and this block remains uncached.
        """
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            key = (block_hash, kv_cache_group_id)
            if block is self.null_block:  # stands for a block a sliding window already freed
                continue
            if block.block_hash is None and key not in self.cached_block_hash_to_block:
                block.block_hash = key
                self.cached_block_hash_to_block[key] = block
                if self.changed_block_ids is not None:
                    self.changed_block_ids.add(block.block_id)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero join the free queue, cached
        ones at the tail in order (keeping their hash and content until evicted), empty ones at
        the head."""
        changed = self.changed_block_ids
        for block in ordered_blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt <= 0:
                raise RuntimeError(f"Double free of {block}")
            block.ref_cnt -= 1
            if changed is not None:
                changed.add(block.block_id)
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_block_queue.appendleft(block)
                else:
                    self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, which become empty blocks at the head of the free queue;
        refused (False) while any block is in use."""
        if self.get_num_free_blocks() != self.num_blocks - 1:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
            self.free_block_queue.remove(block)
            self.free_block_queue.appendleft(block)
        if self.changed_block_ids is not None:
            self.changed_block_ids.update(block.block_id for block in self.cached_block_hash_to_block.values())
        self.cached_block_hash_to_block.clear()
        return True
