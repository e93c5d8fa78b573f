"""The real Gemma 3 270M (GGUF Q4_K_M: Q4_K, Q5_0, Q6_K, Q8_0 and F32 tensors) against
transformers' Gemma3ForCausalLM loaded from the same file, float32, vLLM's logprob criterion.

Prompts shorter and far longer than the 512-token window (up to 8000 tokens), batched; then
chunked at 384 tokens (chunks straddle the window's edge), preempted by a small cache, and run
again from the prefix cache. (The KV blocks an 8000-token request holds in this layout:
test_hybrid_kv_memory.py.)
"""

from __future__ import annotations

import random

import pytest
from engine_utils import assert_engine_idle, num_preemptions
from reference import check_logprobs_close, hf_greedy

from minivllm import SamplingParams

MAX_NEW_TOKENS = 8
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
TEXT = ("The Gemma models are lightweight open models. Local layers attend to the last 512 tokens "
        "and every sixth layer attends to the whole context, which keeps the KV cache small.")
# Long prompts: random pieces of the vocabulary (past its control and markup tokens), after BOS.
LONG_LENGTHS = (1500, 2500, 8000)


def _prompts(tokenizer) -> dict[str, list[int]]:
    rng = random.Random(0)
    prompts = {
        "chat": tokenizer.encode(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False),
                                 add_special_tokens=False),
        "text": tokenizer.encode(TEXT),
    }
    for n in LONG_LENGTHS:
        prompts[f"random_{n}"] = [2] + [rng.randrange(1000, 200000) for _ in range(n - 1)]
    return prompts


@pytest.fixture(scope="module")
def reference_outputs(gemma3_gguf, gemma3_hf_model):
    """transformers' greedy tokens and top-5 logprobs for every prompt."""
    from minivllm.transformers_utils.tokenizer import get_tokenizer

    prompts = _prompts(get_tokenizer(str(gemma3_gguf)))
    # Prefilled in chunks of 1024 (transformers' own chunked prefill): its sliding-window layers
    # then attend to their windows, not to the whole 8000 tokens (33 -> 18 s for that prompt).
    results = hf_greedy(gemma3_hf_model, list(prompts.values()), MAX_NEW_TOKENS, prefill_chunk=1024)
    outputs = dict(zip(prompts, (r.as_output() for r in results), strict=True))
    return prompts, outputs


def _check(llm, prompts, reference, names, label):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=5)
    results = llm.generate([{"prompt_token_ids": prompts[n]} for n in names], params, use_tqdm=False)
    check_logprobs_close(outputs_0=[reference[n] for n in names],
                         outputs_1=[(r.outputs[0].token_ids, r.outputs[0].logprobs) for r in results],
                         name_0="hf", name_1=label)


def test_batched_up_to_8k_tokens_matches_hf(gemma3_gguf, reference_outputs, make_llm):
    prompts, reference = reference_outputs
    llm = make_llm(gemma3_gguf, dtype="float32", max_model_len=8192)
    _check(llm, prompts, reference, ["chat", "text", "random_1500", "random_8000"], "minivllm")
    assert_engine_idle(llm)


def test_chunked_preempted_and_cached_matches_hf(gemma3_gguf, reference_outputs, make_llm):
    """A request of 2600 tokens holds at most 163 blocks of the global group and 57 in each of
    the five window groups (chunks of 384 and the 511 tokens before them, plus one): 448. In 460
    blocks the two long prompts cannot run together."""
    prompts, reference = reference_outputs
    names = ["chat", "text", "random_1500", "random_2500"]
    llm = make_llm(gemma3_gguf, dtype="float32", max_model_len=2600, max_num_batched_tokens=384,
                   num_gpu_blocks_override=460, enable_prefix_caching=True)
    _check(llm, prompts, reference, names, "minivllm[chunked, preempted]")
    assert num_preemptions(llm) > 0
    _check(llm, prompts, reference, names, "minivllm[cached]")
    assert llm.llm_engine.get_scheduler_stats().prefix_cache_hits > 0
    assert_engine_idle(llm)
