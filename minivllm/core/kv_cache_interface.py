"""What the KV cache is made of, as plain data (vLLM V1's kv_cache_interface).

Each attention layer states how it uses the cache (a KVCacheSpec: full attention, or a sliding
window of a given size). Layers with the same spec form a KV cache group: one block table per
group and request, allocated by the scheduler's KV manager from one shared BlockPool. The
KVCacheConfig says how many blocks there are, which layers form each group, and which tensors
back them. The engine core computes it (core/kv_cache_utils.py: get_kv_cache_config) from the
workers' specs and memory; the scheduler reads its groups, the workers allocate its tensors.

Torch-free: dtypes are named by string, with their sizes here.
"""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.utils import cdiv

DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class KVCacheSpec:
    """How one layer uses the KV cache."""

    block_size: int
    """Tokens per block."""

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block of this layer takes."""
        raise NotImplementedError

    @property
    def group_key(self) -> tuple[object, ...]:
        """Layers whose specs share this key need the same blocks for the same tokens, whatever
        their head counts, so they share one block table: one KV cache group."""
        return (type(self).__name__, self.block_size)

    def max_num_blocks_per_request(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """The most blocks one request can hold in this layer's group at any time."""
        return cdiv(max_model_len, self.block_size)


@dataclass(frozen=True)
class AttentionSpec(KVCacheSpec):
    """A layer that caches one key and one value vector per token and KV head."""

    num_kv_heads: int
    head_size: int
    dtype: str
    """The cache's dtype by name: a key of DTYPE_SIZES."""

    @property
    def page_size_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_size * DTYPE_SIZES[self.dtype]


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    """Every token attends to all earlier ones: a request keeps blocks for all its tokens.

    A sliding-window layer has this spec too when the hybrid KV cache manager is off
    (CacheConfig.disable_hybrid_kv_cache_manager): its window then only masks attention, and the
    request keeps every block, as a full-attention layer's."""


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    """A token attends to itself and the `sliding_window - 1` tokens before it (HF's and vLLM's
    convention: key position > query position - sliding_window). Blocks wholly before the window
    of a request's next token are never read again, so the KV manager frees them."""

    sliding_window: int

    @property
    def group_key(self) -> tuple[object, ...]:
        return (*super().group_key, self.sliding_window)

    def max_num_blocks_per_request(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """A step's new tokens (up to max_num_batched_tokens) and the window before the first of
        them, plus one block for a window that does not start at a block boundary."""
        num_tokens = min(self.sliding_window - 1 + max_num_batched_tokens, max_model_len)
        return min(cdiv(num_tokens, self.block_size) + 1, cdiv(max_model_len, self.block_size))


@dataclass(frozen=True)
class KVCacheTensor:
    """One allocation of `size` bytes, the cache of the layers in `shared_by` (one layer per
    group: groups never hold the same block id at the same time, so they can share memory)."""

    size: int
    shared_by: tuple[str, ...]


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share one block table per request (their specs have one group_key)."""

    layer_names: tuple[str, ...]
    kv_cache_spec: KVCacheSpec
    """The first layer's spec: what the group's layers share (kind, block size) is read here;
    each layer's own shape stays with the worker."""


@dataclass(frozen=True)
class KVCacheConfig:
    """The KV cache of one worker: blocks in the pool, the tensors, the groups."""

    num_blocks: int
    """Blocks in the shared pool, block 0 (the null block) included."""
    kv_cache_tensors: tuple[KVCacheTensor, ...]
    kv_cache_groups: tuple[KVCacheGroupSpec, ...]

    @property
    def block_size(self) -> int:
        """Tokens per block; every group has the engine's block_size."""
        return self.kv_cache_groups[0].kv_cache_spec.block_size
