"""The real SmolLM2-135M at tensor_parallel_size=2: its 3 KV heads split 2 + 1. float32 against
transformers' import of the same GGUF file; bfloat16, where each rank runs the Q4_1 kernel on
its rows (q/k/v, gate/up) or columns (o_proj, down_proj) of the file's codes and the Q8_0
lm_head on its vocabulary rows, against the same engine at TP=1."""

from __future__ import annotations

from engine_utils import generate_greedy, make_prompts
from reference import check_logprobs_close


def test_smollm2_tp2_float32_matches_hf(smollm2_gguf, smollm2_hf_greedy, make_llm):
    llm = make_llm(smollm2_gguf, dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=256)
    prompts, reference = smollm2_hf_greedy
    outputs = generate_greedy(llm, prompts)
    check_logprobs_close(outputs_0=reference, outputs_1=outputs, name_0="hf", name_1="tp2")
    exact = sum(ours[0] == ref[0] for ours, ref in zip(outputs, reference, strict=True))
    assert exact >= len(prompts) - 2, f"only {exact}/{len(prompts)} sequences identical"


def test_smollm2_tp2_bfloat16_quantized_shards_match_tp1(smollm2_gguf, make_llm):
    """Four prompts: decode steps of at most 8 rows take the quantized kernels."""
    tp1 = make_llm(smollm2_gguf, dtype="bfloat16")
    prompts = make_prompts(tp1.get_tokenizer(), 49152, seed=2)[:4]
    expected = generate_greedy(tp1, prompts)
    tp2 = make_llm(smollm2_gguf, dtype="bfloat16", tensor_parallel_size=2)
    check_logprobs_close(outputs_0=expected, outputs_1=generate_greedy(tp2, prompts), name_0="tp1", name_1="tp2")
