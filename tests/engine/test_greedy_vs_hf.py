"""Greedy output equals Hugging Face transformers' for the same weights (fp32).

Every engine configuration (default batching, forced chunked prefill, forced preemption, one
sequence at a time) is checked against the same unbatched HF reference, with vLLM's criterion:
tokens equal up to the first mismatch, and there each side's token is in the other's top-5.
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

ENGINE_VARIANTS = {
    "default": {},
    # Chunks cut by the budget, by the per-request cap and by a 3 ms step-time budget (once the
    # cost model has seen its first steps), two prompts advancing side by side, decodes first.
    "chunked_prefill": {"max_num_batched_tokens": 48, "long_prefill_token_threshold": 20,
                        "max_num_partial_prefills": 2, "max_step_ms": 3},
    "max_num_seqs_1": {"max_num_seqs": 1},
    # 30 usable blocks of 16 tokens: every request fits alone (max_model_len 400), all together
    # do not, so running requests must be preempted and recomputed.
    "preemption": {"num_gpu_blocks_override": 31, "max_model_len": 400},
}


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "llama_tied_llama3_rope", "llama_head_dim_64"])
def tiny_case(request, make_tiny_model):
    """head_dim 16 runs the torch reference attention; head_dim 64 the C++ CPU kernels."""
    if request.param == "llama_head_dim_64":
        model_dir = make_tiny_model("llama", head_dim=64)
    elif request.param == "llama_tied_llama3_rope":
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
        model_dir = make_tiny_model("llama", tie_word_embeddings=True, rope_scaling=rope)
    else:
        model_dir = make_tiny_model(request.param)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = make_prompts(tokenizer, tokenizer.vocab_size)
    reference = [r.as_output() for r in hf_greedy(model_dir, prompts, MAX_NEW_TOKENS)]
    return model_dir, prompts, reference


@pytest.mark.parametrize("variant", list(ENGINE_VARIANTS))
def test_tiny_models_match_hf(tiny_case, make_llm, variant):
    model_dir, prompts, reference = tiny_case
    llm = make_llm(model_dir, dtype="float32", **ENGINE_VARIANTS[variant])
    outputs = generate_greedy(llm, prompts)
    check_logprobs_close(outputs_0=reference, outputs_1=outputs, name_0="hf", name_1=f"minivllm[{variant}]")
    if variant == "preemption":
        assert num_preemptions(llm) > 0, "the small KV cache should have forced preemption"
    # Every block is back in the pool once all requests have finished.
    assert_engine_idle(llm)


def test_torch_path_matches_hf(tiny_case, make_llm, monkeypatch):
    """With the C++ CPU kernels turned off, every layer and the attention take their torch
    path, which must match transformers just the same."""
    monkeypatch.setenv("MINIVLLM_CPU_KERNELS", "0")
    model_dir, prompts, reference = tiny_case
    llm = make_llm(model_dir, dtype="float32")
    check_logprobs_close(outputs_0=reference, outputs_1=generate_greedy(llm, prompts), name_0="hf", name_1="minivllm[torch]")


def test_smollm2_gguf_matches_hf(smollm2_gguf, smollm2_hf_greedy, make_llm):
    """The real SmolLM2-135M-Instruct, loaded by minivllm from the GGUF file, against
    transformers' own GGUF import of the same file."""
    llm = make_llm(smollm2_gguf, dtype="float32", max_num_batched_tokens=256)
    prompts, reference = smollm2_hf_greedy
    outputs = generate_greedy(llm, prompts)
    check_logprobs_close(outputs_0=reference, outputs_1=outputs, name_0="hf", name_1="minivllm")
    # Most real prompts should agree exactly, not just within the near-tie criterion.
    exact = sum(ours[0] == ref[0] for ours, ref in zip(outputs, reference, strict=True))
    assert exact >= len(prompts) - 2, f"only {exact}/{len(prompts)} sequences identical"
