"""BlockPool and its intrusive free list (minivllm/core/block_pool.py)."""

from __future__ import annotations

import contextlib

import pytest

from minivllm.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def _blocks(n: int) -> list[KVCacheBlock]:
    return [KVCacheBlock(i) for i in range(n)]


def _walk_backwards(queue: FreeKVCacheBlockQueue) -> list[int]:
    """Block ids from tail to head, through the prev links (checks the list is doubly linked)."""
    ids = []
    block = queue._tail.prev_free_block
    while block is not None and block is not queue._head:
        ids.append(block.block_id)
        block = block.prev_free_block
    return ids


def _check_links(queue: FreeKVCacheBlockQueue) -> None:
    forward = queue.block_ids()
    assert _walk_backwards(queue) == forward[::-1]
    assert queue.num_free_blocks == len(forward)


# ---- FreeKVCacheBlockQueue --------------------------------------------------------------------


def test_queue_initial_order_and_popleft():
    blocks = _blocks(4)
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.block_ids() == [0, 1, 2, 3]
    _check_links(queue)
    assert queue.popleft() is blocks[0]
    assert queue.popleft() is blocks[1]
    assert queue.block_ids() == [2, 3]
    assert queue.num_free_blocks == 2
    _check_links(queue)
    # A block out of the queue has no links.
    assert blocks[0].prev_free_block is None and blocks[0].next_free_block is None


def test_queue_append_goes_to_tail():
    blocks = _blocks(4)
    queue = FreeKVCacheBlockQueue(blocks)
    b0, b1 = queue.popleft(), queue.popleft()
    queue.append(b1)
    queue.append(b0)
    assert queue.block_ids() == [2, 3, 1, 0]
    _check_links(queue)
    assert [queue.popleft().block_id for _ in range(4)] == [2, 3, 1, 0]


@pytest.mark.parametrize("victim", [0, 2, 4])  # head, middle, tail
def test_queue_remove_from_anywhere(victim):
    blocks = _blocks(5)
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[victim])
    assert queue.block_ids() == [i for i in range(5) if i != victim]
    assert queue.num_free_blocks == 4
    assert blocks[victim].prev_free_block is None and blocks[victim].next_free_block is None
    _check_links(queue)
    # The removed block can come back (at the tail).
    queue.append(blocks[victim])
    assert queue.block_ids() == [i for i in range(5) if i != victim] + [victim]
    _check_links(queue)


def test_queue_remove_touches_only_neighbours():
    """O(1) removal: unlinking a middle block rewires exactly its two neighbours."""
    blocks = _blocks(6)
    queue = FreeKVCacheBlockQueue(blocks)
    before = {b.block_id: (b.prev_free_block, b.next_free_block) for b in blocks}
    queue.remove(blocks[3])
    for b in blocks:
        if b.block_id == 2:
            assert (b.prev_free_block, b.next_free_block) == (before[2][0], blocks[4])
        elif b.block_id == 4:
            assert (b.prev_free_block, b.next_free_block) == (blocks[2], before[4][1])
        elif b.block_id != 3:
            assert (b.prev_free_block, b.next_free_block) == before[b.block_id]


def test_queue_empty_and_misuse():
    blocks = _blocks(2)
    queue = FreeKVCacheBlockQueue(blocks)
    queue.popleft()
    queue.popleft()
    assert queue.num_free_blocks == 0 and queue.block_ids() == []
    with pytest.raises(ValueError):
        queue.popleft()
    with pytest.raises(RuntimeError):
        queue.remove(blocks[0])  # not in the queue
    queue.append(blocks[0])
    with pytest.raises(RuntimeError):
        queue.append(blocks[0])  # already in the queue (and the only element)
    assert queue.block_ids() == [0] and queue.num_free_blocks == 1
    _check_links(queue)
    assert FreeKVCacheBlockQueue([]).block_ids() == []


# ---- BlockPool --------------------------------------------------------------------------------


def test_pool_needs_two_blocks():
    with pytest.raises(ValueError):
        BlockPool(1)
    with pytest.raises(ValueError):
        BlockPool(0)
    BlockPool(2)


def test_null_block_never_handed_out():
    pool = BlockPool(5)
    assert pool.null_block is pool.blocks[0]
    assert pool.null_block.ref_cnt == 1
    assert pool.get_num_free_blocks() == 4
    assert pool.free_block_queue.block_ids() == [1, 2, 3, 4]
    for _ in range(3):  # allocate everything, free it, again
        blocks = pool.get_new_blocks(4)
        assert sorted(b.block_id for b in blocks) == [1, 2, 3, 4]
        assert 0 not in {b.block_id for b in blocks}
        assert pool.get_num_free_blocks() == 0
        with pytest.raises(ValueError):
            pool.get_new_blocks(1)
        pool.free_blocks(blocks)
        assert pool.null_block.ref_cnt == 1
    assert 0 not in pool.free_block_queue.block_ids()


def test_freeing_the_null_block_does_not_hand_it_out():
    pool = BlockPool(3)
    with contextlib.suppress(RuntimeError, ValueError):  # rejecting it is fine too
        pool.free_blocks([pool.null_block])
    assert pool.null_block.ref_cnt == 1
    assert 0 not in pool.free_block_queue.block_ids()
    assert 0 not in [b.block_id for b in pool.get_new_blocks(pool.get_num_free_blocks())]


def test_get_new_blocks_sets_ref_cnt_and_follows_queue_order():
    pool = BlockPool(6)
    a = pool.get_new_blocks(2)
    assert [b.block_id for b in a] == [1, 2]
    assert all(b.ref_cnt == 1 for b in a)
    assert pool.get_new_blocks(0) == []
    b = pool.get_new_blocks(3)
    assert [x.block_id for x in b] == [3, 4, 5]
    assert pool.get_num_free_blocks() == 0


def test_get_new_blocks_beyond_free_count_raises_and_changes_nothing():
    pool = BlockPool(4)
    pool.get_new_blocks(1)
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)
    assert pool.get_num_free_blocks() == 2
    assert pool.free_block_queue.block_ids() == [2, 3]
    assert [b.ref_cnt for b in pool.blocks] == [1, 1, 0, 0]


def test_cached_blocks_are_freed_in_the_order_given():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(5)  # ids 1..5, queue now empty
    pool.cache_full_blocks(blocks, ["a", "b", "c", "d", "e"], 0)
    by_id = {b.block_id: b for b in blocks}
    pool.free_blocks([by_id[i] for i in (4, 2, 5)])
    assert pool.free_block_queue.block_ids() == [4, 2, 5]
    pool.free_blocks(iter([by_id[3], by_id[1]]))  # any iterable, e.g. reversed(...)
    assert pool.free_block_queue.block_ids() == [4, 2, 5, 3, 1]
    # ...and the next allocations evict them in that order (LRU: first freed, first reused).
    assert [b.block_id for b in pool.get_new_blocks(3)] == [4, 2, 5]
    _check_links(pool.free_block_queue)


def test_empty_blocks_are_reused_before_never_used_and_cached_ones():
    """An empty freed block goes to the head (last freed, first reused): it holds nothing the
    prefix cache could lose and its memory is warm; never-used blocks come next, cached last."""
    pool = BlockPool(8)
    blocks = pool.get_new_blocks(4)  # 1..4; 5, 6, 7 never used
    pool.cache_full_blocks(blocks[:2], ["a", "b"], 0)
    pool.free_blocks(reversed(blocks))  # as KVCacheManager.free: tail first
    assert pool.free_block_queue.block_ids() == [3, 4, 5, 6, 7, 2, 1]
    _check_links(pool.free_block_queue)
    assert [b.block_id for b in pool.get_new_blocks(6)] == [3, 4, 5, 6, 7, 2]
    assert pool.get_cached_block("a", 0) is blocks[0] and pool.get_cached_block("b", 0) is None


def test_shared_block_is_freed_on_last_reference():
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    block.ref_cnt += 1  # a second holder (what prefix caching will do)
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and block.block_id not in pool.free_block_queue.block_ids()
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and pool.free_block_queue.block_ids()[0] == block.block_id


def test_double_free_raises():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    pool.free_blocks(blocks)
    free_before = pool.free_block_queue.block_ids()
    with pytest.raises(RuntimeError):
        pool.free_blocks([blocks[0]])
    assert blocks[0].ref_cnt == 0  # never negative
    assert pool.free_block_queue.block_ids() == free_before


def test_free_of_never_allocated_block_raises():
    pool = BlockPool(4)
    with pytest.raises(RuntimeError):
        pool.free_blocks([pool.blocks[2]])
    assert pool.blocks[2].ref_cnt == 0
    assert pool.get_num_free_blocks() == 3


def test_usage():
    pool = BlockPool(5)  # 4 usable blocks
    assert pool.get_usage() == 0.0
    a = pool.get_new_blocks(1)
    assert pool.get_usage() == pytest.approx(0.25)
    b = pool.get_new_blocks(3)
    assert pool.get_usage() == pytest.approx(1.0)
    pool.free_blocks(b)
    assert pool.get_usage() == pytest.approx(0.25)
    pool.free_blocks(a)
    assert pool.get_usage() == 0.0
    assert BlockPool(2).get_usage() == 0.0
