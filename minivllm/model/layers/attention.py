"""The attention layer as the model sees it: q/k/v in, context out; paging is the backend's job.

Each layer states how it uses the KV cache (get_kv_cache_spec: full attention, or a sliding
window), owns a view of its cache and knows its KV cache group (both bound by the model runner
once the cache is allocated), and calls the backend with its group's metadata for the step and
its own window. With no metadata (the worker's memory-profiling run) it is plain causal
attention over the whole batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.attention.backend import AttentionBackend
from minivllm.core.kv_cache_interface import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec


class Attention(nn.Module):
    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, backend: AttentionBackend,
        sliding_window: int | None = None, scale: float | None = None,
    ) -> None:
        """scale: of the scores, head_dim ** -0.5 unless the model says otherwise (Gemma's
        query_pre_attn_scalar)."""
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.backend = backend
        # Shaped by the backend's get_kv_cache_shape; bound by ModelRunner.initialize_kv_cache.
        self.kv_cache = torch.empty(0)
        self.kv_cache_group_id = 0

    def get_kv_cache_spec(self, block_size: int, dtype: str) -> KVCacheSpec:
        if self.sliding_window is not None:
            return SlidingWindowSpec(block_size, self.num_kv_heads, self.head_dim, dtype, self.sliding_window)
        return FullAttentionSpec(block_size, self.num_kv_heads, self.head_dim, dtype)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_metadata: tuple[Any, ...] | None
    ) -> torch.Tensor:
        """q [T, heads * head_dim], k and v [T, kv_heads * head_dim] -> [T, heads * head_dim].
        attn_metadata: one backend metadata per KV cache group."""
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if attn_metadata is None:
            # NOTE: only for the memory profile, whose peak the window does not change.
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                is_causal=True, scale=self.scale, enable_gqa=True,
            ).transpose(0, 1)
        else:
            out = self.backend.forward(q, k, v, self.kv_cache, attn_metadata[self.kv_cache_group_id], self.scale,
                                       self.sliding_window)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)
