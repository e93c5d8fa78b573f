"""The reference paged attention against a direct formula: for every query token, softmax over
its request's earlier keys (causal, GQA) read slot by slot, in float64. Mixed steps (decodes of
many lengths, a fresh prompt, a later prompt chunk), decode groups of every size, and the
single-group path that skips the gather/scatter of rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import minivllm.attention.torch_ref as torch_ref
from minivllm.attention.backend import CommonAttentionMetadata

HEADS, KV_HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS = 6, 2, 8, 4, 200


def run_step(seq_lens: list[int], query_lens: list[int], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """One step over requests with these total lengths and scheduled query tokens; compares the
    backend's output with the formula for every token."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    backend = torch_ref.TorchRefAttentionBackend()
    kv_cache = torch.randn(backend.get_kv_cache_shape(NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM), generator=gen).to(dtype)
    max_blocks = max(-(-s // BLOCK) for s in seq_lens)
    free = rng.permutation(np.arange(1, NUM_BLOCKS))  # block 0 is the null block
    block_table = np.zeros((len(seq_lens), max_blocks), dtype=np.int32)
    used = 0
    for i, s in enumerate(seq_lens):
        n = -(-s // BLOCK)
        block_table[i, :n] = free[used : used + n]
        used += n
    computed = np.array([s - q for s, q in zip(seq_lens, query_lens, strict=True)], dtype=np.int32)
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    num_tokens = int(query_start_loc[-1])
    positions = np.concatenate([np.arange(c, s) for c, s in zip(computed, seq_lens, strict=True)])
    req_of_token = np.repeat(np.arange(len(seq_lens)), query_lens)
    slots = block_table[req_of_token, positions // BLOCK] * BLOCK + positions % BLOCK
    common = CommonAttentionMetadata(
        query_start_loc=query_start_loc, seq_lens=np.array(seq_lens, dtype=np.int32),
        num_computed_tokens=computed, block_table=block_table,
        slot_mapping=torch.from_numpy(slots.astype(np.int64)), block_size=BLOCK, device=torch.device("cpu"),
    )
    query = torch.randn(num_tokens, HEADS, HEAD_DIM, generator=gen).to(dtype)
    key = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    value = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    scale = HEAD_DIM**-0.5
    out = backend.forward(query, key, value, kv_cache, backend.build_metadata(common), scale)
    assert out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: probabilities and output rounded
    # The formula, slot by slot, on the cache as the step left it (new K/V written in).
    k_all = kv_cache[0].double().reshape(KV_HEADS, -1, HEAD_DIM)
    v_all = kv_cache[1].double().reshape(KV_HEADS, -1, HEAD_DIM)
    group = HEADS // KV_HEADS
    for t in range(num_tokens):
        r, pos = req_of_token[t], positions[t]
        ctx = np.arange(pos + 1)
        ctx_slots = torch.from_numpy(block_table[r, ctx // BLOCK] * BLOCK + ctx % BLOCK)
        for h in range(HEADS):
            k, v = k_all[h // group, ctx_slots], v_all[h // group, ctx_slots]
            p = torch.softmax(k @ query[t, h].double() * scale, dim=0)
            torch.testing.assert_close(out[t, h].double(), p @ v, atol=tol, rtol=tol)


@pytest.mark.parametrize("group_tokens", [1, 24, 64, torch_ref.DECODE_GROUP_TOKENS])
def test_mixed_step(monkeypatch, group_tokens):
    """Decodes of many lengths (a group per request up to one group), a fresh prompt, a chunk."""
    monkeypatch.setattr(torch_ref, "DECODE_GROUP_TOKENS", group_tokens)
    seq_lens = [5, 17, 3, 40, 9, 12, 30, 7]
    query_lens = [1, 1, 3, 1, 9, 1, 6, 1]  # row 2 and 4 fresh prompts, row 6 a later chunk
    run_step(seq_lens, query_lens)


@pytest.mark.parametrize("seq_lens", [[1], [23], [8, 8, 8], [3, 10, 33]])
def test_decodes_only(monkeypatch, seq_lens):
    """Only decodes: in one group (rows in order when the lengths are sorted: the no-scatter
    path) or several."""
    for group_tokens in (1, 10_000):
        monkeypatch.setattr(torch_ref, "DECODE_GROUP_TOKENS", group_tokens)
        run_step(seq_lens, [1] * len(seq_lens), seed=len(seq_lens))


def test_decode_rows_out_of_length_order(monkeypatch):
    """Rows whose lengths are not sorted still get their own outputs back."""
    monkeypatch.setattr(torch_ref, "DECODE_GROUP_TOKENS", 10_000)
    run_step([30, 2, 17, 5], [1, 1, 1, 1], seed=3)


@pytest.mark.parametrize("float32_tokens", [0, 10_000])
def test_bfloat16_decodes_in_either_precision(monkeypatch, float32_tokens):
    """bfloat16 caches: small groups computed in float32, large ones in bfloat16; both agree with
    the formula to bfloat16 precision."""
    monkeypatch.setattr(torch_ref, "FLOAT32_GROUP_TOKENS", float32_tokens)
    run_step([5, 17, 3, 40, 9], [1, 1, 1, 1, 9], seed=4, dtype=torch.bfloat16)
