"""Paged attention in Triton: the cache write and one attention kernel for a flat batch that mixes
prefill chunks and decodes (vLLM's unified attention is the model; this one is written to be
read).

Cache layout, per layer: backend.py's head_major_kv_cache_shape, [2, kv_heads, num_blocks,
block_size, head_dim], so that both CPU-capable backends and this one read each other's caches
and share their tests. A slot s of KV head h holds its key at ((h * num_slots) + s) * head_dim
and its value kv_half elements further.

Attention: one program per (block of BLOCK_Q query tokens of one request, KV head), its BLOCK_M
rows every query head of that KV head for each of those tokens, so a KV head's blocks are read
once for its whole group (a decode's one token fills a row per query head). It walks the
request's KV blocks through its block table from the first key any of its queries may see (0,
or the start of the first query's sliding window) to its last query's position, with an online
softmax in float32: causal by position (a query at position p sees keys <= p; the request's
earlier tokens are context_len = seq_len - query_len), and with a window W only keys > p - W.
The grid is sized from
shapes alone, num_tokens // BLOCK_Q + num_reqs programs, and each program finds its request by
bisection over query_start_loc, so the host neither looks at the lengths (no sync) nor builds
any per-step table: the step's metadata is the model runner's own device arrays, which is what
lets a CUDA graph replay it. Requests of zero queries (padding of a replayed step) do nothing.

Runs on CUDA, and on the CPU under TRITON_INTERPRET=1 (how the tests check it). The interpreter
multiplies 16-bit floats in tl.dot wrongly (numpy has no bfloat16), so there the operands are
widened to float32 first (UPCAST): the same values, since the products of two 16-bit floats are
exact in float32 and both accumulate in float32, and the probabilities are rounded to the cache
dtype before either. tl.dot needs
every dimension >= 16 on a GPU: BLOCK_M is at least 16, head dims are padded to a power of two >= 16,
and the cache's block size must be >= 16 there.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def padded_head_dim(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, cache_ptr, slot_ptr,
    key_stride_t, key_stride_h, value_stride_t, value_stride_h,
    num_slots, kv_half,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    d = tl.arange(0, HEAD_DIM_P)
    # A negative slot: a padding token, nothing to write.
    mask = (d < HEAD_DIM) & ((d * 0 + slot) >= 0)
    k = tl.load(key_ptr + token * key_stride_t + head * key_stride_h + d, mask=mask)
    v = tl.load(value_ptr + token * value_stride_t + head * value_stride_h + d, mask=mask)
    dst = (head * num_slots + slot) * HEAD_DIM + d
    tl.store(cache_ptr + dst, k, mask=mask)
    tl.store(cache_ptr + kv_half + dst, v, mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Store a step's new K/V ([tokens, kv_heads, head_dim], rows may be strided views of the
    fused QKV output) at their slots."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    num_slots = kv_cache.shape[2] * kv_cache.shape[3]
    _reshape_and_cache_kernel[(num_tokens, num_kv_heads)](
        key, value, kv_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        num_slots, kv_cache.stride(0),
        HEAD_DIM=head_dim, HEAD_DIM_P=padded_head_dim(head_dim),
    )


@triton.jit
def _find_request(query_start_ptr, num_reqs, pid, BLOCK_Q: tl.constexpr):
    """The request program `pid` serves: the last i with first_program(i) <= pid, where
    first_program(i) = query_start_loc[i] // BLOCK_Q + i (strictly increasing), by bisection."""
    lo = pid * 0
    hi = lo + num_reqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        starts_before = tl.load(query_start_ptr + mid) // BLOCK_Q + mid <= pid
        lo = tl.where(starts_before, mid, lo)
        hi = tl.where(starts_before, hi, mid - 1)
    return lo


@triton.jit
def _unified_attention_kernel(
    out_ptr, q_ptr, cache_ptr, block_table_ptr, seq_lens_ptr, query_start_ptr, num_reqs,
    q_stride_t, q_stride_h, o_stride_t, o_stride_h, block_table_stride,
    num_slots, kv_half, scale, window,
    HEADS_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    USE_WINDOW: tl.constexpr, UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = _find_request(query_start_ptr, num_reqs, pid, BLOCK_Q)
    q_begin = tl.load(query_start_ptr + req)
    q_len = tl.load(query_start_ptr + req + 1) - q_begin
    first = (pid - (q_begin // BLOCK_Q + req)) * BLOCK_Q  # the program's first query, within its request
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len

    # Row m: query token first + m // HEADS_PER_KV, query head m % HEADS_PER_KV of this KV head.
    m = tl.arange(0, BLOCK_M)
    rows = first + m // HEADS_PER_KV
    heads = kv_head * HEADS_PER_KV + m % HEADS_PER_KV
    row_mask = (m < BLOCK_Q * HEADS_PER_KV) & (rows < q_len)
    q_pos = context_len + rows
    d = tl.arange(0, HEAD_DIM_P)
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + (q_begin + rows)[:, None] * q_stride_t + heads[:, None] * q_stride_h + d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    last_pos = context_len + tl.minimum(first + BLOCK_Q, q_len) - 1
    first_key = 0
    if USE_WINDOW:
        first_key = tl.maximum(context_len + first - window + 1, 0)
    first_block = first_key // BLOCK_SIZE
    # A program past its request's queries (bisection leaves a few idle) reads nothing.
    end_block = tl.where(first < q_len, last_pos // BLOCK_SIZE + 1, first_block)
    offs = tl.arange(0, BLOCK_SIZE)
    head_base = kv_head.to(tl.int64) * num_slots
    for block in range(first_block, end_block):
        block_id = tl.load(block_table_ptr + req * block_table_stride + block).to(tl.int64)
        rows_kv = (head_base + block_id * BLOCK_SIZE + offs) * HEAD_DIM
        k = tl.load(cache_ptr + rows_kv[:, None] + d[None, :], mask=d_mask[None, :], other=0.0)
        v = tl.load(cache_ptr + kv_half + rows_kv[:, None] + d[None, :], mask=d_mask[None, :], other=0.0)
        p_dtype = v.dtype
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        k_pos = block * BLOCK_SIZE + offs
        s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
        visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < seq_len)
        if USE_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no visible key yet (before its window) keeps m = -inf: shift by 0.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(p_dtype).to(v.dtype), v).to(tl.float32)
        m_i = m_new
    out = acc / tl.where(row_mask, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_begin + rows)[:, None] * o_stride_t + heads[:, None] * o_stride_h + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def query_rows(heads_per_kv: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_Q): a program's rows, and the query tokens they cover (every query head of
    one KV head per token, so the KV head's blocks are read once for all of them)."""
    block_m = max(16, triton.next_power_of_2(heads_per_kv))
    return block_m, block_m // heads_per_kv


def unified_attention(
    out: torch.Tensor,  # [tokens, heads, head_dim]
    query: torch.Tensor,  # [tokens, heads, head_dim]
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,  # [reqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [reqs] int32
    query_start_loc: torch.Tensor,  # [reqs + 1] int32
    scale: float,
    sliding_window: int | None,
) -> None:
    num_tokens, num_heads, head_dim = query.shape
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return
    num_kv_heads, num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2], kv_cache.shape[3]
    heads_per_kv = num_heads // num_kv_heads
    block_m, block_q = query_rows(heads_per_kv)
    # Shapes alone size the grid (no look at the lengths, so no host sync): request i's programs
    # start at query_start_loc[i] // BLOCK_Q + i, enough for cdiv(query_len, BLOCK_Q) of them.
    num_programs = num_tokens // block_q + num_reqs
    _unified_attention_kernel[(num_programs, num_kv_heads)](
        out, query, kv_cache, block_table, seq_lens, query_start_loc, num_reqs,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_table.stride(0),
        num_blocks * block_size, kv_cache.stride(0), scale, sliding_window or 0,
        HEADS_PER_KV=heads_per_kv, HEAD_DIM=head_dim, HEAD_DIM_P=padded_head_dim(head_dim),
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_SIZE=block_size,
        USE_WINDOW=sliding_window is not None,
        UPCAST=os.environ.get("TRITON_INTERPRET") == "1",
    )
