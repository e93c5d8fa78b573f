"""Automatic prefix caching end to end: same outputs with caching on and off, and the stats show
exactly the shared full blocks were reused."""

from __future__ import annotations

import random

import pytest
from engine_utils import assert_engine_idle
from reference import check_logprobs_close

from minivllm import LLM, SamplingParams
from minivllm.transformers_utils.tokenizer import load_gguf_tokenizer

BLOCK = 16


def metric(llm: LLM, name: str, **labels) -> float:
    for m in llm.get_metrics():
        if m.name == name and all(m.labels.get(k) == v for k, v in labels.items()):
            return m.value
    raise KeyError(name)


def common_blocks(a: list[int], b: list[int]) -> int:
    """Full blocks shared by two prompts, never all of b's tokens (one must be computed)."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return min(n, len(b) - 1) // BLOCK


def run(make_llm, model: str, prompts, params, **kwargs):
    llm = make_llm(model, dtype="float32", **kwargs)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return llm, outs


def shared_prefix_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(3, vocab) for _ in range(500)]
    return [system + [rng.randrange(3, vocab) for _ in range(n)] for n in (7, 30, 1, 64, 16)]


def check_same_outputs_and_hits(make_llm, model: str, prompts: list[list[int]], exact: bool) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)
    off, outs_off = run(make_llm, model, prompts, params, enable_prefix_caching=False)
    on, outs_on = run(make_llm, model, prompts, params)
    results_off = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs_off]
    results_on = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs_on]
    if exact:
        assert [r[0] for r in results_on] == [r[0] for r in results_off]
    else:
        check_logprobs_close(outputs_0=results_off, outputs_1=results_on, name_0="no-cache", name_1="cache")
    expected_hits = sum(common_blocks(prompts[0], p) for p in prompts[1:]) * BLOCK
    assert metric(on, "vllm:prefix_cache_hits") == expected_hits
    assert metric(on, "vllm:prefix_cache_queries") == sum(len(p) for p in prompts)
    assert metric(off, "vllm:prefix_cache_hits") == 0
    # Exactly the shared full blocks were not prefilled again.
    computed_off = metric(off, "minivllm:computed_tokens")
    assert computed_off - metric(on, "minivllm:computed_tokens") == expected_hits
    assert [o.num_cached_tokens for o in outs_on] == [0] + [common_blocks(prompts[0], p) * BLOCK for p in prompts[1:]]
    assert_engine_idle(on)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_shared_system_prompt_random_model(make_tiny_model, make_llm, arch):
    check_same_outputs_and_hits(make_llm, str(make_tiny_model(arch)), shared_prefix_prompts(49152), exact=True)


def test_shared_system_prompt_smollm2(smollm2_gguf, make_llm):
    tok = load_gguf_tokenizer(str(smollm2_gguf))
    system = " ".join(f"Rule {i}: answer politely and cite source number {i * 7}." for i in range(40))
    questions = ["What is the capital of France?", "Name a prime number.", "Say hi.", "Count to three."]
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}],
                                           add_generation_prompt=True, tokenize=False))
        for q in questions
    ]
    assert min(common_blocks(prompts[0], p) for p in prompts[1:]) * BLOCK >= 500
    check_same_outputs_and_hits(make_llm, str(smollm2_gguf), prompts, exact=True)


def test_second_call_reuses_first(make_tiny_model, make_llm):
    """A prefix computed by an earlier generate call (its request long finished) is reused."""
    model = str(make_tiny_model("llama"))
    prompts = shared_prefix_prompts(49152, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = make_llm(model, dtype="float32")
    first = llm.generate([prompts[0]], params, use_tqdm=False)[0]
    again = llm.generate([prompts[0]], params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == (len(prompts[0]) - 1) // BLOCK * BLOCK
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.reset_prefix_cache()
    assert llm.generate([prompts[0]], params, use_tqdm=False)[0].num_cached_tokens == 0


def test_cache_salt_separates_users(make_tiny_model, make_llm):
    llm = make_llm(make_tiny_model("llama"), dtype="float32")
    prompt = list(range(100, 200))
    params = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate([{"prompt_token_ids": prompt, "cache_salt": "alice"}], params, use_tqdm=False)
    bob = llm.generate([{"prompt_token_ids": prompt, "cache_salt": "bob"}], params, use_tqdm=False)[0]
    alice = llm.generate([{"prompt_token_ids": prompt, "cache_salt": "alice"}], params, use_tqdm=False)[0]
    assert bob.num_cached_tokens == 0 and alice.num_cached_tokens == 96


def test_n_children_share_the_prompt(make_tiny_model, make_llm):
    llm = make_llm(make_tiny_model("llama"), dtype="float32")
    prompt = list(range(1000, 1000 + 90))
    out = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, max_tokens=5, seed=1), use_tqdm=False)[0]
    assert len(out.outputs) == 4
    # Children are admitted in the same step; 3 of them reuse the first one's 5 full blocks.
    assert metric(llm, "vllm:prefix_cache_hits") == 3 * 5 * BLOCK


def test_eviction_under_pressure(make_tiny_model, make_llm):
    """Many distinct prefixes through a small cache: old prefixes are evicted, outputs stay
    right, nothing leaks."""
    model = str(make_tiny_model("qwen2"))
    rng = random.Random(5)
    prefixes = [[rng.randrange(3, 49152) for _ in range(64)] for _ in range(12)]
    prompts = [p + [rng.randrange(3, 49152) for _ in range(9)] for p in prefixes for _ in range(2)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=5)
    small = dict(num_gpu_blocks_override=24, max_model_len=256)
    _, ref = run(make_llm, model, prompts, params, enable_prefix_caching=False, **small)
    llm = make_llm(model, dtype="float32", **small)
    outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    check_logprobs_close(
        outputs_0=[(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in ref],
        outputs_1=[(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs],
        name_0="no-cache", name_1="cache",
    )
    # Each prompt's twin, run right after it, hits its 4 prefix blocks.
    assert [o.num_cached_tokens for o in outs[1::2]] == [64] * 12
    # The first prefix was evicted long ago by the eleven others (23 usable blocks).
    assert llm.generate([prompts[0]], params, use_tqdm=False)[0].num_cached_tokens == 0
    assert_engine_idle(llm)


def test_metrics_names(make_tiny_model, make_llm):
    llm = make_llm(make_tiny_model("llama"), dtype="float32", num_gpu_blocks_override=97)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    names = {m.name for m in llm.get_metrics()}
    # vLLM's gauge whose labels tell a tool how many tokens the cache holds (bench soak's warm-up).
    [info] = [m.labels for m in llm.get_metrics() if m.name == "vllm:cache_config_info"]
    assert {k: info[k] for k in ("block_size", "num_gpu_blocks", "enable_prefix_caching")} == {
        "block_size": "16", "num_gpu_blocks": "97", "enable_prefix_caching": "True"}
    assert "model_name" in info
    assert {"vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_requests_running",
            "vllm:kv_cache_usage_perc", "vllm:prompt_tokens", "vllm:generation_tokens"} <= names
    assert metric(llm, "vllm:generation_tokens") == 4 and metric(llm, "vllm:prompt_tokens") == 3
    assert metric(llm, "vllm:request_success", finished_reason="length") == 1
