"""The Triton attention backend (attention/triton_attn.py, triton_kernels.py): against the
float64 formula (decodes, fresh prompts, later chunks, sliding windows with the blocks before them
NaN), against the reference backend on one cache, and its cache write against the reference write.

On a machine with CUDA the kernels run compiled on the GPU; elsewhere under the Triton
interpreter on the CPU (tests/support/triton_interpret.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from attention_utils import run_step
from triton_interpret import DEVICE  # before any kernel is defined

pytest.importorskip("triton")

from minivllm.attention.torch_ref import TorchRefAttentionBackend, write_kv_cache
from minivllm.attention.triton_attn import TritonAttentionBackend
from minivllm.attention.triton_kernels import query_rows, reshape_and_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mixed_step_matches_formula(dtype):
    """Decodes of many lengths, fresh prompts shorter and longer than a program's queries, a
    later chunk; GQA (3 query heads per KV head: 5 tokens a program); blocks scattered."""
    block_q = query_rows(3)[1]
    seq_lens = [1, 17, 3, 40, 2 * block_q + 3, 30]
    query_lens = [1, 1, 3, 1, 2 * block_q + 3, 6]
    run_step(TritonAttentionBackend(), seq_lens, query_lens, dtype=dtype, block_size=16, device=DEVICE)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 1), (7, 1), (32, 2)])
def test_query_heads_per_kv_head(heads, kv_heads):
    """Every grouping a program's rows take: one head per KV head (16 tokens a program), 8 (2
    tokens), 7 (2 tokens, 2 rows idle), 16 (1 token, 16 rows); requests at the programs' edges."""
    block_q = query_rows(heads // kv_heads)[1]
    query_lens = [1, block_q, block_q + 1, 1, 3 * block_q - 1]
    seq_lens = [9, block_q + 4, block_q + 1, 33, 3 * block_q + 20]
    run_step(TritonAttentionBackend(), seq_lens, query_lens, heads=heads, kv_heads=kv_heads, block_size=16,
             seed=heads, device=DEVICE)


def test_padding_requests_write_and_change_nothing():
    """A decode step padded to a recorded size (CUDA graphs): 5 real decodes, 3 padding tokens in
    requests of no queries whose block-table rows hold stale block ids."""
    run_step(TritonAttentionBackend(), [7, 30, 1, 16, 45], [1] * 5, block_size=16, padding=3, device=DEVICE)


@pytest.mark.parametrize("window", [1, 7, 16])
def test_sliding_window_matches_formula_without_reading_freed_blocks(window):
    run_step(TritonAttentionBackend(), [1, 17, 40, 64, 90], [1, 1, 40, 1, 37], sliding_window=window,
             seed=window, block_size=16, device=DEVICE)


def test_gemma_shape_and_cache_blocks_of_16():
    """Head size 256 with 4 query heads on one KV head, a window."""
    run_step(TritonAttentionBackend(), [5, 40, 21], [1, 40, 4], heads=4, kv_heads=1, head_dim=256,
             block_size=16, dtype=torch.bfloat16, sliding_window=24, seed=5, device=DEVICE)


def test_agrees_with_reference_backend():
    """Both backends on copies of one cache: the same step, the same outputs and caches."""
    gen = torch.Generator().manual_seed(0)
    block_table = np.arange(1, 13, dtype=np.int32).reshape(3, 4)
    seq_lens = np.array([9, 40, 5], dtype=np.int32)
    query_lens = np.array([1, 30, 5], dtype=np.int32)
    from minivllm.attention.backend import CommonAttentionMetadata

    computed = seq_lens - query_lens
    positions = np.concatenate([np.arange(c, s) for c, s in zip(computed, seq_lens, strict=True)])
    rows = np.repeat(np.arange(3), query_lens)
    slots = block_table[rows, positions // 16] * 16 + positions % 16
    common = CommonAttentionMetadata.from_arrays(
        np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32), seq_lens, block_table,
        torch.from_numpy(slots.astype(np.int64)).to(DEVICE), 16, torch.device(DEVICE))
    cache = torch.randn(TritonAttentionBackend.get_kv_cache_shape(13, 16, 2, 8), generator=gen).to(DEVICE)
    q, k, v = (torch.randn(36, n, 8, generator=gen).to(DEVICE) for n in (6, 2, 2))
    results = []
    for backend in (TorchRefAttentionBackend(), TritonAttentionBackend()):
        own = cache.clone()
        results.append((backend.forward(q, k, v, own, backend.build_metadata(common), 0.3), own))
    (ref_out, ref_cache), (out, tri_cache) = results
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    assert torch.equal(tri_cache, ref_cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_write_matches_reference_and_skips_padding(dtype):
    """Strided key/value views land at their slots as the reference's index_copy puts them; a
    slot of -1 (a padding token) writes nothing."""
    gen = torch.Generator().manual_seed(1)
    shape = TritonAttentionBackend.get_kv_cache_shape(6, 4, 2, 8)
    cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    expected = cache.clone()
    qkv = torch.randn(7, 6 * 8, generator=gen).to(dtype).to(DEVICE)
    key, value = qkv[:, 16:32].view(7, 2, 8), qkv[:, 32:].view(7, 2, 8)
    slots = torch.tensor([3, 7, 0, 12, -1, 23, 9], device=DEVICE)
    reshape_and_cache(key, value, cache, slots)
    keep = slots >= 0
    write_kv_cache(key[keep], value[keep], expected, slots[keep])
    assert torch.equal(cache, expected)


def test_tiny_gemma3_through_triton_matches_hf(make_tiny_model, make_llm, monkeypatch):
    """A whole engine on the Triton backend (forced; the CPU platform does not list it):
    sliding-window and global layers, chunks of 24 tokens, greedy equal to transformers."""
    from reference import check_logprobs_close, hf_greedy

    from minivllm import SamplingParams

    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "TRITON_ATTN")
    model_dir = make_tiny_model("gemma3")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, n).tolist() for n in (3, 30, 70)]
    reference = [r.as_output() for r in hf_greedy(model_dir, prompts, 8)]
    llm = make_llm(model_dir, dtype="float32", max_num_batched_tokens=24)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=8, logprobs=5), use_tqdm=False)
    check_logprobs_close(outputs_0=reference, outputs_1=[(o.outputs[0].token_ids, o.outputs[0].logprobs)
                                                         for o in outputs], name_0="hf", name_1="minivllm[triton]")
