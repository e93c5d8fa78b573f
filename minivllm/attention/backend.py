"""The attention backend interface: per-step metadata on the CPU side, paged attention on the device.

The model runner describes one step with a CommonAttentionMetadata per KV cache group (numpy
views of the persistent batch: where each request's queries start, how long each sequence is,
the group's block table and slot mapping). A backend turns that into its own metadata once per
step and group (shared by the group's layers), and each attention layer calls `forward` with its
queries, new keys/values and its KV cache. A backend also says what it supports, so the runner
asks instead of inspecting its metadata. Which backend runs is attention/selector.py's choice.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch


@dataclass
class CommonAttentionMetadata:
    """Backend-independent description of one step for one KV cache group (row i = i-th request
    in the batch). Rows past the batch's requests, if any, are padding (a step padded to a
    recorded size): no query tokens, sequence length 0.

    Each array is also on the device, for backends whose kernels read it there: the model runner
    passes views of its persistent buffers (filled in pinned memory, copied without a sync; on
    CPU the same memory), whose addresses a CUDA graph keeps from one replay to the next."""

    query_start_loc: np.ndarray  # [num_reqs + 1] int32, cumulative query lengths
    seq_lens: np.ndarray  # [num_reqs] int32, computed + scheduled tokens
    block_table: np.ndarray  # [num_reqs, max_num_blocks_per_req] int32, padded with the null block
    slot_mapping: torch.Tensor  # [num_tokens] int64 on device, where each new K/V goes (-1: nowhere)
    block_size: int
    device: torch.device
    query_start_loc_gpu: torch.Tensor
    seq_lens_gpu: torch.Tensor
    block_table_gpu: torch.Tensor

    @classmethod
    def from_arrays(cls, query_start_loc: np.ndarray, seq_lens: np.ndarray, block_table: np.ndarray,
                    slot_mapping: torch.Tensor, block_size: int, device: torch.device) -> CommonAttentionMetadata:
        """Metadata whose device arrays are fresh copies (a drafter's or a test's step, not the
        model runner's persistent buffers)."""

        def on_device(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int32)).to(device)

        return cls(query_start_loc, seq_lens, block_table, slot_mapping, block_size, device,
                   on_device(query_start_loc), on_device(seq_lens), on_device(block_table))

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    @property
    def query_lens(self) -> np.ndarray:
        return np.diff(self.query_start_loc)

    @property
    def num_computed_tokens(self) -> np.ndarray:
        """Tokens already in the KV cache, per request."""
        return self.seq_lens - self.query_lens


class GraphSupport(enum.IntEnum):
    """Which steps a forward recorded once (a CPU step trace, a CUDA graph) may replay with
    this backend: its metadata of such steps must be tensors whose shapes are all the replay
    varies (vLLM's AttentionCGSupport)."""

    NEVER = 0
    UNIFORM_SINGLE_TOKEN_DECODE = 1  # every request has exactly one query token
    ALWAYS = 2  # any step, prompts and decodes mixed: the forward takes the same calls for all


def head_major_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """The paged layout both CPU-capable backends share, per layer:
    [2 (K, V), num_kv_heads, num_blocks, block_size, head_dim]. Gathering a request's blocks
    along dim 2 yields, per KV head, its keys as one contiguous [seq_len, head_dim] matrix."""
    return (2, num_kv_heads, num_blocks, block_size, head_dim)


class AttentionBackend(ABC):
    """One implementation of paged attention (reference torch, CPU kernels, Triton, flash...)."""

    name: ClassVar[str]
    """Its name in attention/selector.py's registry."""
    graph_support: ClassVar[GraphSupport] = GraphSupport.NEVER
    supports_sliding_window: ClassVar[bool] = False

    @classmethod
    def unsupported_reason(cls, device_type: str, dtype: torch.dtype, head_size: int) -> str | None:
        """Why this backend cannot run layers of this shape here (None when it can)."""
        return None

    @staticmethod
    @abstractmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """Shape of one layer's KV cache; the layout is the backend's choice."""

    @abstractmethod
    def build_metadata(self, common: CommonAttentionMetadata) -> Any:
        """CPU-side work done once per step and KV cache group, shared by the group's layers."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # get_kv_cache_shape(...)
        attn_metadata: Any,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write the new K/V into the cache by slot mapping, then attend through block tables;
        with a sliding window W, a query at position p attends to keys p - W + 1 .. p only.

        NOTE: the window is the layer's, not the step's: with the hybrid KV cache manager off, a
        sliding-window layer shares a KV cache group (and its metadata) with full ones."""
