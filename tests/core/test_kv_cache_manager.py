"""KVCacheManager (minivllm/core/kv_cache_manager.py) and the KV cache groups below it
(kv_cache_coordinator.py, single_type_kv_cache_manager.py): block arithmetic, failure, free
order, several groups over one pool, and random operation sequences.

The scheduler advances request.num_computed_tokens after allocate_slots; these tests do the
same by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
from core_utils import (
    check_block_invariants,
    create_kv_cache_manager,
    create_requests,
    make_kv_cache_config,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.core.kv_cache_coordinator import KVCacheCoordinator
from minivllm.core.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.single_type_kv_cache_manager import FullAttentionManager, spec_manager_map
from minivllm.utils import cdiv


def _manager(num_blocks: int = 11, block_size: int = 16, num_groups: int = 1) -> KVCacheManager:
    return create_kv_cache_manager(num_blocks, block_size, num_groups=num_groups)


def _grow_groups(kv: KVCacheManager, request, num_new_tokens: int) -> tuple[list[int], ...] | None:
    """allocate_slots, then advance num_computed_tokens as the scheduler does."""
    new = kv.allocate_slots(request, num_new_tokens)
    if new is not None:
        request.num_computed_tokens += num_new_tokens
    return new


def _grow(kv: KVCacheManager, request, num_new_tokens: int) -> list[int] | None:
    """_grow_groups for a manager of one KV cache group: the new block ids of that group."""
    new = _grow_groups(kv, request, num_new_tokens)
    if new is None:
        return None
    (new_ids,) = new
    return new_ids


def _pool_snapshot(kv: KVCacheManager):
    pool = kv.block_pool
    return (
        pool.free_block_queue.block_ids(),
        pool.get_num_free_blocks(),
        [b.ref_cnt for b in pool.blocks],
        [
            {k: [b.block_id for b in v] for k, v in manager.req_to_blocks.items()}
            for manager in kv.coordinator.single_type_managers
        ],
    )


def test_cdiv():
    assert [cdiv(a, 4) for a in range(10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]


def test_exact_block_boundaries():
    kv = _manager()
    (req,) = create_requests(1)
    assert _grow(kv, req, 16) == [1]  # exactly one block
    assert _grow(kv, req, 16) == [2]  # exactly one more, ending on a boundary
    assert _grow(kv, req, 32) == [3, 4]
    assert kv.get_block_ids("0") == ([1, 2, 3, 4],)
    assert req.num_computed_tokens == 64
    assert kv.get_num_free_blocks() == 6


def test_growth_by_one_token_crosses_boundary():
    kv = _manager()
    (req,) = create_requests(1)
    assert _grow(kv, req, 15) == [1]
    assert _grow(kv, req, 1) == []  # 16 tokens: still one block
    assert _grow(kv, req, 1) == [2]  # token 17 needs a second block
    for _ in range(15):  # tokens 18..32 fit in block 2
        assert _grow(kv, req, 1) == []
    assert req.num_computed_tokens == 32
    assert _grow(kv, req, 1) == [3]
    assert kv.get_block_ids("0") == ([1, 2, 3],)


def test_chunk_spanning_several_blocks():
    kv = _manager()
    (req,) = create_requests(1)
    assert _grow(kv, req, 17) == [1, 2]
    assert _grow(kv, req, 40) == [3, 4]  # 57 tokens -> 4 blocks
    assert _grow(kv, req, 7) == []  # 64 tokens -> 4 blocks
    assert _grow(kv, req, 1) == [5]


def test_returns_empty_list_when_no_new_block_needed():
    kv = _manager()
    (req,) = create_requests(1)
    assert _grow(kv, req, 3) == [1]
    free_before = kv.get_num_free_blocks()
    new = kv.allocate_slots(req, 13)  # 3 + 13 = 16: fits in block 1
    assert new == ([],)
    assert kv.get_num_free_blocks() == free_before


def test_non_positive_num_new_tokens_raises():
    kv = _manager()
    (req,) = create_requests(1)
    with pytest.raises(ValueError):
        kv.allocate_slots(req, 0)
    with pytest.raises(ValueError):
        kv.allocate_slots(req, -1)
    assert kv.get_num_free_blocks() == 10


def test_block_size_one_and_large():
    kv = create_kv_cache_manager(num_blocks=6, block_size=1, max_model_len=5)
    (req,) = create_requests(1)
    assert _grow(kv, req, 3) == [1, 2, 3]
    assert _grow(kv, req, 1) == [4]
    kv = create_kv_cache_manager(num_blocks=3, block_size=256, max_model_len=512)
    (req,) = create_requests(1)
    assert _grow(kv, req, 256) == [1]
    assert _grow(kv, req, 1) == [2]


def test_failure_leaves_pool_unchanged():
    kv = _manager()  # 10 usable blocks
    a, b = create_requests(2)
    assert _grow(kv, a, 16 * 8) == list(range(1, 9))
    snapshot = _pool_snapshot(kv)
    assert _grow(kv, b, 16 * 2 + 1) is None  # needs 3 blocks, 2 free
    assert b.num_computed_tokens == 0
    after = _pool_snapshot(kv)
    assert after[:3] == snapshot[:3]
    assert kv.get_block_ids("1") == ([],) and kv.get_block_ids("0") == (list(range(1, 9)),)
    # Growing a request that already holds blocks fails the same way.
    assert _grow(kv, a, 16 * 3) is None
    assert _pool_snapshot(kv)[:3] == snapshot[:3]
    assert kv.get_block_ids("0") == (list(range(1, 9)),)
    # Exactly the free count succeeds.
    assert _grow(kv, b, 32) == [9, 10]
    assert kv.get_num_free_blocks() == 0
    assert kv.allocate_slots(b, 1) is None
    assert kv.allocate_slots(a, 1) is None


def test_free_returns_blocks_tail_first():
    """Tail first: uncached blocks land at the queue's head, so a request's blocks come back in
    table order, the last freed request's first."""
    kv = _manager()
    a, b = create_requests(2)
    _grow(kv, a, 40)  # [1, 2, 3]
    _grow(kv, b, 20)  # [4, 5]
    assert kv.block_pool.free_block_queue.block_ids() == [6, 7, 8, 9, 10]
    kv.free(a)
    assert kv.block_pool.free_block_queue.block_ids() == [1, 2, 3, 6, 7, 8, 9, 10]
    kv.free(b)
    assert kv.block_pool.free_block_queue.block_ids() == [4, 5, 1, 2, 3, 6, 7, 8, 9, 10]
    assert kv.coordinator.single_type_managers[0].req_to_blocks == {}
    assert kv.get_block_ids("0") == ([],)
    assert all(blk.ref_cnt == 0 for blk in kv.block_pool.blocks[1:])
    assert kv.usage == 0.0


def test_free_of_unknown_or_already_freed_request_is_noop():
    kv = _manager()
    a, b = create_requests(2)
    _grow(kv, a, 20)
    snapshot = _pool_snapshot(kv)
    kv.free(b)  # never allocated
    assert _pool_snapshot(kv) == snapshot
    kv.free(a)
    snapshot = _pool_snapshot(kv)
    kv.free(a)  # already freed: no double free
    assert _pool_snapshot(kv) == snapshot


def test_free_after_failed_first_allocation():
    """A request whose first allocation failed holds nothing; freeing it frees nothing."""
    kv = _manager(num_blocks=3)
    a, b = create_requests(2)
    _grow(kv, a, 32)
    assert _grow(kv, b, 1) is None
    kv.free(b)
    assert all("1" not in m.req_to_blocks for m in kv.coordinator.single_type_managers)
    assert kv.get_num_free_blocks() == 0


def test_reallocation_after_free_starts_from_scratch():
    """Preemption by recompute: after free, the request is allocated from token 0 again."""
    kv = _manager()
    a, b = create_requests(2)
    _grow(kv, a, 20)  # [1, 2]
    _grow(kv, b, 5)  # [3]
    kv.free(a)
    a.num_computed_tokens = 0
    assert kv.block_pool.free_block_queue.block_ids() == [1, 2, 4, 5, 6, 7, 8, 9, 10]
    assert _grow(kv, a, 21) == [1, 2]
    assert kv.get_block_ids("0") == ([1, 2],)


def test_usage():
    kv = _manager(num_blocks=5)  # 4 usable
    (a,) = create_requests(1)
    assert kv.usage == 0.0
    _grow(kv, a, 16)
    assert kv.usage == pytest.approx(0.25)
    _grow(kv, a, 48)
    assert kv.usage == pytest.approx(1.0)
    kv.free(a)
    assert kv.usage == 0.0


def test_allocation_past_max_model_len_raises():
    kv = create_kv_cache_manager(num_blocks=11, block_size=16, max_model_len=40)
    (req,) = create_requests(1)
    assert _grow(kv, req, 39) == [1, 2, 3]
    with pytest.raises(ValueError, match="max_model_len=40"):
        kv.allocate_slots(req, 2)
    assert _grow(kv, req, 1) == []  # exactly max_model_len tokens
    assert kv.get_num_free_blocks() == 7


# ---- several KV cache groups over one pool ------------------------------------------------------


def test_two_groups_allocate_from_one_pool_in_group_order():
    kv = _manager(num_groups=2)  # 10 usable blocks for both groups
    a, b = create_requests(2)
    assert _grow_groups(kv, a, 17) == ([1, 2], [3, 4])
    assert _grow_groups(kv, b, 5) == ([5], [6])
    assert _grow_groups(kv, a, 15) == ([], [])  # 32 tokens: still two blocks per group
    assert _grow_groups(kv, a, 1) == ([7], [8])
    assert kv.get_block_ids("0") == ([1, 2, 7], [3, 4, 8])
    assert kv.get_block_ids("1") == ([5], [6])
    assert kv.get_num_free_blocks() == 2
    assert kv.usage == pytest.approx(0.8)


def test_two_groups_allocate_all_or_nothing():
    kv = _manager(num_groups=2)
    a, b = create_requests(2)
    assert _grow_groups(kv, a, 64) == ([1, 2, 3, 4], [5, 6, 7, 8])
    snapshot = _pool_snapshot(kv)
    # b needs 2 blocks in each group, 4 in all; 2 are free. Group 0 alone would fit, but
    # neither group takes anything.
    assert _grow_groups(kv, b, 17) is None
    assert _pool_snapshot(kv) == snapshot and b.num_computed_tokens == 0
    assert kv.get_block_ids("1") == ([], [])
    assert _grow_groups(kv, b, 16) == ([9], [10])  # one block per group: exactly the 2 free
    snapshot = _pool_snapshot(kv)
    assert _grow_groups(kv, a, 1) is None
    assert _grow_groups(kv, b, 1) is None
    assert _pool_snapshot(kv) == snapshot
    kv.free(a)
    # a freed group 0's blocks, then group 1's, each to the head: [5, 6, 7, 8, 1, 2, 3, 4].
    assert _grow_groups(kv, b, 1) == ([5], [6])


def test_two_groups_free_every_group_tail_first():
    kv = _manager(num_groups=2)
    a, b = create_requests(2)
    _grow_groups(kv, a, 20)  # ([1, 2], [3, 4])
    _grow_groups(kv, b, 5)  # ([5], [6])
    kv.free(a)
    # Group 0's blocks, then group 1's, each freed tail first to the head of the queue.
    assert kv.block_pool.free_block_queue.block_ids() == [3, 4, 1, 2, 7, 8, 9, 10]
    kv.free(b)
    assert kv.block_pool.free_block_queue.block_ids() == [6, 5, 3, 4, 1, 2, 7, 8, 9, 10]
    assert kv.get_block_ids("0") == ([], []) and kv.usage == 0.0
    assert all(block.ref_cnt == 0 for block in kv.block_pool.blocks[1:])


@dataclass(frozen=True)
class _PairSpec(FullAttentionSpec):
    """A made-up kind of layer whose cache hits come in pairs of blocks."""


class _PairManager(FullAttentionManager):
    """Rounds the full attention hit down to an even number of blocks, and records the
    longest hit it was asked for each time."""

    asked: list[int] = []

    def find_longest_cache_hit(self, block_hashes, max_length):
        self.asked.append(max_length)
        hit = super().find_longest_cache_hit(block_hashes, max_length)
        return hit[: len(hit) // 2 * 2]


@pytest.mark.parametrize(
    ("num_cached", "max_length", "asked", "num_hit_blocks"),
    [
        # Full attention hits 3 blocks, pairs 2: both are asked again within 8 tokens.
        ((3, 3), 13, [13, 8], 2),
        # 1 block within 7 tokens; pairs round it to 0.
        ((3, 3), 7, [7, 0], 0),
        ((2, 1), 13, [13, 0], 0),
        # Full attention 1 block, pairs 2; within 4 tokens pairs have 0: three passes.
        ((1, 3), 13, [13, 4, 0], 0),
        ((4, 4), 17, [17], 4),  # they agree at once
    ],
)
def test_cache_hit_is_asked_again_until_all_groups_agree(
    monkeypatch, num_cached, max_length, asked, num_hit_blocks
):
    monkeypatch.setitem(spec_manager_map, _PairSpec, _PairManager)
    monkeypatch.setattr(_PairManager, "asked", [])
    config = make_kv_cache_config(num_blocks=20, block_size=4, num_groups=2)
    pair_spec = _PairSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float32")
    groups = (config.kv_cache_groups[0], KVCacheGroupSpec(("pair_layer",), pair_spec))
    coordinator = KVCacheCoordinator(replace(config, kv_cache_groups=groups))
    pool = coordinator.block_pool
    hashes = [b"h0", b"h1", b"h2", b"h3", b"h4"]
    for group_id, n in enumerate(num_cached):
        pool.cache_full_blocks(pool.get_new_blocks(n), hashes[:n], group_id)
    hit, num_hit_tokens = coordinator.find_longest_cache_hit(hashes, max_length)
    assert _PairManager.asked == asked
    assert num_hit_tokens == 4 * num_hit_blocks
    for group_id, blocks in enumerate(hit):
        assert blocks == [pool.get_cached_block(h, group_id) for h in hashes[:num_hit_blocks]]


# ---- random operation sequences -----------------------------------------------------------------


def _check_tables(kv: KVCacheManager, running) -> None:
    """Every group's table of every running request covers exactly its computed tokens, and
    its cached blocks hold full blocks of its own prefix, under the group's key."""
    for request in running:
        for group_id, block_ids in enumerate(kv.get_block_ids(request.request_id)):
            assert len(block_ids) == cdiv(request.num_computed_tokens, kv.block_size)
            for i, block_id in enumerate(block_ids):
                block = kv.block_pool.blocks[block_id]
                if block.block_hash is not None and block_id != 0:
                    assert (i + 1) * kv.block_size <= request.num_computed_tokens
                    assert block.block_hash == (request.block_hashes[i], group_id)


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_random_allocate_free_and_preempt_keep_the_pool_consistent(data):
    def ints(lo: int, hi: int) -> int:
        return data.draw(st.integers(lo, hi))

    block_size = (1, 2, 4)[ints(0, 2)]
    max_model_len = ints(8, 40)
    num_groups = ints(1, 2)
    blocks_per_req = cdiv(max_model_len, block_size)
    num_blocks = num_groups * (blocks_per_req + ints(0, blocks_per_req)) + 1
    windows = [ints(1, 3 * block_size) if ints(0, 1) else None for _ in range(num_groups)]
    kv = create_kv_cache_manager(
        num_blocks, block_size, max_model_len, num_groups, enable_caching=ints(0, 1) == 1, windows=windows
    )
    prefixes = [[100 + ints(0, 3) for _ in range(ints(0, 12))] for _ in range(2)]
    running, waiting = [], []
    for index in range(ints(1, 40)):
        op = ints(0, 3)
        if op == 0 or not running:  # admit a new or a preempted request
            if waiting and ints(0, 1):
                request = waiting.pop(ints(0, len(waiting) - 1))
            else:
                suffix = [200 + ints(0, 3) for _ in range(ints(1, 12))]
                prompt = (prefixes[ints(0, 1)] + suffix)[: max_model_len - 1]
                (request,) = create_requests(1, prompts=[prompt], start_index=index)
            hit, num_hit = kv.get_computed_blocks(request)
            num_new = ints(1, request.num_tokens - num_hit)
            before = _pool_snapshot(kv)
            if kv.allocate_slots(request, num_new, hit) is None:
                assert _pool_snapshot(kv) == before
                waiting.append(request)
            else:
                request.num_computed_tokens = num_hit + num_new
                running.append(request)
        elif op == 1:  # a prefill chunk, or a decode after sampling a token
            request = running[ints(0, len(running) - 1)]
            if request.num_computed_tokens == request.num_tokens:
                if request.num_tokens == max_model_len:
                    continue
                request.append_output_token_ids([300 + ints(0, 3)])
            num_new = ints(1, request.num_tokens - request.num_computed_tokens)
            # A window's blocks out of reach go back even when the allocation fails.
            for manager in kv.coordinator.single_type_managers:
                manager.remove_skipped_blocks(request.request_id, request.num_computed_tokens)
            before = _pool_snapshot(kv)
            if _grow_groups(kv, request, num_new) is None:
                assert _pool_snapshot(kv) == before
        else:  # finish (2) or preempt (3) a request
            request = running.pop(ints(0, len(running) - 1))
            kv.free(request)
            kv.free(request)  # a second free frees nothing
            request.num_computed_tokens = 0
            if op == 3:
                waiting.append(request)
        check_block_invariants(kv)
        _check_tables(kv, running)
    for request in running:
        kv.free(request)
    check_block_invariants(kv)
    assert kv.get_num_free_blocks() == num_blocks - 1 and kv.usage == 0.0
    assert all(block.ref_cnt == 0 for block in kv.block_pool.blocks[1:])
    assert kv.reset_prefix_cache() and not kv.block_pool.cached_block_hash_to_block
