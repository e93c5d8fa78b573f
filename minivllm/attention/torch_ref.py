"""Reference paged attention in plain torch: runs on CPU and CUDA, and is what faster backends
are checked against.

Decode requests (one query token) are batched into a single scaled_dot_product_attention call
over K/V gathered through their block tables, padded to the longest sequence and masked.
Prefill requests run one SDPA call each: a fresh prompt attends to its own new K/V with a causal
mask; a later chunk gathers its earlier K/V from the cache and uses a bottom-right causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from minivllm.attention.backend import AttentionBackend, CommonAttentionMetadata


@dataclass
class PrefillSpan:
    start: int  # first query token in the flat batch
    end: int
    context_len: int  # tokens of this request already in the cache before this step
    # Only for context_len > 0: the request's blocks and the [q_len, seq_len] causal mask.
    block_ids: torch.Tensor | None = None
    attn_mask: torch.Tensor | None = None
    seq_len: int = 0


@dataclass
class TorchRefMetadata:
    slot_mapping: torch.Tensor  # [num_tokens]
    decode_token_indices: torch.Tensor | None  # [num_decodes]
    decode_block_table: torch.Tensor | None  # [num_decodes, max_blocks]
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size], True = padding
    prefills: list[PrefillSpan]


class TorchRefAttentionBackend(AttentionBackend):
    def build_metadata(self, common: CommonAttentionMetadata) -> TorchRefMetadata:
        device = common.device
        bs = common.block_size
        query_lens = common.query_lens
        is_decode = query_lens == 1
        decode_token_indices = decode_block_table = decode_mask = None
        if is_decode.any():
            rows = np.flatnonzero(is_decode)
            seq_lens = common.seq_lens[rows]
            num_blocks = -(-int(seq_lens.max()) // bs)
            decode_token_indices = torch.from_numpy(common.query_start_loc[rows].astype(np.int64))
            decode_block_table = torch.from_numpy(common.block_table[rows, :num_blocks].astype(np.int64))
            positions = np.arange(num_blocks * bs)
            mask = torch.from_numpy(positions[None, :] >= seq_lens[:, None])
            decode_token_indices = decode_token_indices.to(device)
            decode_block_table = decode_block_table.to(device)
            decode_mask = mask.to(device)[:, None, None, :]
        prefills = []
        for row in np.flatnonzero(~is_decode & (query_lens > 0)):
            start, end = int(common.query_start_loc[row]), int(common.query_start_loc[row + 1])
            span = PrefillSpan(start, end, int(common.num_computed_tokens[row]))
            if span.context_len > 0:
                seq_len = int(common.seq_lens[row])
                num_blocks = -(-seq_len // bs)
                q_pos = torch.arange(span.context_len, seq_len, device=device)
                k_pos = torch.arange(seq_len, device=device)
                span.seq_len = seq_len
                span.attn_mask = k_pos[None, :] <= q_pos[:, None]
                span.block_ids = torch.from_numpy(
                    common.block_table[row, :num_blocks].astype(np.int64)
                ).to(device)
            prefills.append(span)
        return TorchRefMetadata(
            common.slot_mapping, decode_token_indices, decode_block_table, decode_mask, prefills
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: TorchRefMetadata,
        scale: float,
    ) -> torch.Tensor:
        key_cache, value_cache = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, kv_heads, head_dim]
        num_kv_heads, head_dim = key.shape[1], key.shape[2]
        key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, attn_metadata.slot_mapping, key)
        value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, attn_metadata.slot_mapping, value)

        output = torch.empty_like(query)
        if attn_metadata.decode_token_indices is not None:
            idx = attn_metadata.decode_token_indices
            output[idx] = _paged_decode_attention(
                query[idx], key_cache, value_cache, attn_metadata, scale
            )
        for span in attn_metadata.prefills:
            q = query[span.start : span.end].transpose(0, 1)  # [heads, q_len, head_dim]
            if span.context_len == 0:
                k = key[span.start : span.end].transpose(0, 1)
                v = value[span.start : span.end].transpose(0, 1)
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            else:
                k = key_cache[span.block_ids].flatten(0, 1)[: span.seq_len].transpose(0, 1)
                v = value_cache[span.block_ids].flatten(0, 1)[: span.seq_len].transpose(0, 1)
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=span.attn_mask, scale=scale, enable_gqa=True
                )
            output[span.start : span.end] = out.transpose(0, 1)
        return output


def _paged_decode_attention(
    query: torch.Tensor,  # [B, heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,
    meta: TorchRefMetadata,
    scale: float,
) -> torch.Tensor:  # [B, heads, head_dim]
    """One query token per request against its K/V, gathered block-wise and padded.

    NOTE: written as two batched matmuls instead of SDPA: for a single query row the CPU SDPA
    kernels were several times slower. Query heads sharing a KV head are grouped as rows of one
    matmul, so K/V are never repeated per query head.
    """
    num_reqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    flat_blocks = meta.decode_block_table.view(-1)
    # index_select on whole blocks is much faster than advanced indexing here.
    k = key_cache.index_select(0, flat_blocks).view(num_reqs, -1, num_kv_heads, head_dim)
    v = value_cache.index_select(0, flat_blocks).view(num_reqs, -1, num_kv_heads, head_dim)
    k = k.transpose(1, 2)  # [B, kv_heads, L, head_dim]
    v = v.transpose(1, 2)
    q = query.view(num_reqs, num_kv_heads, group, head_dim)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # [B, kv_heads, group, L]
    scores.masked_fill_(meta.decode_mask, float("-inf"))
    probs = scores.softmax(dim=-1).to(v.dtype)
    return torch.matmul(probs, v).view(num_reqs, num_heads, head_dim)
