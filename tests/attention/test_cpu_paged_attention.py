"""The C++ CPU paged attention (attention/cpu_paged.py; csrc/paged_attention.cpp for decodes,
csrc/paged_prefill_attention.cpp for prefills) against the float64 formula, against the torch
reference on the same cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from attention_utils import run_step

from minivllm.attention.backend import CommonAttentionMetadata
from minivllm.attention.cpu_paged import CpuPagedAttentionBackend
from minivllm.attention.torch_ref import TorchRefAttentionBackend, write_kv_cache

pytestmark = pytest.mark.usefixtures("cpu_kernels")


SHAPES = [  # (heads, kv_heads, head_dim)
    (9, 3, 64),  # SmolLM2
    (32, 8, 128),  # Llama-3-8B-like
    (4, 4, 64),  # MHA
    (8, 1, 128),  # MQA: two key steps of 4 heads, the value pass in four walks of 32 dims
    (12, 2, 128),  # Qwen2.5-1.5B-like, 6 per KV head: the value pass in four walks of 32 dims
    (10, 2, 64),  # 5 per KV head: a grouping without its own decode instance
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_mixed_step_matches_formula(shape, dtype):
    """Decodes of many lengths (1 token, block multiples, ragged), a fresh prompt and a later
    chunk in one step, blocks scattered over the cache."""
    heads, kv_heads, head_dim = shape
    seq_lens = [1, 17, 3, 64, 9, 200, 30, 7, 130]
    query_lens = [1, 1, 3, 1, 9, 1, 6, 1, 1]  # rows 2 and 4 fresh prompts, row 6 a later chunk
    run_step(CpuPagedAttentionBackend(), seq_lens, query_lens, dtype=dtype, heads=heads,
             kv_heads=kv_heads, head_dim=head_dim, block_size=16)


@pytest.mark.parametrize("block_size", [1, 4, 16, 128])
@pytest.mark.parametrize("seq_lens", [[1], [333], [8, 8, 8], [600, 2, 47, 129, 16]])
def test_decodes_only_matches_formula(seq_lens, block_size):
    run_step(CpuPagedAttentionBackend(), seq_lens, [1] * len(seq_lens), seed=len(seq_lens),
             heads=9, kv_heads=3, head_dim=64, block_size=block_size)


def test_prefills_only():
    """A step with no decodes: the decode kernel has nothing to do, every prefill is computed."""
    run_step(CpuPagedAttentionBackend(), [12, 40, 5], [12, 8, 5], heads=9, kv_heads=3,
             head_dim=64, block_size=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_long_prefills_match_formula(shape, dtype):
    """Prompts over many tiles (a tile holds 64 / heads-per-KV-head tokens): lengths at and
    around tile and block edges, a later chunk after 100 cached tokens and a prompt after a
    whole-block prefix hit (query starting at a block boundary)."""
    heads, kv_heads, head_dim = shape
    seq_lens = [2, 21, 22, 64, 65, 137, 300, 48]
    query_lens = [2, 21, 22, 64, 65, 37, 300, 16]
    run_step(CpuPagedAttentionBackend(), seq_lens, query_lens, dtype=dtype, heads=heads,
             kv_heads=kv_heads, head_dim=head_dim, block_size=16, seed=3)


@pytest.mark.parametrize("block_size", [1, 4, 128])
def test_prefill_block_sizes(block_size):
    run_step(CpuPagedAttentionBackend(), [70, 9, 200], [70, 5, 33], dtype=torch.bfloat16,
             heads=9, kv_heads=3, head_dim=64, block_size=block_size, seed=block_size)


def test_prefill_reads_strided_query_rows():
    """In the model the query is a view of the fused QKV output (rows wider than heads x
    head_dim); the kernel follows the strides and writes a separate output."""
    backend = CpuPagedAttentionBackend()
    gen = torch.Generator().manual_seed(2)
    n, heads, kv_heads, dim = 50, 9, 3, 64
    cache = torch.zeros(backend.get_kv_cache_shape(8, 16, kv_heads, dim), dtype=torch.bfloat16)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=gen).to(torch.bfloat16)
    q = qkv[:, : heads * dim].view(n, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(n, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(n, kv_heads, dim)
    table = np.array([[3, 1, 7, 5]], dtype=np.int32)
    positions = np.arange(n)
    slots = torch.from_numpy((table[0, positions // 16] * 16 + positions % 16).astype(np.int64))
    common = CommonAttentionMetadata.from_arrays(np.array([0, n], dtype=np.int32), np.array([n], dtype=np.int32),
                                                 table, slots, 16, torch.device("cpu"))
    out = backend.forward(q, k, v, cache, backend.build_metadata(common), dim**-0.5)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.double().transpose(0, 1), k.double().transpose(0, 1), v.double().transpose(0, 1),
        is_causal=True, scale=dim**-0.5, enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(("query_lens", "seq_lens", "table", "message"), [
    ([5], [4], [[1]], "bad lengths"),  # more query tokens than the sequence holds
    ([0], [4], [[1]], "bad lengths"),
    ([60], [60], [[1]], "bad lengths"),  # tokens past the end of the query tensor
    ([5], [40], [[1, 2]], "too few blocks"),
    ([5], [20], [[1, 9]], "outside the cache"),
    ([5], [20], [[1, -1]], "outside the cache"),
])
def test_prefill_bad_metadata_is_an_error(query_lens, seq_lens, table, message):
    cache = torch.zeros(TorchRefAttentionBackend().get_kv_cache_shape(4, 16, 3, 64))
    q = torch.ones(8, 9, 64)
    out = torch.zeros_like(q)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.minivllm_cpu.paged_prefill_attention(
            out, q, cache, torch.tensor([0]), torch.tensor(query_lens, dtype=torch.int32),
            torch.tensor(seq_lens, dtype=torch.int32), torch.tensor(table, dtype=torch.int32), 0.125)
    assert not out.any()


def test_many_requests_bfloat16():
    """Enough work items (64 requests x 3 KV heads) that the kernel splits them across threads."""
    rng = np.random.default_rng(0)
    seq_lens = rng.integers(100, 700, size=64).tolist()
    run_step(CpuPagedAttentionBackend(), seq_lens, [1] * 64, dtype=torch.bfloat16, heads=9,
             kv_heads=3, head_dim=64, block_size=16)


def test_reshape_and_cache_matches_reference_write():
    """Strided key/value views (as split from the fused QKV output) land at their slots exactly
    as the reference's index_copy puts them; other slots are untouched."""
    gen = torch.Generator().manual_seed(0)
    shape = TorchRefAttentionBackend().get_kv_cache_shape(12, 16, 3, 64)
    cache = torch.randn(shape, generator=gen).to(torch.bfloat16)
    expected = cache.clone()
    qkv = torch.randn(20, (9 + 3 + 3) * 64, generator=gen).to(torch.bfloat16)
    key = qkv[:, 9 * 64 : 12 * 64].view(20, 3, 64)
    value = qkv[:, 12 * 64 :].view(20, 3, 64)
    slots = torch.from_numpy(np.random.default_rng(1).permutation(12 * 16)[:20].astype(np.int64))
    torch.ops.minivllm_cpu.reshape_and_cache(key, value, cache, slots)
    write_kv_cache(key, value, expected, slots)
    assert torch.equal(cache, expected)


def test_bad_slot_is_an_error_not_a_write():
    cache = torch.zeros(TorchRefAttentionBackend().get_kv_cache_shape(4, 16, 3, 64))
    key = torch.ones(1, 3, 64)
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.minivllm_cpu.reshape_and_cache(key, key, cache, torch.tensor([4 * 16]))
    assert not cache.any()


def test_agrees_with_reference_backend_on_one_cache():
    """Both backends on the same bfloat16 cache and inputs: outputs within bfloat16 rounding."""
    outputs = []
    for backend in (TorchRefAttentionBackend(), CpuPagedAttentionBackend()):
        outputs.append(_step_output(backend))
    torch.testing.assert_close(outputs[0].float(), outputs[1].float(), atol=2e-2, rtol=2e-2)


def _step_output(backend) -> torch.Tensor:
    gen = torch.Generator().manual_seed(5)
    seq_lens = np.array([40, 300, 77], dtype=np.int32)
    table = np.arange(1, 1 + 3 * 19, dtype=np.int32).reshape(3, 19)
    cache = torch.randn(backend.get_kv_cache_shape(64, 16, 3, 64), generator=gen).to(torch.bfloat16)
    positions = seq_lens - 1
    slots = table[np.arange(3), positions // 16] * 16 + positions % 16
    common = CommonAttentionMetadata.from_arrays(
        np.arange(4, dtype=np.int32), seq_lens, table, torch.from_numpy(slots.astype(np.int64)), 16,
        torch.device("cpu"))
    q = torch.randn(3, 9, 64, generator=gen).to(torch.bfloat16)
    k = torch.randn(3, 3, 64, generator=gen).to(torch.bfloat16)
    return backend.forward(q, k, k.clone(), cache, backend.build_metadata(common), 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 5, 16, 33, 512])
def test_sliding_window_matches_formula_without_reading_freed_blocks(window, dtype):
    """Decodes and prefill chunks that straddle the window's edge, shorter and longer than it;
    the blocks before each request's window hold NaN (freed by the KV manager, maybe reused), so
    reading any of them would show. Head dim 256 (Gemma 3: 4 query heads on one KV head) too."""
    seq_lens = [1, 17, 40, 64, 200, 530, 90, 600]
    query_lens = [1, 1, 40, 1, 37, 1, 70, 300]
    for heads, kv_heads, head_dim in ((9, 3, 64), (4, 1, 256)):
        run_step(CpuPagedAttentionBackend(), seq_lens, query_lens, dtype=dtype, heads=heads,
                 kv_heads=kv_heads, head_dim=head_dim, block_size=16, sliding_window=window, seed=window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_dim_256_matches_formula(dtype):
    """Gemma 3's head size, without a window: decodes, a fresh prompt over several tiles and a
    later chunk."""
    run_step(CpuPagedAttentionBackend(), [1, 70, 300, 33], [1, 70, 1, 20], dtype=dtype, heads=4,
             kv_heads=1, head_dim=256, block_size=16, seed=7)
