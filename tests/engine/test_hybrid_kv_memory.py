"""What the hybrid KV cache saves, counted block by block: a sliding-window layer holds only the
blocks its window can still read, a full-attention layer all of its request's blocks.

Tiny Gemma 3 (4 layers: local, global, local, global; window 16; blocks of 16): one request of
300 prompt tokens in chunks of 64, then 40 decoded tokens. With the hybrid manager the two
local layers form one group that holds at most cdiv(15 + 64, 16) + 1 = 6 blocks while a chunk
runs and cdiv(15, 16) + 1 = 2 while decoding; the two global layers hold cdiv(tokens, 16).
Without it (every layer kept as full attention) one group of 4 layers holds cdiv(tokens, 16).
"""

from __future__ import annotations

import pytest
from engine_utils import trace_held_blocks

from minivllm.utils import cdiv

PROMPT_LEN, MAX_TOKENS, WINDOW, CHUNK = 300, 40, 16, 64


def _trace(llm) -> list[tuple[int, list[tuple[int, int]]]]:
    return trace_held_blocks(llm, list(range(1000, 1000 + PROMPT_LEN)), MAX_TOKENS)


@pytest.fixture
def gemma3_dir(make_tiny_model):
    return make_tiny_model("gemma3", head_dim=64, num_hidden_layers=4,
                           layer_types=["sliding_attention", "full_attention"] * 2)


def test_window_layers_keep_only_their_window(gemma3_dir, make_llm, monkeypatch):
    monkeypatch.setenv("MINIVLLM_ENABLE_MULTIPROCESSING", "0")
    hybrid = _trace(make_llm(gemma3_dir, dtype="float32", max_num_batched_tokens=CHUNK))
    monkeypatch.setenv("MINIVLLM_ENABLE_MULTIPROCESSING", "0")
    full = _trace(make_llm(gemma3_dir, dtype="float32", max_num_batched_tokens=CHUNK,
                           disable_hybrid_kv_cache_manager=True))
    assert [n for n, _ in hybrid] == [n for n, _ in full]
    for (computed, groups), (_, (full_only,)) in zip(hybrid, full, strict=True):
        (window_blocks, window_layers), (global_blocks, global_layers) = groups
        assert (window_layers, global_layers, full_only[1]) == (2, 2, 4)
        assert global_blocks == full_only[0] == cdiv(computed, 16)
        bound = cdiv(WINDOW - 1, 16) + 1 if computed > PROMPT_LEN else cdiv(WINDOW - 1 + CHUNK, 16) + 1
        assert window_blocks <= bound, (computed, window_blocks)
    # The last step before the request finishes: 338 tokens in 22 blocks per global layer and 2
    # per local layer, against 22 per layer: 48 layer-blocks instead of 88.
    computed, ((window_blocks, _), (global_blocks, _)) = hybrid[-1]
    assert (computed, window_blocks, global_blocks) == (PROMPT_LEN + MAX_TOKENS - 2, 2, 22)


def test_8k_request_in_gemma3_270m_layout(make_tiny_model, make_llm, monkeypatch):
    """Gemma 3 270M's layers (18: five local ones, window 512, before each global one) at tiny
    widths. Blocks of 16 tokens; 8001 tokens computed: 501 blocks for each of the 3 global layers,
    and per local layer at most the window's 511 tokens and the new one: 33 blocks. Counted in
    layer-blocks (blocks x layers of the group), against 501 for every layer without the hybrid
    manager (printed for the closing note: pytest -s)."""
    model_dir = make_tiny_model("gemma3", num_hidden_layers=18, sliding_window=512, max_position_embeddings=8192,
                                layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3)
    prompt = list(range(1000, 9000))
    counts = {}
    for hybrid in (True, False):
        monkeypatch.setenv("MINIVLLM_ENABLE_MULTIPROCESSING", "0")
        llm = make_llm(model_dir, dtype="float32", max_model_len=8192, max_num_batched_tokens=2048,
                       disable_hybrid_kv_cache_manager=not hybrid)
        counts[hybrid] = next(held for computed, held in trace_held_blocks(llm, prompt, 3) if computed > len(prompt))
    *local, (global_blocks, global_layers) = counts[True]
    assert [layers for _, layers in local] == [3] * 5 and global_layers == 3
    assert global_blocks == cdiv(len(prompt) + 1, 16) == 501
    assert all(blocks <= cdiv(512 - 1, 16) + 1 for blocks, _ in local), local
    ((full_blocks, full_layers),) = counts[False]
    assert (full_blocks, full_layers) == (501, 18)
    hybrid_layer_blocks = sum(blocks * layers for blocks, layers in counts[True])
    print(f"\n8k request, layer-blocks held: hybrid {hybrid_layer_blocks}, every layer full "
          f"{full_blocks * full_layers} ({full_blocks * full_layers / hybrid_layer_blocks:.2f}x); "
          f"groups (blocks, layers): {counts[True]} vs {counts[False]}")
