"""KV cache helpers of the engine core: block hashes for prefix caching, and the sizing of the
cache at start-up (get_kv_cache_config).

A full block is identified by everything that shaped its KV. Its hash chains its parent block's
hash, its own token ids, and extra keys that change the KV without changing the tokens (a
per-request cache salt; later LoRA ids or multimodal inputs). Two requests share a block only
if their hashes agree, which, through the chain, means the whole prefix up to and including that
block is identical. Only full blocks are hashed, once per request for all KV cache groups; the
prefix cache adds the group id to the key.

get_kv_cache_config turns the workers' per-layer specs and memory budget into the KVCacheConfig
that the scheduler's KV manager and the workers' cache tensors are both built from.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from minivllm.core.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)

if TYPE_CHECKING:
    from minivllm.config import CacheConfig, SchedulerConfig
    from minivllm.core.kv_cache_interface import KVCacheSpec
    from minivllm.core.request import Request

BlockHash = bytes | int
# The prefix cache's key: the same content is a different block in each KV cache group.
BlockHashWithGroupId = tuple[BlockHash, int]
HashFn = Callable[[BlockHash | None, Sequence[int], tuple[Any, ...]], BlockHash]


def sha256_block_hash(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple[Any, ...]) -> bytes:
    """Collision-resistant: SHA-256 over a canonical byte encoding (the default)."""
    h = hashlib.sha256()
    h.update(parent if isinstance(parent, bytes) else b"\x00" * 32)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def builtin_block_hash(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple[Any, ...]) -> int:
    """Fast but only 64 bits and not collision-resistant: Python's tuple hash."""
    return hash((parent, tuple(token_ids), extra_keys))


# NOTE: CacheConfig.prefix_caching_hash_algo is checked against these names, once.
HASH_FUNCTIONS: dict[str, HashFn] = {"sha256": sha256_block_hash, "builtin": builtin_block_hash}


def update_block_hashes(request: Request, block_size: int, hash_fn: HashFn) -> list[BlockHash]:
    """Extend `request.block_hashes` to cover every full block of its known tokens."""
    hashes = request.block_hashes
    tokens = request.all_token_ids
    for i in range(len(hashes), len(tokens) // block_size):
        parent = hashes[-1] if hashes else None
        # NOTE: the salt goes into the first block only; the chain carries it to the rest.
        extra = (request.cache_salt,) if i == 0 and request.cache_salt is not None else ()
        hashes.append(hash_fn(parent, tokens[i * block_size : (i + 1) * block_size], extra))
    return hashes


# ---- sizing the KV cache ------------------------------------------------------------------------


def get_kv_cache_config(
    cache_config: CacheConfig,
    scheduler_config: SchedulerConfig,
    kv_cache_spec: dict[str, KVCacheSpec],
    available_memory: int,
) -> KVCacheConfig:
    """The KV cache of one worker: its layers' specs (layer name -> spec, in layer order) and
    the bytes it may use for the cache give the groups, the number of blocks and the tensors.

    Raises ValueError when layers of several kinds have pages of different sizes, or when the
    cache cannot hold one request of max_model_len tokens.
    """
    return get_kv_cache_configs(cache_config, scheduler_config, [kv_cache_spec], available_memory)[0]


def get_kv_cache_configs(
    cache_config: CacheConfig,
    scheduler_config: SchedulerConfig,
    kv_cache_specs: list[dict[str, KVCacheSpec]],
    available_memory: int,
) -> list[KVCacheConfig]:
    """One KVCacheConfig per worker (get_kv_cache_config), all with the same number of blocks: a
    block id names one block on every worker, and tensor-parallel ranks may hold different numbers
    of KV heads (3 heads on 2 ranks), so the rank with the largest pages sets the count."""
    if cache_config.disable_hybrid_kv_cache_manager:
        kv_cache_specs = [{name: _as_full_attention(spec) for name, spec in specs.items()}
                          for specs in kv_cache_specs]
    layouts = [_plan_layout(specs) for specs in kv_cache_specs]
    num_blocks = min(
        _get_num_blocks(
            cache_config, scheduler_config, available_memory // layout.bytes_per_block,
            sum(group.kv_cache_spec.max_num_blocks_per_request(
                scheduler_config.max_model_len, scheduler_config.max_num_batched_tokens)
                for group in layout.groups),
        )
        for layout in layouts
    )
    return [
        KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=tuple(KVCacheTensor(num_blocks * page, layers) for layers, page in layout.tensors),
            kv_cache_groups=layout.groups,
        )
        for layout in layouts
    ]


def _as_full_attention(spec: KVCacheSpec) -> KVCacheSpec:
    """A sliding-window layer's spec as full attention (the window then only masks attention)."""
    if not isinstance(spec, SlidingWindowSpec):
        return spec
    return FullAttentionSpec(spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype)


class _Layout(NamedTuple):
    """One worker's groups and tensors, before the number of blocks is known."""

    groups: tuple[KVCacheGroupSpec, ...]
    tensors: tuple[tuple[tuple[str, ...], int], ...]  # (layers sharing it, bytes per block)

    @property
    def bytes_per_block(self) -> int:
        return sum(page for _, page in self.tensors)


def _plan_layout(kv_cache_spec: dict[str, KVCacheSpec]) -> _Layout:
    """Group the layers and lay out their tensors.

    Layers of one kind (one group_key) form one group, and each has its own tensor: a block id
    names one block in every layer. Layers of several kinds (sliding-window and full attention:
    Gemma 3, Qwen2 with max_window_layers) need one block table per kind, since a sliding window
    frees blocks that full attention keeps. As in vLLM, every group then gets the same number of
    layers (the fewest any kind has; a kind's last group may have fewer), and tensor j holds the
    j-th layer of every group: a block belongs to one group at a time, so the groups share the
    memory, and a block costs the pages of one group's layers instead of all layers'. That needs
    pages of one size.
    """
    layers_by_key: dict[tuple[object, ...], list[str]] = {}
    for layer_name, spec in kv_cache_spec.items():
        layers_by_key.setdefault(spec.group_key, []).append(layer_name)
    if len(layers_by_key) == 1:
        (layer_names,) = layers_by_key.values()
        group = KVCacheGroupSpec(tuple(layer_names), kv_cache_spec[layer_names[0]])
        return _Layout((group,), tuple(((name,), kv_cache_spec[name].page_size_bytes) for name in layer_names))
    first, *others = kv_cache_spec
    page = kv_cache_spec[first].page_size_bytes
    other = next((name for name in others if kv_cache_spec[name].page_size_bytes != page), None)
    if other is not None:
        raise ValueError(
            f"The hybrid KV cache manager needs one page size for all layers, but layers {first} "
            f"({kv_cache_spec[first]}) and {other} ({kv_cache_spec[other]}) differ (a draft model "
            "of another shape beside a sliding-window model?). Pass "
            "--disable-hybrid-kv-cache-manager to keep every layer's blocks as full attention does."
        )
    group_size = min(len(names) for names in layers_by_key.values())
    groups = tuple(
        KVCacheGroupSpec(tuple(names[i : i + group_size]), kv_cache_spec[names[i]])
        for names in layers_by_key.values()
        for i in range(0, len(names), group_size)
    )
    tensors = tuple(
        (tuple(group.layer_names[j] for group in groups if j < len(group.layer_names)), page)
        for j in range(group_size)
    )
    return _Layout(groups, tensors)


def _get_num_blocks(
    cache_config: CacheConfig, scheduler_config: SchedulerConfig, num_blocks_in_memory: int,
    blocks_per_request: int,
) -> int:
    """The blocks the budget holds, capped at what can ever be used; or exactly the override.
    `blocks_per_request`: the most one request holds, summed over the groups."""
    block_size = cache_config.block_size
    if cache_config.num_gpu_blocks_override is not None:
        num_blocks = cache_config.num_gpu_blocks_override
    else:
        # More blocks than max_num_seqs full-length requests can use would only waste memory.
        max_useful = scheduler_config.max_num_seqs * blocks_per_request + 1
        num_blocks = min(num_blocks_in_memory, max_useful)
    if blocks_per_request > num_blocks - 1:
        # NOTE: this guarantees progress: one request alone always fits, so preemption
        # can always make room for the oldest running request.
        raise ValueError(
            f"The KV cache ({num_blocks - 1} usable blocks of {block_size} "
            f"tokens) cannot hold one request of max_model_len={scheduler_config.max_model_len} "
            f"tokens ({blocks_per_request} blocks). Increase the KV cache size or decrease "
            "max_model_len."
        )
    return num_blocks
