"""The reference paged attention against a direct formula: for every query token, softmax over
its request's earlier keys (causal, GQA) read slot by slot, in float64. Mixed steps (decodes of
many lengths, a fresh prompt, a later prompt chunk), decode groups of every size, and the
single-group path that skips the gather/scatter of rows."""

from __future__ import annotations

import pytest
import torch
from attention_utils import run_step

import minivllm.attention.torch_ref as torch_ref


@pytest.mark.parametrize("group_tokens", [1, 24, 64, torch_ref.DECODE_GROUP_TOKENS])
def test_mixed_step(monkeypatch, group_tokens):
    """Decodes of many lengths (a group per request up to one group), a fresh prompt, a chunk."""
    monkeypatch.setattr(torch_ref, "DECODE_GROUP_TOKENS", group_tokens)
    seq_lens = [5, 17, 3, 40, 9, 12, 30, 7]
    query_lens = [1, 1, 3, 1, 9, 1, 6, 1]  # row 2 and 4 fresh prompts, row 6 a later chunk
    run_step(torch_ref.TorchRefAttentionBackend(), seq_lens, query_lens)


@pytest.mark.parametrize("seq_lens", [[1], [23], [8, 8, 8], [3, 10, 33]])
def test_decodes_only(monkeypatch, seq_lens):
    """Only decodes: in one group (rows in order when the lengths are sorted: the no-scatter
    path) or several."""
    for group_tokens in (1, 10_000):
        monkeypatch.setattr(torch_ref, "DECODE_GROUP_TOKENS", group_tokens)
        run_step(torch_ref.TorchRefAttentionBackend(), seq_lens, [1] * len(seq_lens), seed=len(seq_lens))


def test_decode_rows_out_of_length_order(monkeypatch):
    """Rows whose lengths are not sorted still get their own outputs back."""
    monkeypatch.setattr(torch_ref, "DECODE_GROUP_TOKENS", 10_000)
    run_step(torch_ref.TorchRefAttentionBackend(), [30, 2, 17, 5], [1, 1, 1, 1], seed=3)


@pytest.mark.parametrize("float32_tokens", [0, 10_000])
def test_bfloat16_decodes_in_either_precision(monkeypatch, float32_tokens):
    """bfloat16 caches: small groups computed in float32, large ones in bfloat16; both agree with
    the formula to bfloat16 precision."""
    monkeypatch.setattr(torch_ref, "FLOAT32_GROUP_TOKENS", float32_tokens)
    run_step(torch_ref.TorchRefAttentionBackend(), [5, 17, 3, 40, 9], [1, 1, 1, 1, 9], seed=4, dtype=torch.bfloat16)


@pytest.mark.parametrize("window", [1, 7, 16, 100])
def test_sliding_window(window):
    """Decodes and chunks across the window's edge; the blocks before each window hold large
    values (this backend gathers whole block tables and masks by position: they must not count)."""
    run_step(torch_ref.TorchRefAttentionBackend(), [1, 17, 40, 64, 130, 90], [1, 1, 40, 1, 37, 70],
             sliding_window=window, poison=1e4, seed=window)
