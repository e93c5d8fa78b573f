"""Reference paged attention in plain torch: runs on CPU and CUDA, and is what faster backends
are checked against.

KV cache layout, per layer: backend.py's head_major_kv_cache_shape. Gathering a request's blocks
along dim 2 yields, for each KV head, its keys as one contiguous [seq_len, head_dim] matrix,
which matmul consumes without another copy.

Decode requests (one query token) are sorted by length and cut into groups; each group is two
matmuls over K/V gathered through its block tables, padded to the group's longest sequence and
masked. Groups bound the padding and keep each gathered K/V small enough to stay in the CPU's
caches between the gather and the matmuls. Prefill requests run one SDPA call
each: a fresh prompt attends to its own new K/V with a causal mask; a later chunk gathers its
earlier K/V from the cache and uses a bottom-right causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from minivllm.attention.backend import (
    AttentionBackend,
    CommonAttentionMetadata,
    head_major_kv_cache_shape,
)
from minivllm.utils import cdiv


@dataclass
class PrefillSpan:
    start: int  # first query token in the flat batch
    end: int
    context_len: int  # tokens of this request already in the cache before this step
    # Only for context_len > 0: the request's blocks and the [q_len, seq_len] causal mask.
    block_ids: torch.Tensor | None = None
    attn_mask: torch.Tensor | None = None
    seq_len: int = 0
    # Causal masks with a sliding window, by window (built by the first layer that asks).
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def window_mask(self, sliding_window: int, device: torch.device) -> torch.Tensor:
        """[q_len, seq_len] True where the query may attend: causal, and key > query - window.
        (With no context the keys are the span's own tokens: positions 0.. as well.)"""
        mask = self.window_masks.get(sliding_window)
        if mask is None:
            seq_len = self.context_len + self.end - self.start
            q_pos = torch.arange(self.context_len, seq_len, device=device)
            k_pos = torch.arange(seq_len, device=device)
            mask = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - sliding_window)
            self.window_masks[sliding_window] = mask
        return mask


@dataclass
class DecodeGroup:
    token_indices: torch.Tensor | None  # [num_reqs] rows of the flat batch; None: all, in order
    block_ids: torch.Tensor  # [num_reqs * max_blocks], flattened block tables
    mask: torch.Tensor  # [1, num_reqs, 1, max_blocks * block_size], True = padding
    seq_lens: torch.Tensor  # [num_reqs] int64
    # `mask` plus the keys before each request's window, by window (built on first use).
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def masked(self, sliding_window: int | None) -> torch.Tensor:
        """True where a key is padding or (with a window) older than the window."""
        if sliding_window is None:
            return self.mask
        mask = self.window_masks.get(sliding_window)
        if mask is None:
            k_pos = torch.arange(self.mask.shape[-1], device=self.mask.device)
            outside = k_pos[None, :] <= (self.seq_lens - 1 - sliding_window)[:, None]
            mask = self.mask | outside[None, :, None, :]
            self.window_masks[sliding_window] = mask
        return mask


@dataclass
class TorchRefMetadata:
    slot_mapping: torch.Tensor  # [num_tokens]
    decodes: list[DecodeGroup]
    prefills: list[PrefillSpan]


# Padded tokens per decode group: measured on a 2-core CPU with SmolLM2 (64 requests of 128-640
# tokens), groups of about this size ran the decode attention 1.7x faster than one padded batch.
DECODE_GROUP_TOKENS = 4096
# Smaller groups (a few streams) run in float32: there a bf16 batched matmul costs ~35 us, mostly
# call overhead, against ~10 us in float32, and the K/V copies are a few hundred KiB.
FLOAT32_GROUP_TOKENS = 1024


class TorchRefAttentionBackend(AttentionBackend):
    """Any device, any dtype and head size. Its metadata is per-step Python structure (decode
    groups, prefill spans), so no recorded forward replays it."""

    name = "TORCH_REF"
    supports_sliding_window = True
    get_kv_cache_shape = staticmethod(head_major_kv_cache_shape)

    def build_metadata(self, common: CommonAttentionMetadata) -> TorchRefMetadata:
        device = common.device
        bs = common.block_size
        query_lens = common.query_lens
        is_decode = query_lens == 1
        num_tokens = int(common.query_start_loc[-1])
        decodes = []
        for rows in _decode_groups(np.flatnonzero(is_decode), common.seq_lens):
            seq_lens = common.seq_lens[rows]
            num_blocks = cdiv(int(seq_lens[-1]), bs)
            padding = np.arange(num_blocks * bs)[None, :] >= seq_lens[:, None]
            token_indices = common.query_start_loc[rows]
            # A step of decodes only, in one group already in order (one stream, or requests of
            # similar lengths): the group's output is the layer's output, with no gather/scatter.
            everything = len(rows) == num_tokens and bool((token_indices == np.arange(num_tokens)).all())
            decodes.append(DecodeGroup(
                None if everything else _to_device(token_indices, device),
                _to_device(common.block_table[rows, :num_blocks].reshape(-1), device),
                torch.from_numpy(padding).to(device)[None, :, None, :],
                _to_device(seq_lens, device),
            ))
        prefills = build_prefill_spans(common, np.flatnonzero(~is_decode & (query_lens > 0)))
        return TorchRefMetadata(common.slot_mapping, decodes, prefills)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: TorchRefMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape[1:]
        write_kv_cache(key, value, kv_cache, attn_metadata.slot_mapping)
        key_blocks = kv_cache[0].view(num_kv_heads, num_blocks, block_size * head_dim)
        value_blocks = kv_cache[1].view(num_kv_heads, num_blocks, block_size * head_dim)

        decodes = attn_metadata.decodes
        if len(decodes) == 1 and decodes[0].token_indices is None:
            return _paged_decode_attention(query, key_blocks, value_blocks, decodes[0], scale, sliding_window)
        output = torch.empty_like(query)
        for group in decodes:
            idx = group.token_indices
            output[idx] = _paged_decode_attention(query[idx], key_blocks, value_blocks, group, scale, sliding_window)
        prefill_attention(query, key, value, kv_cache, attn_metadata.prefills, scale, output, sliding_window)
        return output


def build_prefill_spans(common: CommonAttentionMetadata, rows: np.ndarray) -> list[PrefillSpan]:
    """Per prefill row: its tokens in the flat batch, and for a later chunk the blocks and causal
    mask of its whole sequence so far."""
    device, bs = common.device, common.block_size
    prefills = []
    for row in rows:
        start, end = int(common.query_start_loc[row]), int(common.query_start_loc[row + 1])
        span = PrefillSpan(start, end, int(common.num_computed_tokens[row]))
        if span.context_len > 0:
            seq_len = int(common.seq_lens[row])
            q_pos = torch.arange(span.context_len, seq_len, device=device)
            k_pos = torch.arange(seq_len, device=device)
            span.seq_len = seq_len
            span.attn_mask = k_pos[None, :] <= q_pos[:, None]
            span.block_ids = _to_device(common.block_table[row, : cdiv(seq_len, bs)], device)
        prefills.append(span)
    return prefills


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store a step's new K/V ([tokens, kv_heads, head_dim]) at their slots."""
    num_kv_heads, head_dim = kv_cache.shape[1], kv_cache.shape[4]
    kv_cache[0].view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, key.transpose(0, 1))
    kv_cache[1].view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, value.transpose(0, 1))


def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    spans: list[PrefillSpan],
    scale: float,
    output: torch.Tensor,
    sliding_window: int | None = None,
) -> None:
    """One SDPA call per prefill span into its rows of `output`: a fresh prompt attends to its
    own new K/V; a later chunk to its whole sequence, gathered from the cache (K/V written).
    A sliding window masks the keys before each query's window."""
    num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape[1:]
    for span in spans:
        # NOTE: 4-D inputs (a batch of one) let CPU SDPA take its flash kernel with GQA;
        # 3-D inputs fall back to the math path, 2-3x slower.
        q = query[span.start : span.end].transpose(0, 1)[None]  # [1, heads, q_len, head_dim]
        if span.context_len == 0:
            k = key[span.start : span.end].transpose(0, 1)[None]
            v = value[span.start : span.end].transpose(0, 1)[None]
            mask, causal = None, True
        else:
            key_blocks = kv_cache[0].view(num_kv_heads, num_blocks, block_size * head_dim)
            value_blocks = kv_cache[1].view(num_kv_heads, num_blocks, block_size * head_dim)
            k = key_blocks.index_select(1, span.block_ids).view(num_kv_heads, -1, head_dim)
            v = value_blocks.index_select(1, span.block_ids).view(num_kv_heads, -1, head_dim)
            k, v = k[None, :, : span.seq_len], v[None, :, : span.seq_len]
            mask, causal = span.attn_mask, False
        if sliding_window is not None:
            mask, causal = span.window_mask(sliding_window, query.device), False
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
        )
        output[span.start : span.end] = out[0].transpose(0, 1)


def _decode_groups(rows: np.ndarray, seq_lens: np.ndarray) -> list[np.ndarray]:
    """Decode rows by increasing length, cut so that each group's padded size (rows times its
    longest sequence) stays within DECODE_GROUP_TOKENS (a single row may exceed it)."""
    if len(rows) == 0:
        return []
    rows = rows[np.argsort(seq_lens[rows], kind="stable")]
    groups, start = [], 0
    for end in range(1, len(rows) + 1):
        if end == len(rows) or (end + 1 - start) * int(seq_lens[rows[end]]) > DECODE_GROUP_TOKENS:
            groups.append(rows[start:end])
            start = end
    return groups


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(array.astype(np.int64)).to(device)


def _paged_decode_attention(
    query: torch.Tensor,  # [B, heads, head_dim]
    key_blocks: torch.Tensor,  # [kv_heads, num_blocks, block_size * head_dim]
    value_blocks: torch.Tensor,
    group: DecodeGroup,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:  # [B, heads, head_dim]
    """One query token per request against its K/V, gathered block-wise and padded.

    NOTE: two batched matmuls instead of SDPA: for a single query row the CPU SDPA kernels were
    several times slower. Query heads sharing a KV head are the rows of one matmul, so K/V are
    never repeated per query head.
    """
    num_reqs, num_heads, head_dim = query.shape
    num_kv_heads = key_blocks.shape[0]
    heads_per_kv = num_heads // num_kv_heads
    # [kv_heads, B, L, head_dim], contiguous per (head, request)
    k = key_blocks.index_select(1, group.block_ids).view(num_kv_heads, num_reqs, -1, head_dim)
    v = value_blocks.index_select(1, group.block_ids).view(num_kv_heads, num_reqs, -1, head_dim)
    q = query.view(num_reqs, num_kv_heads, heads_per_kv, head_dim).transpose(0, 1)  # [kv_heads, B, group, D]
    if query.dtype != torch.float32 and num_reqs * k.shape[2] <= FLOAT32_GROUP_TOKENS:
        q, k, v = q.float(), k.float(), v.float()
    scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale)  # [kv_heads, B, group, L]
    scores.masked_fill_(group.masked(sliding_window), float("-inf"))
    probs = scores.softmax(dim=-1).to(v.dtype)
    out = torch.matmul(probs, v)  # [kv_heads, B, group, head_dim]
    return out.to(query.dtype).transpose(0, 1).reshape(num_reqs, num_heads, head_dim)
