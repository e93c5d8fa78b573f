"""Automatic prefix caching, hand-computed: block hashes (minivllm/core/kv_cache_utils.py),
the prefix cache of the BlockPool, KVCacheManager's hits and allocation, and the Scheduler
admitting requests at their cache hit.

Block ids are predictable: the free queue starts as [1, 2, ..., num_blocks - 1]; freed blocks
join its tail, tail block first; new blocks (and evictions) come from its head.
"""

from __future__ import annotations

import hashlib
import struct

import pytest
from core_utils import (
    FIRST_SAMPLED_TOKEN_ID,
    FakeWorker,
    cached_requests,
    check_invariants,
    create_kv_cache_manager,
    create_requests,
    create_scheduler,
    run_to_completion,
    step,
)

from minivllm.config import CacheConfig
from minivllm.core.block_pool import BlockPool
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.kv_cache_utils import (
    HASH_FUNCTIONS,
    builtin_block_hash,
    sha256_block_hash,
    update_block_hashes,
)
from minivllm.core.request import FinishReason, Request, RequestStatus
from minivllm.core.sched.scheduler import Scheduler

T0 = FIRST_SAMPLED_TOKEN_ID
HASH_FNS = [sha256_block_hash, builtin_block_hash]


def _tokens(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def _request(prompt: list[int], req_id: str = "r", **kwargs) -> Request:
    (req,) = create_requests(1, prompts=[prompt], **kwargs)
    req.request_id = req_id
    return req


def _free_ids(pool: BlockPool) -> list[int]:
    return pool.free_block_queue.block_ids()


# ---- block hashes -----------------------------------------------------------------------------


def test_sha256_block_hash_is_sha256_of_parent_tokens_and_extra_keys():
    root = hashlib.sha256(b"\x00" * 32 + struct.pack("<4q", 1, 2, 3, 4)).digest()
    assert sha256_block_hash(None, [1, 2, 3, 4], ()) == root
    child = hashlib.sha256(root + struct.pack("<4q", 5, 6, 7, 8)).digest()
    assert sha256_block_hash(root, [5, 6, 7, 8], ()) == child
    salted = hashlib.sha256(b"\x00" * 32 + struct.pack("<4q", 1, 2, 3, 4) + b"('s',)").digest()
    assert sha256_block_hash(None, [1, 2, 3, 4], ("s",)) == salted
    assert isinstance(builtin_block_hash(None, [1, 2, 3, 4], ()), int)


@pytest.mark.parametrize("fn", HASH_FNS, ids=["sha256", "builtin"])
def test_hash_depends_on_parent_tokens_and_extra_keys(fn):
    base = fn(None, [1, 2, 3, 4], ())
    assert fn(None, [1, 2, 3, 4], ()) == base  # deterministic
    assert fn(None, (1, 2, 3, 4), ()) == base  # any sequence type
    # Any token change, anywhere in the block.
    for i in range(4):
        tokens = [1, 2, 3, 4]
        tokens[i] += 1
        assert fn(None, tokens, ()) != base, i
    assert fn(None, [4, 3, 2, 1], ()) != base  # order matters
    # Parent: the same tokens after a different prefix are a different block.
    parent_a, parent_b = fn(None, [9, 9, 9, 9], ()), fn(None, [8, 8, 8, 8], ())
    child_a, child_b = fn(parent_a, [1, 2, 3, 4], ()), fn(parent_b, [1, 2, 3, 4], ())
    assert len({base, child_a, child_b}) == 3
    assert fn(parent_a, [1, 2, 3, 4], ()) == child_a
    # Extra keys (cache salt): same tokens, different KV identity.
    assert len({base, fn(None, [1, 2, 3, 4], ("a",)), fn(None, [1, 2, 3, 4], ("b",))}) == 3
    assert fn(None, [1, 2, 3, 4], ("a",)) == fn(None, [1, 2, 3, 4], ("a",))


def test_hash_functions_by_name_and_the_config_check():
    assert HASH_FUNCTIONS == {"sha256": sha256_block_hash, "builtin": builtin_block_hash}
    with pytest.raises(ValueError, match="md5"):
        CacheConfig(prefix_caching_hash_algo="md5")
    CacheConfig(prefix_caching_hash_algo="builtin")


@pytest.mark.parametrize("fn", HASH_FNS, ids=["sha256", "builtin"])
def test_update_block_hashes_chains_full_blocks_only(fn):
    prompt = _tokens(10)
    req = _request(prompt)
    hashes = update_block_hashes(req, 4, fn)
    assert hashes is req.block_hashes
    h0 = fn(None, prompt[0:4], ())
    h1 = fn(h0, prompt[4:8], ())
    assert hashes == [h0, h1]  # tokens 8, 9 are a partial block: never hashed
    # Lazy: nothing changes until a block fills up; then exactly one more hash.
    req.append_output_token_ids([500])
    assert update_block_hashes(req, 4, fn) == [h0, h1]
    req.append_output_token_ids([501])
    h2 = fn(h1, prompt[8:10] + [500, 501], ())
    assert update_block_hashes(req, 4, fn) == [h0, h1, h2]
    # The same tokens in another request give the same chain; a token change in block 1
    # changes block 1 and (through the chain) block 2, not block 0.
    other = _request(prompt[:5] + [7] + prompt[6:] + [500, 501])
    assert update_block_hashes(other, 4, fn) == [
        h0,
        fn(h0, [104, 7, 106, 107], ()),
        other.block_hashes[2],
    ]
    assert other.block_hashes[2] != h2
    # A prompt shorter than a block has no hash.
    assert update_block_hashes(_request(_tokens(3)), 4, fn) == []


@pytest.mark.parametrize("fn", HASH_FNS, ids=["sha256", "builtin"])
def test_cache_salt_goes_into_the_first_block_and_the_chain(fn):
    prompt = _tokens(8)
    plain = update_block_hashes(_request(prompt), 4, fn)
    salt_a = update_block_hashes(_request(prompt, cache_salt="a"), 4, fn)
    salt_a2 = update_block_hashes(_request(prompt, cache_salt="a"), 4, fn)
    salt_b = update_block_hashes(_request(prompt, cache_salt="b"), 4, fn)
    assert salt_a == salt_a2
    s0 = fn(None, prompt[:4], ("a",))
    assert salt_a == [s0, fn(s0, prompt[4:], ())]
    for i in range(2):  # every block differs, the second one through its parent
        assert len({plain[i], salt_a[i], salt_b[i]}) == 3, i


# ---- BlockPool --------------------------------------------------------------------------------


def test_freed_cached_block_keeps_its_hash_and_is_found_again():
    pool = BlockPool(6)
    b1, b2 = pool.get_new_blocks(2)
    pool.cache_full_blocks([b1, b2], [b"h1", b"h2"], 0)
    assert pool.get_cached_block(b"h1", 0) is b1 and pool.get_cached_block(b"h2", 0) is b2
    pool.free_blocks([b2, b1])  # tail first
    assert _free_ids(pool) == [3, 4, 5, 2, 1]
    assert (b1.ref_cnt, b1.block_hash, b2.block_hash) == (0, (b"h1", 0), (b"h2", 0))
    assert pool.get_cached_block(b"h1", 0) is b1 and pool.get_cached_block(b"h2", 0) is b2
    assert pool.get_cached_block(b"h3", 0) is None


def test_touch_takes_a_ref0_cached_block_out_of_the_free_queue():
    pool = BlockPool(6)
    b1, b2 = pool.get_new_blocks(2)
    pool.cache_full_blocks([b1, b2], [1, 2], 0)
    pool.free_blocks([b2, b1])
    pool.touch([b1])
    assert b1.ref_cnt == 1 and _free_ids(pool) == [3, 4, 5, 2]
    assert pool.get_num_free_blocks() == 4
    pool.touch([b1])  # already in use: only the count grows
    assert b1.ref_cnt == 2 and _free_ids(pool) == [3, 4, 5, 2]
    pool.free_blocks([b1])
    assert b1.ref_cnt == 1 and _free_ids(pool) == [3, 4, 5, 2]  # still in use
    pool.free_blocks([b1])
    assert b1.ref_cnt == 0 and _free_ids(pool) == [3, 4, 5, 2, 1]  # now free, hash kept
    assert pool.get_cached_block(1, 0) is b1
    with pytest.raises(RuntimeError):
        pool.free_blocks([b1])  # double free
    assert _free_ids(pool) == [3, 4, 5, 2, 1] and b1.ref_cnt == 0


def test_eviction_from_the_free_queue_head_drops_the_hash():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(4)  # 1, 2, 3, 4
    pool.cache_full_blocks(blocks, ["a", "b", "c", "d"], 0)
    pool.free_blocks([blocks[2], blocks[0], blocks[3], blocks[1]])
    assert _free_ids(pool) == [3, 1, 4, 2]
    (evicted,) = pool.get_new_blocks(1)
    assert evicted.block_id == 3 and evicted.block_hash is None and evicted.ref_cnt == 1
    assert pool.get_cached_block("c", 0) is None
    assert set(pool.cached_block_hash_to_block) == {("a", 0), ("b", 0), ("d", 0)}
    e1, e2 = pool.get_new_blocks(2)
    assert (e1.block_id, e2.block_id) == (1, 4)
    assert pool.get_cached_block("a", 0) is None and pool.get_cached_block("d", 0) is None
    assert pool.get_cached_block("b", 0) is blocks[1] and _free_ids(pool) == [2]
    # An evicted block is a plain new block: it can be cached again under another hash.
    pool.cache_full_blocks([evicted], ["z"], 0)
    assert pool.get_cached_block("z", 0) is evicted
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    assert _free_ids(pool) == [2] and pool.get_cached_block("b", 0) is blocks[1]


def test_a_block_is_never_both_free_and_in_use():
    pool = BlockPool(4)
    b1, b2, b3 = pool.get_new_blocks(3)
    pool.cache_full_blocks([b1], ["x"], 0)
    pool.free_blocks([b1])
    pool.touch([b1])
    pool.touch([b1])
    pool.free_blocks([b3, b1])
    for block in pool.blocks[1:]:
        in_queue = block.block_id in _free_ids(pool)
        assert in_queue == (block.ref_cnt == 0), block
    assert _free_ids(pool) == [3] and b1.ref_cnt == 1 and b2.ref_cnt == 1


def test_reset_prefix_cache_is_refused_while_blocks_are_in_use():
    pool = BlockPool(4)
    b1, b2 = pool.get_new_blocks(2)
    pool.cache_full_blocks([b1, b2], ["a", "b"], 0)
    pool.free_blocks([b1])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block("a", 0) is b1 and b2.block_hash == ("b", 0)
    pool.free_blocks([b2])
    assert pool.reset_prefix_cache() is True
    assert pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in pool.blocks)
    assert _free_ids(pool) == [2, 1, 3]  # emptied blocks first, the never-used one after


def test_cache_full_blocks_keeps_the_existing_entry_for_a_duplicate_hash():
    pool = BlockPool(5)
    b1, b2 = pool.get_new_blocks(2)
    pool.cache_full_blocks([b1], ["h"], 0)
    pool.cache_full_blocks([b2], ["h"], 0)  # same prefix computed twice
    assert pool.get_cached_block("h", 0) is b1
    assert b1.block_hash == ("h", 0) and b2.block_hash is None
    # A block that is already cached keeps its hash.
    pool.cache_full_blocks([b1], ["other"], 0)
    assert b1.block_hash == ("h", 0) and pool.get_cached_block("other", 0) is None
    # Evicting the uncached duplicate leaves the entry alone.
    pool.free_blocks([b2, b1])
    pool.get_new_blocks(3)  # 3, 4, then 2 (uncached)
    assert pool.get_cached_block("h", 0) is b1 and _free_ids(pool) == [1]


# ---- KVCacheManager ---------------------------------------------------------------------------


def _manager(
    num_blocks: int = 21, block_size: int = 16, hash_algo: str = "sha256", num_groups: int = 1
) -> KVCacheManager:
    return create_kv_cache_manager(
        num_blocks, block_size, num_groups=num_groups, enable_caching=True, hash_algo=hash_algo
    )


def _admit_groups(kv: KVCacheManager, request: Request, num_new_tokens: int | None = None):
    """What Scheduler._schedule_waiting does: look up the cache, allocate, advance. Returns
    the hit's block ids per group, its length in tokens, and the new block ids per group."""
    hit_blocks, num_hit = kv.get_computed_blocks(request)
    if num_new_tokens is None:
        num_new_tokens = request.num_tokens - num_hit
    new = kv.allocate_slots(request, num_new_tokens, hit_blocks)
    assert new is not None
    kv.record_admission(request, num_hit)
    request.num_computed_tokens = num_hit + num_new_tokens
    return tuple([b.block_id for b in blocks] for blocks in hit_blocks.blocks), num_hit, new


def _admit(kv: KVCacheManager, request: Request, num_new_tokens: int | None = None):
    """_admit_groups for a manager of one KV cache group: that group's ids."""
    (hit_ids,), num_hit, (new_ids,) = _admit_groups(kv, request, num_new_tokens)
    return hit_ids, num_hit, new_ids


def _hit_ids(kv: KVCacheManager, request: Request) -> tuple[list[int], int]:
    """get_computed_blocks of a manager of one KV cache group: the hit's ids, its tokens."""
    hit_blocks, num_hit = kv.get_computed_blocks(request)
    (blocks,) = hit_blocks.blocks
    return [b.block_id for b in blocks], num_hit


def _refs(kv: KVCacheManager, ids) -> list[int]:
    return [kv.block_pool.blocks[i].ref_cnt for i in ids]


@pytest.mark.parametrize("hash_algo", ["sha256", "builtin"])
def test_second_request_shares_a_five_block_prefix(hash_algo):
    kv = _manager(hash_algo=hash_algo)
    prefix = _tokens(80)
    a = _request(prefix + _tokens(10, 500), "a")
    b = _request(prefix + _tokens(7, 600), "b")
    assert _admit(kv, a) == ([], 0, [1, 2, 3, 4, 5, 6])
    assert [kv.block_pool.blocks[i].block_hash is not None for i in range(1, 7)] == [True] * 5 + [
        False
    ]
    hit_ids, num_hit, new = _admit(kv, b)
    assert (hit_ids, num_hit, new) == ([1, 2, 3, 4, 5], 80, [7])
    assert kv.get_block_ids("b") == ([1, 2, 3, 4, 5, 7],)
    assert _refs(kv, range(1, 8)) == [2, 2, 2, 2, 2, 1, 1]
    # A third request diverging inside block 2 (token 40) shares blocks 0 and 1 only.
    c_prompt = prefix + _tokens(10, 500)
    c_prompt[40] = 7
    c = _request(c_prompt, "c")
    assert _admit(kv, c) == ([1, 2], 32, [8, 9, 10, 11])
    assert _refs(kv, range(1, 12)) == [3, 3, 2, 2, 2, 1, 1, 1, 1, 1, 1]
    assert kv.get_num_free_blocks() == 20 - 11


def test_fully_cached_prompt_still_computes_its_last_token():
    kv = _manager()
    prompt = _tokens(64)  # exactly 4 blocks
    _admit(kv, _request(prompt, "a"))
    assert len(kv.block_pool.cached_block_hash_to_block) == 4
    b = _request(prompt, "b")
    blocks, num_hit = kv.get_computed_blocks(b)
    assert _hit_ids(kv, b) == ([1, 2, 3], 48)  # (64 - 1) // 16 blocks
    assert kv.allocate_slots(b, 16, blocks) == ([5],)
    # One token more than 4 blocks: all 4 full blocks are a hit.
    kv2 = _manager()
    _admit(kv2, _request(prompt + [7], "a"))
    assert kv2.get_computed_blocks(_request(prompt + [7], "b"))[1] == 64
    # A one-block prompt never hits.
    kv3 = _manager()
    _admit(kv3, _request(_tokens(16), "a"))
    assert _hit_ids(kv3, _request(_tokens(16), "b")) == ([], 0)


def test_the_last_partial_block_is_never_shared():
    kv = _manager(block_size=4)
    prompt = _tokens(10)  # blocks 1, 2 full; block 3 holds 2 tokens
    a = _request(prompt, "a")
    _admit(kv, a)
    assert kv.block_pool.blocks[3].block_hash is None
    b = _request(prompt + [8, 8], "b")  # 12 tokens: its third block is full
    assert _admit(kv, b) == ([1, 2], 8, [4])
    assert kv.get_block_ids("b") == ([1, 2, 4],) and _refs(kv, [3, 4]) == [1, 1]
    assert kv.block_pool.blocks[4].block_hash == (b.block_hashes[2], 0)
    # a decodes two tokens: block 3 becomes full (computed) only in the second step.
    a.append_output_token_ids([9])
    assert kv.allocate_slots(a, 1) == ([],)
    a.num_computed_tokens += 1
    assert kv.block_pool.blocks[3].block_hash is None
    a.append_output_token_ids([9])
    assert kv.allocate_slots(a, 1) == ([],)
    a.num_computed_tokens += 1
    assert kv.block_pool.blocks[3].block_hash == (a.block_hashes[2], 0) != (b.block_hashes[2], 0)
    c = _request(prompt + [9, 9, 1], "c")
    assert _hit_ids(kv, c) == ([1, 2, 3], 12)
    check_hash_map(kv)


def test_same_content_cached_twice_keeps_the_first_block():
    kv = _manager(block_size=4)
    a = _request(_tokens(9), "a")
    b = _request(_tokens(9), "b")
    _admit(kv, a, 3)  # a has not computed block 0 yet
    assert _admit(kv, b) == ([], 0, [2, 3, 4])  # so b cannot hit; b caches blocks 2, 3
    cache = kv.block_pool.cached_block_hash_to_block
    assert {h: blk.block_id for h, blk in cache.items()} == {
        (b.block_hashes[0], 0): 2,
        (b.block_hashes[1], 0): 3,
    }
    assert kv.allocate_slots(a, 6) == ([5, 6],)  # a computes the same blocks in its own 1, 5
    a.num_computed_tokens += 6
    assert {h: blk.block_id for h, blk in cache.items()} == {
        (b.block_hashes[0], 0): 2,
        (b.block_hashes[1], 0): 3,
    }
    assert kv.block_pool.blocks[1].block_hash is None and kv.block_pool.blocks[5].block_hash is None
    check_hash_map(kv)


def test_prompt_logprobs_requests_get_no_hit():
    kv = _manager()
    prompt = _tokens(40)
    _admit(kv, _request(prompt, "a"))
    b = _request(prompt, "b", prompt_logprobs=0)
    assert _hit_ids(kv, b) == ([], 0)
    assert _admit(kv, b) == ([], 0, [4, 5, 6])
    # Its own full blocks are not entered again (a holds those hashes).
    assert {blk.block_id for blk in kv.block_pool.cached_block_hash_to_block.values()} == {1, 2}
    assert _hit_ids(kv, _request(prompt, "c", prompt_logprobs=3)) == ([], 0)
    assert kv.get_computed_blocks(_request(prompt, "d"))[1] == 32


def test_caching_disabled_never_hits_nor_caches():
    kv = create_kv_cache_manager(num_blocks=11, block_size=4, max_model_len=64)
    prompt = _tokens(12)
    _admit(kv, _request(prompt, "a"))
    assert _hit_ids(kv, _request(prompt, "b")) == ([], 0)
    assert kv.block_pool.cached_block_hash_to_block == {}
    kv.record_admission(_request(prompt, "b"), 0)
    assert kv.prefix_cache_stats.requests == 0


def test_ref_counts_equal_the_number_of_holders():
    kv = _manager(block_size=4)
    prefix = _tokens(8)
    reqs = [_request(prefix + [600 + i] * 3, str(i)) for i in range(3)]
    for r in reqs:
        _admit(kv, r)
    assert [kv.get_block_ids(r.request_id) for r in reqs] == [
        ([1, 2, 3],),
        ([1, 2, 4],),
        ([1, 2, 5],),
    ]
    assert _refs(kv, [1, 2, 3, 4, 5]) == [3, 3, 1, 1, 1]
    kv.free(reqs[1])
    assert _refs(kv, [1, 2, 4]) == [2, 2, 0]
    assert 1 not in _free_ids(kv.block_pool) and 2 not in _free_ids(kv.block_pool)
    kv.free(reqs[0])
    assert _refs(kv, [1, 2]) == [1, 1]
    kv.free(reqs[2])
    assert _refs(kv, [1, 2, 3, 4, 5]) == [0] * 5
    # The partial last blocks (uncached) went to the head as they were freed; the shared,
    # cached blocks joined the tail when their last holder (reqs[2]) freed them.
    assert _free_ids(kv.block_pool) == [5, 3, 4, *range(6, 21), 2, 1]


def test_eviction_takes_the_tail_of_a_freed_request_first():
    kv = _manager(num_blocks=9, block_size=4)  # 8 usable blocks
    prompt = _tokens(17)
    a = _request(prompt, "a")
    _admit(kv, a)  # blocks 1..5, 1..4 full and cached
    h = list(a.block_hashes)
    assert len(h) == 4
    kv.free(a)
    assert _free_ids(kv.block_pool) == [5, 6, 7, 8, 4, 3, 2, 1]
    # Pressure: x takes a's partial (uncached) block and the never-used blocks, y two of a's
    # cached ones.
    _admit(kv, _request(_tokens(16, 700), "x"))
    assert kv.get_block_ids("x") == ([5, 6, 7, 8],)
    assert all(kv.block_pool.get_cached_block(x, 0) is not None for x in h)
    _admit(kv, _request(_tokens(8, 800), "y"))
    assert kv.get_block_ids("y") == ([4, 3],)
    pool = kv.block_pool
    assert [pool.get_cached_block(x, 0) for x in h] == [pool.blocks[1], pool.blocks[2], None, None]
    # y's own two full blocks are cached now; a's head survives and is still a hit.
    a2 = _request(prompt, "a2")
    assert kv.get_computed_blocks(a2)[1] == 8
    check_hash_map(kv)


def test_allocation_counts_evictable_hit_blocks_and_touches_nothing_on_failure():
    kv = _manager(num_blocks=5, block_size=4)  # 4 usable blocks
    prompt = _tokens(9)
    a = _request(prompt, "a")
    _admit(kv, a)  # blocks 1, 2 (cached), 3
    kv.free(a)
    assert _free_ids(kv.block_pool) == [3, 4, 2, 1]
    b = _request(prompt[:8] + _tokens(12, 900), "b")  # 20 tokens: hit 2 blocks, 3 new
    hit, num_hit = kv.get_computed_blocks(b)
    assert _hit_ids(kv, b) == ([1, 2], 8)
    # 3 new blocks + 2 hit blocks that sit in the free queue = 5 > 4 free blocks.
    before = (
        _free_ids(kv.block_pool),
        _refs(kv, range(5)),
        dict(kv.block_pool.cached_block_hash_to_block),
    )
    assert kv.allocate_slots(b, 12, hit) is None
    after = (
        _free_ids(kv.block_pool),
        _refs(kv, range(5)),
        dict(kv.block_pool.cached_block_hash_to_block),
    )
    assert before == after
    assert kv.get_block_ids("b") == ([],)
    # 2 new + 2 hit = 4: fits, and takes exactly the two blocks that are not hits.
    assert kv.allocate_slots(b, 8, hit) == ([3, 4],)
    assert kv.get_block_ids("b") == ([1, 2, 3, 4],) and kv.get_num_free_blocks() == 0


def test_prefix_cache_stats_count_tokens():
    kv = _manager()
    prefix = _tokens(80)
    _admit(kv, _request(prefix + _tokens(10, 500), "a"))
    _admit(kv, _request(prefix + _tokens(7, 600), "b"))
    _admit(kv, _request(_tokens(20, 700), "c"))
    stats = kv.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (3, 90 + 87 + 20, 80)


def test_prompt_logprobs_requests_are_not_counted_as_lookups():
    """BUG (minivllm/core/kv_cache_manager.py, record_admission): a request that wants prompt
    logprobs skips the prefix cache lookup (get_computed_blocks returns ([], 0) without
    looking), yet it is counted as a lookup of all its tokens, which dilutes the reported hit
    rate (PrefixCacheStats: "prompt tokens looked up"). vLLM V1 records prefix cache stats
    only after its skip_reading_prefix_cache early return."""
    scheduler = create_scheduler(num_blocks=21, block_size=16, enable_prefix_caching=True)
    worker = FakeWorker()
    prompt = _tokens(40)
    (a,) = create_requests(1, prompts=[prompt])
    (b,) = create_requests(1, prompts=[prompt], prompt_logprobs=1, start_index=1)
    _add(scheduler, [a])
    step(scheduler, worker)
    _add(scheduler, [b])
    step(scheduler, worker)
    stats = scheduler.make_stats()
    # Only a was looked up: 40 tokens, no hit.
    assert (stats.prefix_cache_requests, stats.prefix_cache_queries, stats.prefix_cache_hits) == (
        1,
        40,
        0,
    )
    run_to_completion(scheduler, worker=worker)


def test_reset_prefix_cache_through_the_manager():
    kv = _manager(block_size=4)
    a = _request(_tokens(9), "a")
    _admit(kv, a)
    assert kv.reset_prefix_cache() is False
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert _hit_ids(kv, _request(_tokens(9), "b")) == ([], 0)


def check_hash_map(kv: KVCacheManager) -> None:
    cache = kv.block_pool.cached_block_hash_to_block
    assert all(block.block_hash == h for h, block in cache.items())
    assert sum(b.block_hash is not None for b in kv.block_pool.blocks) == len(cache)


# ---- several KV cache groups --------------------------------------------------------------------


def test_two_groups_cache_and_hit_their_own_blocks():
    kv = _manager(block_size=4, num_groups=2)
    prompt = _tokens(9)
    a = _request(prompt, "a")
    assert _admit_groups(kv, a) == (([], []), 0, ([1, 2, 3], [4, 5, 6]))
    h = a.block_hashes
    # The same content is a different block in each group: one cache entry per group.
    cache = kv.block_pool.cached_block_hash_to_block
    assert {key: block.block_id for key, block in cache.items()} == {
        (h[0], 0): 1,
        (h[1], 0): 2,
        (h[0], 1): 4,
        (h[1], 1): 5,
    }
    b = _request(prompt[:8] + [7, 7, 7], "b")
    assert _admit_groups(kv, b) == (([1, 2], [4, 5]), 8, ([7], [8]))
    assert _refs(kv, range(1, 9)) == [2, 2, 1, 2, 2, 1, 1, 1]
    kv.free(a)
    kv.free(b)
    assert kv.get_num_free_blocks() == 20 and _refs(kv, range(1, 21)) == [0] * 20
    check_hash_map(kv)


def test_two_groups_hit_only_the_prefix_both_have_cached():
    kv = _manager(num_blocks=13, block_size=4, num_groups=2)  # 12 usable blocks
    pool = kv.block_pool
    prompt = _tokens(9)
    a = _request(prompt, "a")
    _admit_groups(kv, a)  # ([1, 2, 3], [4, 5, 6]); 1, 2 and 4, 5 are full and cached
    kv.free(a)
    assert _free_ids(pool) == [6, 3, 7, 8, 9, 10, 11, 12, 2, 1, 5, 4]
    taken = pool.get_new_blocks(9)  # up to block 2: evicts group 0's second block
    assert taken[-1] is pool.blocks[2]
    b = _request(prompt, "b")
    hit, num_hit = kv.get_computed_blocks(b)
    # Group 0 has only its first block, group 1 both: the hit is what both groups have.
    assert [[block.block_id for block in blocks] for blocks in hit.blocks] == [[1], [4]]
    assert num_hit == 4
    pool.free_blocks(taken)  # uncached: to the head, one after the other
    assert _free_ids(pool) == [2, 12, 11, 10, 9, 8, 7, 3, 6, 1, 5, 4]
    assert kv.allocate_slots(b, 5, hit) == ([2, 12], [11, 10])
    # b caches its second block again in group 0; group 1 still has it (block 5), so b's
    # copy there stays uncached.
    assert pool.get_cached_block(b.block_hashes[1], 0) is pool.blocks[2]
    assert pool.get_cached_block(b.block_hashes[1], 1) is pool.blocks[5]
    assert pool.blocks[11].block_hash is None
    check_hash_map(kv)


# ---- Scheduler --------------------------------------------------------------------------------


def _add(scheduler: Scheduler, requests) -> None:
    for request in requests:
        scheduler.add_request(request)


def test_prefix_caching_is_on_by_default_in_cache_config():
    assert CacheConfig().enable_prefix_caching is True
    assert create_scheduler().kv_cache_manager.enable_caching is False  # the tests' default


def test_second_request_is_admitted_at_its_cache_hit():
    scheduler = create_scheduler(num_blocks=21, block_size=16, enable_prefix_caching=True)
    worker = FakeWorker()
    prefix = _tokens(48)
    a, b = create_requests(
        2, prompts=[prefix + _tokens(10, 500), prefix + _tokens(5, 600)], max_tokens=3
    )
    _add(scheduler, [a])
    so, outs = step(scheduler, worker)
    (new_a,) = so.scheduled_new_reqs
    assert new_a.block_ids == ([1, 2, 3, 4],) and new_a.num_computed_tokens == 0
    assert outs[0].num_cached_tokens == 0

    _add(scheduler, [b])
    so, outs = step(scheduler, worker)
    (new_b,) = so.scheduled_new_reqs
    assert new_b.num_computed_tokens == 48
    assert new_b.block_ids[0][:3] == new_a.block_ids[0][:3] and new_b.block_ids == ([1, 2, 3, 5],)
    assert so.num_scheduled_tokens == {"0": 1, "1": 53 - 48}
    assert b.num_cached_tokens == 48
    assert {o.request_id: o.num_cached_tokens for o in outs} == {"0": 0, "1": 48}
    pool = scheduler.kv_cache_manager.block_pool
    assert [pool.blocks[i].ref_cnt for i in (1, 2, 3, 4, 5)] == [2, 2, 2, 1, 1]
    stats = scheduler.make_stats()
    assert (stats.prefix_cache_requests, stats.prefix_cache_queries, stats.prefix_cache_hits) == (
        2,
        58 + 53,
        48,
    )
    assert stats.num_computed_tokens == 58 + 1 + 5

    result = run_to_completion(scheduler, worker=worker)
    assert a.output_token_ids == b.output_token_ids == [T0, T0 + 1, T0 + 2]
    assert result.outputs == {"0": [T0 + 2], "1": [T0 + 1, T0 + 2]}
    # Everything is free, but the content stays cached for later requests.
    kv = scheduler.kv_cache_manager
    assert kv.get_num_free_blocks() == kv.block_pool.num_blocks - 1
    # Only the 3 shared blocks are full: a computed 58 + 2 tokens, b 53 + 2.
    assert len(pool.cached_block_hash_to_block) == 3
    assert scheduler.reset_prefix_cache() is True
    assert pool.cached_block_hash_to_block == {}


def test_identical_prompts_admitted_in_the_same_step_share_blocks():
    """The second request hits the blocks the first one computes in the same step (their KV
    is written before attention reads it); the fake worker checks the content."""
    scheduler = create_scheduler(num_blocks=21, block_size=16, enable_prefix_caching=True)
    worker = FakeWorker()
    prompt = _tokens(40)
    a, b = create_requests(2, prompts=[prompt, prompt], max_tokens=2)
    _add(scheduler, [a, b])
    so, _ = step(scheduler, worker)
    assert [(r.req_id, r.block_ids, r.num_computed_tokens) for r in so.scheduled_new_reqs] == [
        ("0", ([1, 2, 3],), 0),
        ("1", ([1, 2, 4],), 32),
    ]
    assert so.num_scheduled_tokens == {"0": 40, "1": 8}
    run_to_completion(scheduler, worker=worker)


def test_preempted_request_resumes_from_its_cached_blocks():
    # 5 usable blocks of 4 tokens (as test_request_preempts_itself_when_it_is_the_last_one).
    scheduler = create_scheduler(
        num_blocks=6, block_size=4, max_model_len=20, enable_prefix_caching=True
    )
    worker = FakeWorker()
    a, b = create_requests(2, prompt_len=8, max_tokens=[4, 3])
    _add(scheduler, [a, b])

    so, _ = step(scheduler, worker)  # a [1, 2], b [3, 4]: all full, all cached
    pool = scheduler.kv_cache_manager.block_pool
    assert len(pool.cached_block_hash_to_block) == 4
    so, _ = step(scheduler, worker)  # a takes block 5; b needs one too: b preempts itself
    assert so.preempted_req_ids == {"1"} and b.status == RequestStatus.PREEMPTED
    assert pool.free_block_queue.block_ids() == [4, 3]
    assert pool.get_cached_block(b.block_hashes[0], 0) is pool.blocks[3]

    for _ in range(2):  # b: 2 hit blocks (in the free queue) + 1 new > 2 free blocks
        so, _ = step(scheduler, worker)
        assert so.num_scheduled_tokens == {"0": 1}
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert pool.free_block_queue.block_ids() == [5, 4, 3, 2, 1]  # a's last block is partial

    so, outs = step(scheduler, worker)
    assert cached_requests(so) == {"1": (True, ([3, 4, 5],), 8)}  # resumed at its cache hit
    assert so.num_scheduled_tokens == {"1": 1}  # only its first output token is recomputed
    assert [o.new_token_ids for o in outs] == [[T0 + 1]]
    assert b.num_cached_tokens == 0  # counted at first admission only
    stats = scheduler.make_stats()
    assert (stats.prefix_cache_requests, stats.prefix_cache_queries, stats.prefix_cache_hits) == (
        3,
        8 + 8 + 9,
        8,
    )
    run_to_completion(scheduler, worker=worker)
    assert b.output_token_ids == [T0, T0 + 1, T0 + 2]


def test_two_groups_preempt_resume_at_the_cache_hit_and_free_everything():
    """The scenario above with two KV cache groups over twice the blocks: every step allocates,
    caches, frees and hits in both groups, and the fake worker checks both groups' KV."""
    scheduler = create_scheduler(
        num_blocks=11,
        block_size=4,
        max_model_len=20,
        enable_prefix_caching=True,
        num_kv_cache_groups=2,
    )
    worker = FakeWorker()
    a, b = create_requests(2, prompt_len=8, max_tokens=[4, 3])
    _add(scheduler, [a, b])
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool

    so, _ = step(scheduler, worker)
    assert [(r.req_id, r.block_ids) for r in so.scheduled_new_reqs] == [
        ("0", ([1, 2], [3, 4])),
        ("1", ([5, 6], [7, 8])),
    ]
    assert len(pool.cached_block_hash_to_block) == 8  # 2 full blocks x 2 requests x 2 groups
    so, _ = step(scheduler, worker)  # a takes blocks 9 and 10; b needs 2 too: b preempts itself
    assert so.preempted_req_ids == {"1"} and cached_requests(so) == {"0": (False, ([9], [10]), 8)}
    assert pool.free_block_queue.block_ids() == [6, 5, 8, 7]  # cached: to the tail, in order
    assert kv.get_block_ids("1") == ([], [])

    for _ in range(2):  # b: 2 hit blocks + 1 new in each group = 6 > 4 free blocks
        so, _ = step(scheduler, worker)
        assert so.num_scheduled_tokens == {"0": 1}
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED
    # a's partial last blocks went to the head, its cached ones to the tail; group 0 first.
    assert pool.free_block_queue.block_ids() == [10, 9, 6, 5, 8, 7, 2, 1, 4, 3]

    so, outs = step(scheduler, worker)
    assert cached_requests(so) == {"1": (True, ([5, 6, 10], [7, 8, 9]), 8)}  # resumed at its hit
    assert so.num_scheduled_tokens == {"1": 1}
    assert [o.new_token_ids for o in outs] == [[T0 + 1]]
    stats = scheduler.make_stats()
    assert (stats.prefix_cache_requests, stats.prefix_cache_queries, stats.prefix_cache_hits) == (
        3,
        8 + 8 + 9,
        8,
    )
    run_to_completion(scheduler, worker=worker)  # ends with every block free in both groups
    assert b.output_token_ids == [T0, T0 + 1, T0 + 2]


def test_preempted_request_whose_blocks_were_evicted_restarts_from_zero():
    scheduler = create_scheduler(
        num_blocks=6, block_size=4, max_model_len=20, enable_prefix_caching=True
    )
    worker = FakeWorker()
    a, b = create_requests(2, prompt_len=8, max_tokens=[4, 3])
    (c,) = create_requests(1, prompt_len=4, max_tokens=1, start_index=2)
    _add(scheduler, [a, b])
    step(scheduler, worker)
    so, _ = step(scheduler, worker)
    assert so.preempted_req_ids == {"1"}
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.free_block_queue.block_ids() == [4, 3]
    # Abort b while it waits, then c evicts block 4 (b's second block).
    scheduler.finish_requests(["1"], RequestStatus.FINISHED_ABORTED)
    _add(scheduler, [c])
    so, _ = step(scheduler, worker)
    assert [(r.req_id, r.block_ids, r.num_computed_tokens) for r in so.scheduled_new_reqs] == [
        ("2", ([4],), 0)
    ]
    assert pool.get_cached_block(b.block_hashes[1], 0) is None
    assert pool.get_cached_block(b.block_hashes[0], 0) is pool.blocks[3]
    # Same prompt as b: only its first block is still a hit.
    (b2,) = create_requests(1, prompts=[b.prompt_token_ids], id_prefix="b2-")
    _add(scheduler, [b2])
    run_to_completion(scheduler, worker=worker)
    assert b2.num_cached_tokens == 4


def test_abort_of_a_request_sharing_blocks_keeps_them_alive():
    scheduler = create_scheduler(num_blocks=21, block_size=16, enable_prefix_caching=True)
    worker = FakeWorker()
    prefix = _tokens(48)
    a, b, c = create_requests(
        3, prompts=[prefix + _tokens(4, 500), prefix + _tokens(6, 600), prefix + [7]], max_tokens=6
    )
    _add(scheduler, [a])
    step(scheduler, worker)
    _add(scheduler, [b, c])
    so, _ = step(scheduler, worker)
    assert [(r.req_id, r.block_ids, r.num_computed_tokens) for r in so.scheduled_new_reqs] == [
        ("1", ([1, 2, 3, 5],), 48),
        ("2", ([1, 2, 3, 6],), 48),
    ]
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    assert [pool.blocks[i].ref_cnt for i in range(1, 7)] == [3, 3, 3, 1, 1, 1]
    # Abort the request that computed the shared blocks: the others keep them.
    scheduler.finish_requests(["0"], RequestStatus.FINISHED_ABORTED)
    check_invariants(scheduler)
    assert [pool.blocks[i].ref_cnt for i in range(1, 7)] == [2, 2, 2, 0, 1, 1]
    assert pool.free_block_queue.block_ids()[0] == 4  # its partial block, uncached: at the head
    assert not {1, 2, 3} & set(pool.free_block_queue.block_ids())
    scheduler.finish_requests(["1"], RequestStatus.FINISHED_ABORTED)
    assert [pool.blocks[i].ref_cnt for i in range(1, 7)] == [1, 1, 1, 0, 0, 1]
    so, _ = step(scheduler, worker)  # c reads the shared blocks: the fake worker checks the KV
    assert so.finished_req_ids == {"0", "1"} and so.num_scheduled_tokens == {"2": 1}
    result = run_to_completion(scheduler, worker=worker)
    assert c.output_token_ids == [T0 + i for i in range(6)]
    assert result.finish_reasons == {"2": FinishReason.LENGTH}
    assert kv.get_num_free_blocks() == pool.num_blocks - 1
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:])
    assert {pool.get_cached_block(h, 0).block_id for h in c.block_hashes[:3]} == {1, 2, 3}


def test_cache_salt_separates_identical_prompts():
    scheduler = create_scheduler(num_blocks=21, block_size=16, enable_prefix_caching=True)
    worker = FakeWorker()
    prompt = _tokens(40)
    (a,) = create_requests(1, prompts=[prompt], cache_salt="alice")
    (b,) = create_requests(1, prompts=[prompt], cache_salt="bob", start_index=1)
    (c,) = create_requests(1, prompts=[prompt], cache_salt="alice", start_index=2)
    (d,) = create_requests(1, prompts=[prompt], start_index=3)
    for r in (a, b, c, d):
        _add(scheduler, [r])
        step(scheduler, worker)
    assert [r.num_cached_tokens for r in (a, b, c, d)] == [0, 0, 32, 0]
    run_to_completion(scheduler, worker=worker)


def test_prompt_logprobs_request_computes_its_whole_prompt_but_shares_its_blocks():
    scheduler = create_scheduler(num_blocks=21, block_size=16, enable_prefix_caching=True)
    worker = FakeWorker()
    prompt = _tokens(40)
    (a,) = create_requests(1, prompts=[prompt], prompt_logprobs=2)
    (b,) = create_requests(1, prompts=[prompt], start_index=1)
    (c,) = create_requests(1, prompts=[prompt], prompt_logprobs=0, start_index=2)
    _add(scheduler, [a])
    so, _ = step(scheduler, worker)
    assert so.num_scheduled_tokens == {"0": 40}
    _add(scheduler, [b])
    so, _ = step(scheduler, worker)  # b reads the blocks a computed
    assert so.scheduled_new_reqs[0].num_computed_tokens == 32
    assert so.num_scheduled_tokens == {"0": 1, "1": 8}
    _add(scheduler, [c])
    so, _ = step(scheduler, worker)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0
    assert so.num_scheduled_tokens["2"] == 40
    run_to_completion(scheduler, worker=worker)
    assert (a.num_cached_tokens, b.num_cached_tokens, c.num_cached_tokens) == (0, 32, 0)


def test_no_chunked_prefill_budget_counts_only_uncached_tokens():
    # Budget 64 = max_model_len; a (60 tokens) runs first; b (60 tokens, 48 cached) then
    # needs only 12 tokens of budget: it runs next to a's decode, which 60 tokens would not.
    scheduler = create_scheduler(
        num_blocks=9,
        block_size=16,
        max_num_batched_tokens=64,
        max_model_len=64,
        enable_chunked_prefill=False,
        enable_prefix_caching=True,
    )
    worker = FakeWorker()
    prefix = _tokens(48)
    a, b = create_requests(
        2, prompts=[prefix + _tokens(12, 500), prefix + _tokens(12, 600)], max_tokens=4
    )
    _add(scheduler, [a, b])
    so, _ = step(scheduler, worker)
    # b hits a's 3 blocks (cached at allocation), but its other 12 tokens exceed the 4 left.
    assert so.num_scheduled_tokens == {"0": 60}
    so, _ = step(scheduler, worker)
    assert so.num_scheduled_tokens == {"0": 1, "1": 12}
    run_to_completion(scheduler, worker=worker)
