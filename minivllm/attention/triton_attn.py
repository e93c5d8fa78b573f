"""The Triton attention backend (vLLM's TritonAttentionBackend): the cache write and one kernel
for every step, decodes and prefill chunks alike (attention/triton_kernels.py).

The host's share per step and KV cache group is small: the block table, sequence lengths and
query offsets as device tensors, and which (request, first query) each program of the kernel
serves, BLOCK_M queries at a time. Runs on CUDA; on the CPU only under the Triton interpreter
(TRITON_INTERPRET=1), which is how CI checks it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from minivllm.attention.backend import (
    AttentionBackend,
    CommonAttentionMetadata,
    head_major_kv_cache_shape,
)
from minivllm.utils import cdiv

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass
class TritonMetadata:
    slot_mapping: torch.Tensor  # [tokens] int64
    block_table: torch.Tensor  # [reqs, max_blocks] int32
    seq_lens: torch.Tensor  # [reqs] int32
    query_start_loc: torch.Tensor  # [reqs + 1] int32
    program_req: torch.Tensor  # [programs] int32
    program_first: torch.Tensor  # [programs] int32


class TritonAttentionBackend(AttentionBackend):
    name = "TRITON_ATTN"
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
        from minivllm.attention.triton_kernels import BLOCK_M

        query_lens = common.query_lens
        programs = [cdiv(int(n), BLOCK_M) for n in query_lens]
        program_req = np.repeat(np.arange(len(query_lens), dtype=np.int32), programs)
        starts = np.cumsum([0, *programs[:-1]])
        program_first = ((np.arange(len(program_req)) - np.repeat(starts, programs)) * BLOCK_M).astype(np.int32)
        device = common.device

        def on_device(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int32)).to(device)

        return TritonMetadata(
            slot_mapping=common.slot_mapping,
            block_table=on_device(common.block_table),
            seq_lens=on_device(common.seq_lens),
            query_start_loc=on_device(common.query_start_loc),
            program_req=on_device(program_req),
            program_first=on_device(program_first),
        )

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
        unified_attention(output, query, kv_cache, md.block_table, md.seq_lens, md.query_start_loc,
                          md.program_req, md.program_first, scale, sliding_window)
        return output
