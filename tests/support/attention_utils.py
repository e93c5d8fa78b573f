"""One attention step checked against a direct formula, for any backend: every query token's
output equals the softmax over its request's earlier keys (causal, GQA; with a sliding window W
only the last W of them), read slot by slot from the cache as the step left it, in float64."""

from __future__ import annotations

import numpy as np
import torch

from minivllm.attention.backend import AttentionBackend, CommonAttentionMetadata


def run_step(
    backend: AttentionBackend,
    seq_lens: list[int],
    query_lens: list[int],
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    heads: int = 6,
    kv_heads: int = 2,
    head_dim: int = 8,
    block_size: int = 4,
    sliding_window: int | None = None,
    poison: float = float("nan"),
    device: str = "cpu",
    padding: int = 0,
) -> None:
    """One step over requests with these total lengths and scheduled query tokens; compares the
    backend's output with the formula for every token.

    With a sliding window, the blocks wholly before every query's window point at a block
    filled with `poison`, as a KV manager that freed them leaves them: NaN for a backend that
    must not read them at all, a large finite value for one that may read them but must mask.
    The step runs on `device`; the formula on the CPU. `padding` tokens follow the step's, in
    as many requests of no queries and no length, with no slot (a step padded to a recorded
    size): they must write nothing."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    max_blocks = max(-(-s // block_size) for s in seq_lens)
    num_blocks = 2 * sum(-(-s // block_size) for s in seq_lens) + 2
    kv_cache = torch.randn(backend.get_kv_cache_shape(num_blocks, block_size, kv_heads, head_dim), generator=gen).to(dtype)
    poisoned = num_blocks - 1
    kv_cache[:, :, poisoned] = poison
    free = rng.permutation(np.arange(1, num_blocks - 1))  # block 0 is the null block
    block_table = np.zeros((len(seq_lens), max_blocks), dtype=np.int32)
    used = 0
    computed = np.array([s - q for s, q in zip(seq_lens, query_lens, strict=True)], dtype=np.int32)
    for i, s in enumerate(seq_lens):
        n = -(-s // block_size)
        block_table[i, :n] = free[used : used + n]
        used += n
        if sliding_window is not None:
            # Blocks before the first query's window: no query of this step reads them.
            block_table[i, : max(0, int(computed[i]) - sliding_window + 1) // block_size] = poisoned
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    num_tokens = int(query_start_loc[-1])
    positions = np.concatenate([np.arange(c, s) for c, s in zip(computed, seq_lens, strict=True)])
    req_of_token = np.repeat(np.arange(len(seq_lens)), query_lens)
    slots = block_table[req_of_token, positions // block_size] * block_size + positions % block_size
    common = CommonAttentionMetadata.from_arrays(
        np.concatenate([query_start_loc, np.full(padding, num_tokens, np.int32)]),
        np.array(seq_lens + [0] * padding, dtype=np.int32),
        np.concatenate([block_table, rng.integers(0, num_blocks, (padding, max_blocks), dtype=np.int32)]),
        torch.from_numpy(np.concatenate([slots, np.full(padding, -1)]).astype(np.int64)).to(device), block_size,
        torch.device(device))
    query = torch.randn(num_tokens + padding, heads, head_dim, generator=gen).to(dtype)
    key = torch.randn(num_tokens + padding, kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens + padding, kv_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    on_device = [t.to(device) for t in (query, key, value, kv_cache)]
    out = backend.forward(*on_device, backend.build_metadata(common), scale, sliding_window).cpu()[:num_tokens]
    untouched = np.ones(num_blocks * block_size, dtype=bool)
    untouched[slots] = False
    before, kv_cache = kv_cache, on_device[3].cpu()
    flat_shape = (2, kv_heads, num_blocks * block_size, head_dim)
    torch.testing.assert_close(kv_cache.view(flat_shape)[:, :, untouched], before.view(flat_shape)[:, :, untouched],
                               equal_nan=True, atol=0, rtol=0)
    assert out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: probabilities and output rounded
    # The formula, slot by slot, on the cache as the step left it (new K/V written in).
    k_all = kv_cache[0].double().reshape(kv_heads, -1, head_dim)
    v_all = kv_cache[1].double().reshape(kv_heads, -1, head_dim)
    group = heads // kv_heads
    for t in range(num_tokens):
        r, pos = req_of_token[t], positions[t]
        ctx = np.arange(0 if sliding_window is None else max(0, pos - sliding_window + 1), pos + 1)
        ctx_slots = torch.from_numpy(block_table[r, ctx // block_size] * block_size + ctx % block_size)
        for h in range(heads):
            k, v = k_all[h // group, ctx_slots], v_all[h // group, ctx_slots]
            p = torch.softmax(k @ query[t, h].double() * scale, dim=0)
            torch.testing.assert_close(out[t, h].double(), p @ v, atol=tol, rtol=tol)


