"""Paged attention for CPUs through the C++ kernels in ops/csrc/ (torch.ops.minivllm_cpu).

Every token reads its request's K/V straight from the cache blocks: no gathered copy in torch,
no padding to the longest request, float32 accumulation. Decode tokens, any number of them at
any lengths, go to one kernel call per layer (paged_attention.cpp); prefill tokens, whether a
whole prompt, a later chunk or the rest of a prompt after a prefix-cache hit, to one more
(paged_prefill_attention.cpp), which applies the causal mask by position. A sliding-window layer
passes its window, and both kernels then read only the keys inside it. The new K/V go into
the cache first, by one copy per token and head.

Same cache layout as the reference backend (backend.py: head_major_kv_cache_shape), so both read
each other's caches and tests can compare them on one cache. Every step's metadata is tensors of
one fixed structure and both kernels run every step (one with no rows returns at once), so a
recorded forward can replay any step (worker/step_traces.py: GraphSupport.ALWAYS).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from minivllm import envs
from minivllm.attention.backend import (
    AttentionBackend,
    CommonAttentionMetadata,
    GraphSupport,
    head_major_kv_cache_shape,
)
from minivllm.ops import cpu_kernels
from minivllm.utils import cdiv

SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


@dataclass
class PagedRows:
    """The requests of one kernel call: where their query tokens start in the flat batch, how
    many there are, their sequence lengths (cached + new) and their block tables."""

    token_starts: torch.Tensor  # [n] int64
    query_lens: torch.Tensor  # [n] int32
    seq_lens: torch.Tensor  # [n] int32
    block_tables: torch.Tensor  # [n, max_blocks] int32

    @classmethod
    def select(cls, common: CommonAttentionMetadata, query_lens: np.ndarray, rows: np.ndarray) -> PagedRows:
        seq_lens = common.seq_lens[rows]
        max_blocks = cdiv(int(seq_lens.max()), common.block_size) if len(rows) else 0
        return cls(
            torch.from_numpy(common.query_start_loc[rows].astype(np.int64)),
            torch.from_numpy(query_lens[rows].astype(np.int32)),
            torch.from_numpy(seq_lens.astype(np.int32)),
            torch.from_numpy(np.ascontiguousarray(common.block_table[rows, :max_blocks], dtype=np.int32)),
        )

    def __len__(self) -> int:
        return len(self.token_starts)


@dataclass
class CpuPagedMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    decodes: PagedRows  # requests with one query token
    prefills: PagedRows  # requests with more


class CpuPagedAttentionBackend(AttentionBackend):
    name = "CPU_PAGED"
    graph_support = GraphSupport.ALWAYS
    supports_sliding_window = True
    get_kv_cache_shape = staticmethod(head_major_kv_cache_shape)

    @classmethod
    def unsupported_reason(cls, device_type: str, dtype: torch.dtype, head_size: int) -> str | None:
        if device_type != "cpu":
            return f"runs on CPU only, not {device_type}"
        if dtype not in SUPPORTED_DTYPES or head_size not in SUPPORTED_HEAD_DIMS:
            return f"the CPU kernels do not support {dtype} with head size {head_size}"
        if not envs.cpu_kernels():
            return "MINIVLLM_CPU_KERNELS=0"
        if not cpu_kernels.load():
            return "the CPU kernels are not built (`python -m minivllm.ops.cpu_kernels`, ~30 s)"
        return None

    def build_metadata(self, common: CommonAttentionMetadata) -> CpuPagedMetadata:
        query_lens = common.query_lens
        return CpuPagedMetadata(
            slot_mapping=common.slot_mapping,
            decodes=PagedRows.select(common, query_lens, np.flatnonzero(query_lens == 1)),
            prefills=PagedRows.select(common, query_lens, np.flatnonzero(query_lens > 1)),
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: CpuPagedMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        md = attn_metadata
        ops = torch.ops.minivllm_cpu
        ops.reshape_and_cache(key, value, kv_cache, md.slot_mapping)
        output = torch.empty_like(query)  # every row is written by one of the two calls
        # NOTE: both calls, whatever the step holds: a trace records the calls of the step it
        # was recorded on and replays them for every step of its kind.
        d, p = md.decodes, md.prefills
        ops.paged_decode_attention(
            output, query, kv_cache, d.token_starts, d.block_tables, d.seq_lens, scale, sliding_window or 0
        )
        ops.paged_prefill_attention(
            output, query, kv_cache, p.token_starts, p.query_lens, p.seq_lens, p.block_tables, scale,
            sliding_window or 0,
        )
        return output
