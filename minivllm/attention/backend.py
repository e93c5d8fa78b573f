"""The attention backend interface: per-step metadata on the CPU side, paged attention on the device.

The model runner describes one step with CommonAttentionMetadata (numpy views of the persistent
batch: where each request's queries start, how long each sequence is, its block table). A
backend turns that into its own metadata once per step (shared by every layer), and each
attention layer calls `forward` with its queries, new keys/values and its slice of the KV cache.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from minivllm import envs
from minivllm.logger import init_logger

logger = init_logger(__name__)


@dataclass
class CommonAttentionMetadata:
    """Backend-independent description of one step (row i = i-th request in the batch)."""

    query_start_loc: np.ndarray  # [num_reqs + 1] int32, cumulative query lengths
    seq_lens: np.ndarray  # [num_reqs] int32, computed + scheduled tokens
    num_computed_tokens: np.ndarray  # [num_reqs] int32, tokens already in the KV cache
    block_table: np.ndarray  # [num_reqs, max_num_blocks_per_req] int32, padded with the null block
    slot_mapping: torch.Tensor  # [num_tokens] int64 on device, where each new K/V goes
    block_size: int
    device: torch.device

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    @property
    def query_lens(self) -> np.ndarray:
        return np.diff(self.query_start_loc)


class AttentionBackend(ABC):
    """One implementation of paged attention (reference torch, Triton, flash...)."""

    @abstractmethod
    def get_kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        """Shape of one layer's KV cache; the layout is the backend's choice."""

    @abstractmethod
    def build_metadata(self, common: CommonAttentionMetadata) -> Any:
        """CPU-side work done once per step and shared by all layers."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # get_kv_cache_shape(...)
        attn_metadata: Any,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write the new K/V into the cache by slot mapping, then attend through block tables."""


def get_attn_backend(device: torch.device, dtype: torch.dtype, head_dim: int) -> AttentionBackend:
    """Select the backend at start-up: on CPU the C++ paged kernels when they are built and
    support the model, else the torch reference (MINIVLLM_ATTENTION_BACKEND forces one)."""
    from minivllm.attention.torch_ref import TorchRefAttentionBackend

    choice = envs.attention_backend()
    if choice not in ("AUTO", "TORCH_REF", "CPU_PAGED"):
        raise ValueError(f"MINIVLLM_ATTENTION_BACKEND={choice!r}: expected TORCH_REF or CPU_PAGED")
    if device.type == "cpu" and choice in ("AUTO", "CPU_PAGED"):
        from minivllm.attention.cpu_paged import CpuPagedAttentionBackend
        from minivllm.ops import cpu_kernels

        if not CpuPagedAttentionBackend.supports(dtype, head_dim):
            reason = f"{dtype} with head_dim {head_dim} is not supported by the CPU kernels"
        elif not envs.cpu_kernels():
            reason = "MINIVLLM_CPU_KERNELS=0"
        elif not cpu_kernels.load():
            reason = "the CPU kernels are not built (`python -m minivllm.ops.cpu_kernels`, ~30 s)"
        else:
            return CpuPagedAttentionBackend()
        if choice == "CPU_PAGED":
            raise RuntimeError(f"attention backend CPU_PAGED unavailable: {reason}")
        logger.info("Attention backend TORCH_REF: %s.", reason)
    return TorchRefAttentionBackend()
