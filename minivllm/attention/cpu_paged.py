"""Paged attention for CPUs through the C++ kernels in ops/csrc/ (torch.ops.minivllm_cpu).

Decode tokens, any number of them at any lengths, go to one kernel call per layer that reads
each request's K/V straight from its blocks: no gathered copy, no padding to the longest
request, one pass over K and one over V per (request, KV head), float32 accumulation. The new
K/V go into the cache by one copy per token and head. Prefill spans take the reference path
(one SDPA flash call each; a C++ prefill kernel is still to come, see docs/PERFORMANCE.md).

Same cache layout as the reference backend, so both read each other's caches and tests can
compare them on one cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from minivllm.attention.backend import CommonAttentionMetadata
from minivllm.attention.torch_ref import (
    PrefillSpan,
    TorchRefAttentionBackend,
    build_prefill_spans,
    prefill_attention,
)

SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


@dataclass
class CpuPagedMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    # Decode rows: where each query token sits in the flat batch, its block table and length.
    decode_token_indices: torch.Tensor  # [num_decodes] int64
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32
    decode_seq_lens: torch.Tensor  # [num_decodes] int32
    all_decode: bool  # every token of the step is a decode: no prefill work
    prefills: list[PrefillSpan]


class CpuPagedAttentionBackend(TorchRefAttentionBackend):
    @staticmethod
    def supports(dtype: torch.dtype, head_dim: int) -> bool:
        return dtype in SUPPORTED_DTYPES and head_dim in SUPPORTED_HEAD_DIMS

    def build_metadata(self, common: CommonAttentionMetadata) -> CpuPagedMetadata:
        query_lens = common.query_lens
        is_decode = query_lens == 1
        rows = np.flatnonzero(is_decode)
        seq_lens = common.seq_lens[rows]
        max_blocks = -(-int(seq_lens.max()) // common.block_size) if len(rows) else 0
        return CpuPagedMetadata(
            slot_mapping=common.slot_mapping,
            decode_token_indices=torch.from_numpy(common.query_start_loc[rows].astype(np.int64)),
            decode_block_tables=torch.from_numpy(
                np.ascontiguousarray(common.block_table[rows, :max_blocks], dtype=np.int32)
            ),
            decode_seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
            all_decode=len(rows) == int(common.query_start_loc[-1]),
            prefills=build_prefill_spans(common, np.flatnonzero(~is_decode & (query_lens > 0))),
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: CpuPagedMetadata,
        scale: float,
    ) -> torch.Tensor:
        md = attn_metadata
        ops = torch.ops.minivllm_cpu
        ops.reshape_and_cache(key, value, kv_cache, md.slot_mapping)
        # Rows the kernel does not write (prefill tokens) are filled by prefill_attention.
        output = torch.empty_like(query)
        ops.paged_decode_attention(
            output, query, kv_cache, md.decode_token_indices, md.decode_block_tables,
            md.decode_seq_lens, scale,
        )
        if not md.all_decode:
            prefill_attention(query, key, value, kv_cache, md.prefills, scale, output)
        return output
