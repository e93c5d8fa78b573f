"""Speculative decoding on the real SmolLM2-135M-Instruct in float32: greedy output token for token
that of the engine without speculation, with n-gram lookup and with the model's own Q4_1 GGUF as
a bfloat16 drafter (the quantized self-drafter), on prompts where lookup hits (asking for a code
file back) and misses (free answers), with chunked prefill (64-token steps), prefix caching
(shared system prompt) and preemption (a small cache) forced."""

from __future__ import annotations

import pytest
from engine_utils import assert_engine_idle

from minivllm import SamplingParams

CODE = '''def mean(values):
    """The arithmetic mean of a non-empty list."""
    return sum(values) / len(values)


def variance(values):
    m = mean(values)
    return sum((v - m) ** 2 for v in values) / len(values)
'''
SYSTEM = {"role": "system", "content": "You are a careful assistant who answers briefly."}
QUESTIONS = [
    f"Copy this code exactly, but rename the function mean to average:\n\n{CODE}",
    "What is the boiling point of water at sea level?",
    f"Repeat the following code:\n\n{CODE}",
    "Name three colours of the rainbow.",
]
ENGINE = {"dtype": "float32", "max_model_len": 384}
STRESS = {"max_num_batched_tokens": 64, "num_gpu_blocks_override": 26}


def conversations():
    return [[SYSTEM, {"role": "user", "content": q}] for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference(smollm2_gguf, make_module_llm):
    llm = make_module_llm(smollm2_gguf, **ENGINE)
    return [o.outputs[0].token_ids for o in llm.chat(conversations(), greedy(), use_tqdm=False)]


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=96)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_output_is_unchanged(smollm2_gguf, make_llm, reference, method):
    if method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    else:
        spec = {"method": "draft_model", "model": str(smollm2_gguf), "num_speculative_tokens": 4,
                "dtype": "bfloat16"}
    llm = make_llm(smollm2_gguf, speculative_config=spec, **ENGINE, **STRESS)
    outputs = llm.chat(conversations(), greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    stats = llm.llm_engine.get_scheduler_stats()
    acceptance = stats.spec_decoding.num_accepted_tokens / stats.spec_decoding.num_draft_tokens
    assert acceptance > (0.3 if method == "ngram" else 0.8), stats.spec_decoding
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert_engine_idle(llm)
