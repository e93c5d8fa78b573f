"""Sizing the KV cache: get_kv_cache_config (minivllm/core/kv_cache_utils.py), hand-computed.

Page sizes are written out as 2 (K and V) * block_size * num_kv_heads * head_size * dtype bytes.
"""

from __future__ import annotations

import pytest

from minivllm.config import CacheConfig, SchedulerConfig
from minivllm.core.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)
from minivllm.core.kv_cache_utils import get_kv_cache_config
from minivllm.core.sched.scheduler import Scheduler

GiB = 1 << 30


def _spec(
    num_kv_heads: int = 2, head_size: int = 64, dtype: str = "bfloat16", block_size: int = 16
) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype
    )


def _config(
    kv_cache_spec,
    available_memory: int,
    *,
    block_size: int = 16,
    max_model_len: int = 64,
    max_num_seqs: int = 256,
    num_gpu_blocks_override: int | None = None,
    max_num_batched_tokens: int = 8192,
    disable_hybrid_kv_cache_manager: bool = False,
):
    return get_kv_cache_config(
        CacheConfig(block_size=block_size, num_gpu_blocks_override=num_gpu_blocks_override,
                    disable_hybrid_kv_cache_manager=disable_hybrid_kv_cache_manager),
        SchedulerConfig(max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=max_num_batched_tokens),
        kv_cache_spec,
        available_memory,
    )


def test_bytes_per_block_sum_the_pages_of_layers_of_different_shapes():
    small = _spec(num_kv_heads=2, head_size=64, dtype="bfloat16")
    large = _spec(num_kv_heads=4, head_size=32, dtype="float32")
    assert small.page_size_bytes == 2 * 16 * 2 * 64 * 2 == 8192
    assert large.page_size_bytes == 2 * 16 * 4 * 32 * 4 == 16384
    specs = {"layers.0": small, "layers.1": large, "layers.2": small}
    bytes_per_block = 8192 + 16384 + 8192
    config = _config(specs, 11 * bytes_per_block - 1)
    assert config.num_blocks == 10  # layer 0's page times 3 layers would give 14
    assert config.kv_cache_tensors == (
        KVCacheTensor(size=10 * 8192, shared_by=("layers.0",)),
        KVCacheTensor(size=10 * 16384, shared_by=("layers.1",)),
        KVCacheTensor(size=10 * 8192, shared_by=("layers.2",)),
    )
    # Same kind and block size: one group, the layers in layer order, the first layer's spec.
    (group,) = config.kv_cache_groups
    assert group.layer_names == ("layers.0", "layers.1", "layers.2")
    assert group.kv_cache_spec == small
    assert config.block_size == 16


def test_num_blocks_is_capped_at_what_max_num_seqs_requests_can_use():
    spec = _spec()
    # max_model_len 100 in 16-token blocks: 7 blocks per request; 3 requests + the null block.
    config = _config({"layer": spec}, GiB, max_model_len=100, max_num_seqs=3)
    assert config.num_blocks == 3 * 7 + 1
    assert config.kv_cache_tensors[0].size == 22 * 8192
    # Below the cap, the memory decides.
    assert _config({"layer": spec}, 20 * 8192, max_model_len=100, max_num_seqs=3).num_blocks == 20


def test_override_sets_the_number_of_blocks_exactly():
    spec = _spec()
    assert _config({"layer": spec}, 0, num_gpu_blocks_override=7).num_blocks == 7
    assert _config({"layer": spec}, GiB, num_gpu_blocks_override=7).num_blocks == 7
    # Not capped: a forced size is what the user asked for (cap here: 1 * 4 + 1 = 5).
    config = _config({"layer": spec}, GiB, max_num_seqs=1, num_gpu_blocks_override=9)
    assert config.num_blocks == 9 and config.kv_cache_tensors[0].size == 9 * 8192


@pytest.mark.parametrize(
    ("num_blocks", "max_model_len", "fits"),
    [
        (4, 64, False),  # 64 tokens need 4 blocks; 4 blocks leave 3 usable
        (2, 17, False),
        (5, 64, True),  # exactly enough
        (2, 16, True),
    ],
)
def test_cache_too_small_for_one_request_raises(num_blocks, max_model_len, fits):
    spec = _spec()
    for memory, override in ((num_blocks * 8192, None), (GiB, num_blocks)):
        kwargs = dict(max_model_len=max_model_len, num_gpu_blocks_override=override)
        if fits:
            assert _config({"layer": spec}, memory, **kwargs).num_blocks == num_blocks
        else:
            with pytest.raises(ValueError, match=f"max_model_len={max_model_len} "):
                _config({"layer": spec}, memory, **kwargs)


def test_no_memory_at_all_raises_the_same_error():
    with pytest.raises(ValueError, match="cannot hold one request"):
        _config({"layer": _spec()}, 8191)


def _window(sliding_window: int = 128, **kwargs) -> SlidingWindowSpec:
    base = _spec(**kwargs)
    return SlidingWindowSpec(base.block_size, base.num_kv_heads, base.head_size, base.dtype, sliding_window)


def test_sliding_and_full_layers_share_tensors_group_by_group():
    """Gemma-like: windows on layers 0, 1, 3, 4, full attention on 2 and 5. Groups of 2 layers
    (the fewer kind has 2); tensor j holds the j-th layer of every group, so a block costs two
    pages, not six."""
    window, full = _window(), _spec()
    specs = {f"l{i}": full if i in (2, 5) else window for i in range(6)}
    config = _config(specs, 101 * 2 * 8192)
    assert config.num_blocks == 101
    assert config.kv_cache_groups == (
        KVCacheGroupSpec(("l0", "l1"), window),
        KVCacheGroupSpec(("l3", "l4"), window),
        KVCacheGroupSpec(("l2", "l5"), full),
    )
    assert config.kv_cache_tensors == (
        KVCacheTensor(size=101 * 8192, shared_by=("l0", "l3", "l2")),
        KVCacheTensor(size=101 * 8192, shared_by=("l1", "l4", "l5")),
    )


def test_a_kind_with_more_layers_than_a_multiple_gets_a_smaller_last_group():
    window, full = _window(), _spec()
    specs = {**{f"s{i}": window for i in range(5)}, "f0": full, "f1": full}
    config = _config(specs, GiB, num_gpu_blocks_override=17)  # 4 groups x 4 blocks + null
    assert [g.layer_names for g in config.kv_cache_groups] == [("s0", "s1"), ("s2", "s3"), ("s4",), ("f0", "f1")]
    assert [t.shared_by for t in config.kv_cache_tensors] == [("s0", "s2", "s4", "f0"), ("s1", "s3", "f1")]


def test_blocks_per_request_count_each_group_by_its_kind():
    """max_model_len 1024 in blocks of 16: full attention 64 blocks; a window of 32 with steps of
    at most 16 tokens holds the step and the 31 tokens before it (47 tokens: 3 blocks) plus one
    for a window that starts mid-block: 4. The cap is max_num_seqs requests of 64 + 4."""
    assert _window(32).max_num_blocks_per_request(1024, 16) == 4
    assert _window(32).max_num_blocks_per_request(40, 16) == 3  # never more than the whole request
    specs = {"s": _window(32), "f": _spec()}
    config = _config(specs, GiB, max_model_len=1024, max_num_seqs=3, max_num_batched_tokens=16)
    assert config.num_blocks == 3 * (64 + 4) + 1
    with pytest.raises(ValueError, match=r"cannot hold one request .*\(68 blocks\)"):
        _config(specs, GiB, max_model_len=1024, num_gpu_blocks_override=68, max_num_batched_tokens=16)


def test_hybrid_layers_of_different_page_sizes_are_refused():
    specs = {"layers.0": _window(), "layers.1": _spec(num_kv_heads=4), "layers.2": _window()}
    with pytest.raises(ValueError, match="one page size for all layers, but layers layers.0 .* and "
                                         "layers.1 .*--disable-hybrid-kv-cache-manager"):
        _config(specs, GiB)


def test_disabling_the_hybrid_manager_makes_windows_full_attention():
    """One group that keeps every block, a tensor per layer: the layout before hybrid groups."""
    specs = {"l0": _window(), "l1": _spec(num_kv_heads=4), "l2": _window()}
    config = _config(specs, GiB, num_gpu_blocks_override=9, disable_hybrid_kv_cache_manager=True)
    (group,) = config.kv_cache_groups
    assert group.layer_names == ("l0", "l1", "l2") and group.kv_cache_spec == _spec()
    assert [t.shared_by for t in config.kv_cache_tensors] == [("l0",), ("l1",), ("l2",)]


def test_layers_of_other_block_sizes_are_refused():
    specs = {"layers.0": _spec(), "layers.1": _spec(block_size=32)}
    with pytest.raises(ValueError, match="one page size"):
        _config(specs, GiB)


def test_scheduler_is_built_from_the_config():
    cache_config = CacheConfig(block_size=16, enable_prefix_caching=True)
    scheduler_config = SchedulerConfig(max_model_len=64, max_num_seqs=2)
    kv_cache_config = get_kv_cache_config(
        cache_config, scheduler_config, {"a": _spec(), "b": _spec()}, 7 * 2 * 8192
    )
    scheduler = Scheduler(scheduler_config, cache_config, kv_cache_config)
    kv = scheduler.kv_cache_manager
    assert kv.block_pool.num_blocks == 7 and kv.get_num_free_blocks() == 6
    assert len(kv.coordinator.single_type_managers) == 1 and kv.enable_caching
