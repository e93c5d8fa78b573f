"""The Triton attention backend (vLLM's TritonAttentionBackend): the cache write and one kernel
for every step, decodes and prefill chunks alike (attention/triton_kernels.py).

The host's share per step is nothing beyond the model runner's device arrays (block table,
sequence lengths, query offsets, slot mapping): the kernel sizes its grid from shapes and finds
each program's request itself, so a step needs no host sync and a CUDA graph can replay any
step of a recorded shape (graph_support). Runs on CUDA; on the CPU only under the Triton interpreter
(TRITON_INTERPRET=1), which is how CI checks it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from minivllm.attention.backend import (
    AttentionBackend,
    CommonAttentionMetadata,
    GraphSupport,
    head_major_kv_cache_shape,
)

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass
class TritonMetadata:
    slot_mapping: torch.Tensor  # [tokens] int64
    block_table: torch.Tensor  # [reqs, max_blocks] int32
    seq_lens: torch.Tensor  # [reqs] int32
    query_start_loc: torch.Tensor  # [reqs + 1] int32


class TritonAttentionBackend(AttentionBackend):
    name = "TRITON_ATTN"
    graph_support = GraphSupport.UNIFORM_SINGLE_TOKEN_DECODE
    supports_sliding_window = True
    get_kv_cache_shape = staticmethod(head_major_kv_cache_shape)

    @classmethod
    def unsupported_reason(cls, device_type: str, dtype: torch.dtype, head_size: int) -> str | None:
        if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            return f"runs on CUDA (or under TRITON_INTERPRET=1), not {device_type}"
        if dtype not in SUPPORTED_DTYPES:
            return f"no Triton attention in {dtype}"
        if head_size > 256:
            return f"head size {head_size} is over 256"
        try:
            import triton  # noqa: F401
        except ImportError:
            return "triton is not installed"
        return None

    def build_metadata(self, common: CommonAttentionMetadata) -> TritonMetadata:
        return TritonMetadata(common.slot_mapping, common.block_table_gpu, common.seq_lens_gpu,
                              common.query_start_loc_gpu)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: TritonMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        from minivllm.attention.triton_kernels import reshape_and_cache, unified_attention

        md = attn_metadata
        reshape_and_cache(key, value, kv_cache, md.slot_mapping)
        output = torch.empty_like(query)
        unified_attention(output, query, kv_cache, md.block_table, md.seq_lens, md.query_start_loc, scale,
                          sliding_window)
        return output
