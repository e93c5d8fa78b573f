"""The hybrid KV cache, hand-computed: SlidingWindowManager (blocks out of the window given back,
its cache hit searched from the right) and the coordinator's hit over a full-attention group and
a sliding-window group (the longest prefix both agree on).

Block ids are predictable: the free queue starts as [1, 2, ..., num_blocks - 1]; freed blocks
join its tail (cached) or head (empty), tail block first; new blocks come from its head.
"""

from __future__ import annotations

import pytest
from core_utils import (
    check_block_invariants,
    create_kv_cache_manager,
    create_requests,
    create_scheduler,
    run_to_completion,
)

from minivllm.core.block_pool import BlockPool
from minivllm.core.kv_cache_interface import SlidingWindowSpec
from minivllm.core.single_type_kv_cache_manager import SlidingWindowManager

NULL = 0


def _ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def _sliding(window: int, block_size: int = 4, num_blocks: int = 20) -> SlidingWindowManager:
    spec = SlidingWindowSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype="float32",
                             sliding_window=window)
    return SlidingWindowManager(spec, BlockPool(num_blocks), kv_cache_group_id=0)


def test_blocks_before_the_next_tokens_window_are_given_back():
    """Window 5, blocks of 4: the token at position 12 reads 8..12, so blocks 0 and 1 (tokens
    0-7) go back and become null entries; at 13 (reads 9..13) block 2 stays (9-11)."""
    manager = _sliding(window=5)
    pool = manager.block_pool
    assert _ids(manager.allocate_new_blocks("r", 12)) == [1, 2, 3]
    manager.remove_skipped_blocks("r", 12)
    assert _ids(manager.req_to_blocks["r"]) == [NULL, NULL, 3]
    assert pool.free_block_queue.block_ids()[:2] == [1, 2]  # empty blocks: to the head
    manager.remove_skipped_blocks("r", 13)  # nothing more to give back
    assert _ids(manager.req_to_blocks["r"]) == [NULL, NULL, 3]
    manager.allocate_new_blocks("r", 17)  # blocks 1 and 2 again, from the head
    manager.remove_skipped_blocks("r", 16)  # reads 12..16: block 3 (tokens 8-11) goes
    assert _ids(manager.req_to_blocks["r"]) == [NULL, NULL, NULL, 1, 2]
    manager.remove_skipped_blocks("r", 19)  # reads 15..19: block 1 (tokens 12-15) stays
    assert _ids(manager.req_to_blocks["r"]) == [NULL, NULL, NULL, 1, 2]
    manager.remove_skipped_blocks("r", 20)  # reads 16..20
    assert _ids(manager.req_to_blocks["r"]) == [NULL, NULL, NULL, NULL, 2]
    manager.free("r")
    assert pool.get_num_free_blocks() == 19 and pool.null_block.ref_cnt == 1


def test_window_of_one_token_keeps_only_the_current_block():
    manager = _sliding(window=1)
    manager.allocate_new_blocks("r", 9)
    manager.remove_skipped_blocks("r", 9)  # position 9 reads itself only: block 2
    assert _ids(manager.req_to_blocks["r"]) == [NULL, NULL, 3]


def test_given_back_blocks_stay_in_the_prefix_cache():
    """Cached blocks that leave the window go to the free queue's tail with their hash: another
    request whose window ends there can still take them."""
    manager = _sliding(window=5)
    pool = manager.block_pool
    hashes = [b"h0", b"h1", b"h2"]
    manager.allocate_new_blocks("r", 12)
    pool.cache_full_blocks(manager.req_to_blocks["r"], hashes, 0)
    manager.remove_skipped_blocks("r", 12)
    assert pool.free_block_queue.block_ids()[-2:] == [2, 1]  # tail first
    assert pool.get_cached_block(b"h0", 0).block_id == 1


@pytest.mark.parametrize(
    ("cached", "max_length", "hit"),
    [
        # Window 9, blocks of 4: a hit needs the cdiv(8, 4) = 2 blocks before its end.
        ([0, 1, 2, 3], 16, [NULL, NULL, "h2", "h3"]),
        ([2, 3], 16, [NULL, NULL, "h2", "h3"]),  # the start need not be cached
        ([0, 1, 3], 16, ["h0", "h1"]),  # block 2 missing: the hit ends before it
        ([1, 2], 16, [NULL, "h1", "h2"]),
        ([0, 1, 2, 3], 11, ["h0", "h1"]),  # within 11 tokens: 2 blocks
        ([0], 16, ["h0"]),  # a short hit from the start needs all of its blocks
        ([3], 16, []),
        ([], 16, []),
    ],
)
def test_cache_hit_needs_only_the_last_window(cached, max_length, hit):
    manager = _sliding(window=9)
    pool = manager.block_pool
    hashes = [b"h0", b"h1", b"h2", b"h3"]
    blocks = pool.get_new_blocks(len(cached))
    pool.cache_full_blocks(blocks, [hashes[i] for i in cached], 0)
    expected = [pool.get_cached_block(h.encode(), 0) if h != NULL else pool.null_block for h in hit]
    assert manager.find_longest_cache_hit(hashes, max_length) == expected


def _hybrid(num_blocks: int = 40, window: int = 5, enable_caching: bool = True):
    return create_kv_cache_manager(num_blocks, block_size=4, max_model_len=64, windows=[None, window],
                                   enable_caching=enable_caching)


def test_hybrid_hit_is_the_longest_prefix_both_groups_have():
    """A 20-token prompt computed, one token decoded, finished: full attention cached its 5
    blocks (1-5); the window group (6-10) gave back 6-9 at the decode, still cached. A second
    request of those 20 tokens + 4 hits 20 tokens in both groups: full attention all 5 blocks,
    the window group only the last (window 5 reads the 4 tokens before the next one)."""
    kv = _hybrid()
    prompt = list(range(100, 120))
    (first,) = create_requests(1, prompts=[prompt])
    assert kv.allocate_slots(first, 20) is not None
    first.num_computed_tokens = 20
    first.append_output_token_ids([7])
    kv.allocate_slots(first, 1)  # the window group gives back blocks before position 20 - 4
    full_ids, window_ids = kv.get_block_ids(first.request_id)
    assert full_ids == [1, 2, 3, 4, 5, 11] and window_ids == [NULL] * 4 + [10, 12]
    kv.free(first)
    (second,) = create_requests(1, prompts=[prompt + [1, 2, 3, 4]], start_index=1)
    hit, num_hit = kv.get_computed_blocks(second)
    assert num_hit == 20
    full_hit, window_hit = hit.blocks
    assert _ids(full_hit) == [1, 2, 3, 4, 5]
    assert _ids(window_hit) == [NULL, NULL, NULL, NULL, 10]
    assert kv.allocate_slots(second, 4, hit) is not None
    check_block_invariants(kv)


def test_window_group_evicted_blocks_shorten_the_hybrid_hit():
    """The window group's last block of a prefix is gone: both groups fall back to the longest
    prefix whose window blocks are cached."""
    kv = _hybrid()
    prompt = list(range(100, 120))
    (first,) = create_requests(1, prompts=[prompt])
    kv.allocate_slots(first, 20)
    first.num_computed_tokens = 20
    kv.free(first)
    window_manager = kv.coordinator.single_type_managers[1]
    last = window_manager.block_pool.get_cached_block(first.block_hashes[4], 1)
    kv.block_pool.free_block_queue.remove(last)  # evict it, as get_new_blocks would
    kv.block_pool._evict(last)
    kv.block_pool.free_block_queue.appendleft(last)
    (second,) = create_requests(1, prompts=[prompt + [1]], start_index=1)
    hit, num_hit = kv.get_computed_blocks(second)
    assert num_hit == 16
    assert [len(blocks) for blocks in hit.blocks] == [4, 4]
    assert hit.blocks[1][3].block_hash is not None


def test_scheduler_runs_long_requests_in_less_memory_with_a_window():
    """Four requests of 20 + 40 tokens, chunks of at most 8: 15 blocks each in the full group;
    in a window-5 group at most 4 (a chunk's 2-3 blocks and the block its window starts in).
    All four run together in 4 * (15 + 4) blocks, with no preemption, and every block comes
    back (the fake worker checks each step reads the right KV in its window)."""
    num_blocks = 4 * (15 + 4) + 1
    scheduler = create_scheduler(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=8,
                                 max_model_len=64, kv_cache_windows=[None, 5])
    for request in create_requests(4, prompt_len=20, max_tokens=40, ignore_eos=True):
        scheduler.add_request(request)
    run_to_completion(scheduler)
    assert scheduler.num_preemptions == 0
    assert scheduler.kv_cache_manager.get_num_free_blocks() == num_blocks - 1
