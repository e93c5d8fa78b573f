"""Models with sliding-window layers give transformers' greedy output (fp32, vLLM's logprob
criterion) through the hybrid KV cache: Gemma 3 (local and global layers, their own rotary bases),
Mistral (every layer windowed) and Qwen2 with use_sliding_window (layers from max_window_layers).

Prompts of 1 to 300 tokens against windows of 16-24 tokens: most of each request's KV falls out
of the window, whose blocks go back to the pool while the request runs. Variants: chunks that
straddle the window's edge, preemption with prefix caching (requests resume at a hit whose window
blocks are cached and whose earlier blocks are the null block), and the same prompts again
(every request starts at a prefix cache hit).
"""

from __future__ import annotations

import pytest
from engine_utils import (
    MAX_NEW_TOKENS,
    assert_engine_idle,
    generate_greedy,
    make_prompts,
    num_preemptions,
)
from reference import check_logprobs_close, hf_greedy

CASES = {
    # head_dim 64: the C++ kernels; 16: the torch reference backend.
    "gemma3": dict(arch="gemma3", head_dim=64, num_hidden_layers=4, final_logit_softcapping=3.0,
                   layer_types=["sliding_attention", "full_attention"] * 2),
    "mistral": dict(arch="mistral", sliding_window=24),
    "qwen2": dict(arch="qwen2", use_sliding_window=True, sliding_window=20, max_window_layers=1),
}
# A request of max_model_len 340 holds at most 22 blocks in a full group and 6 in a window
# group (steps of 64 tokens): the caches below fit the longest prompts one or two at a time.
PREEMPTION_BLOCKS = {"gemma3": 60, "mistral": 12, "qwen2": 60}


def _variant(name: str, case_name: str) -> dict:
    if name == "chunked":
        return {"max_num_batched_tokens": 24}
    return {"num_gpu_blocks_override": PREEMPTION_BLOCKS[case_name], "max_model_len": 340,
            "max_num_batched_tokens": 64, "enable_prefix_caching": True}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, make_tiny_model):
    kwargs = dict(CASES[request.param])
    model_dir = make_tiny_model(kwargs.pop("arch"), **kwargs)
    from transformers import AutoTokenizer

    prompts = make_prompts(AutoTokenizer.from_pretrained(model_dir), 49152)
    reference = [r.as_output() for r in hf_greedy(model_dir, prompts, MAX_NEW_TOKENS)]
    return request.param, model_dir, prompts, reference


@pytest.mark.parametrize("variant", ["chunked", "preemption_prefix_caching"])
def test_sliding_window_models_match_hf(case, make_llm, variant):
    name, model_dir, prompts, reference = case
    llm = make_llm(model_dir, dtype="float32", **_variant(variant, name))
    outputs = generate_greedy(llm, prompts)
    check_logprobs_close(outputs_0=reference, outputs_1=outputs, name_0="hf", name_1=f"minivllm[{variant}]")
    if name == "gemma3":
        _check_logprob_values(reference, outputs)
    if variant == "preemption_prefix_caching":
        assert num_preemptions(llm) > 0, "the small KV cache should have forced preemption"
        # Again, every prompt now cached: each request starts at a hit (null blocks before its
        # window, cached blocks in it) and still computes the same tokens.
        check_logprobs_close(outputs_0=reference, outputs_1=generate_greedy(llm, prompts),
                             name_0="hf", name_1="minivllm[cached]")
        assert llm.llm_engine.get_scheduler_stats().prefix_cache_hits > 0
    assert_engine_idle(llm)


def test_gemma3_with_ngram_drafts_over_two_ranks(make_tiny_model, make_llm):
    """Speculative decoding (drafts verified in the window layers too, rejected slots trimmed
    in every group) under tensor parallelism (each rank's share of the hybrid cache)."""
    kwargs = dict(CASES["gemma3"])
    model_dir = make_tiny_model(kwargs.pop("arch"), **kwargs)
    from transformers import AutoTokenizer

    prompts = make_prompts(AutoTokenizer.from_pretrained(model_dir), 49152, seed=2)[4:]
    reference = [r.as_output() for r in hf_greedy(model_dir, prompts, MAX_NEW_TOKENS)]
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = make_llm(model_dir, dtype="float32", tensor_parallel_size=2, speculative_config=ngram,
                   max_num_batched_tokens=40)
    check_logprobs_close(outputs_0=reference, outputs_1=generate_greedy(llm, prompts),
                         name_0="hf", name_1="minivllm[ngram, tp=2]")
    assert llm.llm_engine.get_scheduler_stats().spec_decoding.num_drafts > 0
    assert_engine_idle(llm)


def _check_logprob_values(reference, outputs) -> None:
    """The first token's top logprobs equal transformers' in value, not only in rank: Gemma's
    final soft-capping (tanh(logits / 3) * 3 here) reshapes the distribution without moving its
    argmax, so only the values show it."""
    for (_, ref_logprobs), (_, logprobs) in zip(reference, outputs, strict=True):
        first = {token: lp.logprob for token, lp in logprobs[0].items()}
        shared = first.keys() & ref_logprobs[0].keys()  # the top 5 may differ at a near tie
        assert len(shared) >= 4
        for token in shared:
            assert first[token] == pytest.approx(ref_logprobs[0][token], abs=1e-3)
