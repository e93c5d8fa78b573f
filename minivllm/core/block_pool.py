"""The physical KV cache blocks and their free list.

BlockPool owns every KVCacheBlock. It hands out free blocks, takes them back when their
reference count drops to zero, and knows nothing about requests: KVCacheManager decides which
request holds which blocks. Block 0 is the null block, never handed out, so that padded block
tables can point somewhere harmless.
"""

from __future__ import annotations

from collections.abc import Iterable


class KVCacheBlock:
    """Metadata of one physical block; the K/V tensors themselves live in the worker."""

    __slots__ = ("block_id", "ref_cnt", "prev_free_block", "next_free_block")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Links of the intrusive free list; None while the block is in use.
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt})"


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
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise RuntimeError(f"{block} is already in the free queue")
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
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
    """All KV cache blocks of the engine, with reference counts and a free queue."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"The KV cache needs at least 2 blocks (one is the null block), got {num_blocks}.")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.null_block = self.free_block_queue.popleft()
        self.null_block.ref_cnt = 1  # NOTE: held forever, so it is never freed or handed out.

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks (all but the null block) in use."""
        return 1.0 - self.get_num_free_blocks() / (self.num_blocks - 1)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            assert block.ref_cnt == 0, block
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero join the free queue in order."""
        for block in ordered_blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt <= 0:
                raise RuntimeError(f"Double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)
