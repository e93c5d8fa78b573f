"""Speculative decoding end to end on a tiny random model in float32: the output is that of the
same engine without speculation (greedy, token for token, with every sampling feature), in the
engine process, with chunked prefill, prefix caching, preemption and structured output, and the
KV cache is idle after every test."""

from __future__ import annotations

import re

import pytest
from eagle_heads import eagle1_checkpoint, eagle3_checkpoint, write_hf
from engine_utils import assert_engine_idle, num_preemptions

from minivllm import LLM, SamplingParams
from minivllm.sampling_params import StructuredOutputsParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# Repeated text makes lookup hit; a random model over a vocabulary of 128 tokens also falls into
# loops of its own (over SmolLM2's 49k tokens, it never repeats itself).
PROMPTS = [
    [5, 6, 7, 8] * 6,
    list(range(40, 100)),
    [42, 43] * 10 + [44],
    list(range(60, 100)) + list(range(60, 90)),
]
ENGINE = {"dtype": "float32", "max_model_len": 256}


@pytest.fixture(scope="module")
def model_dir(make_tiny_model):
    return make_tiny_model("llama", vocab_size=128)


@pytest.fixture(scope="module")
def base(model_dir, make_module_llm) -> LLM:
    return make_module_llm(model_dir, **ENGINE)


@pytest.fixture(scope="module")
def spec(model_dir, make_module_llm) -> LLM:
    return make_module_llm(model_dir, speculative_config=NGRAM, **ENGINE)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 40, "ignore_eos": True, **kw})


def generate(llm: LLM, params, prompts=PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_greedy_output_is_unchanged_and_drafts_are_accepted(base, spec):
    before = spec.llm_engine.get_scheduler_stats().spec_decoding
    assert generate(spec, greedy()) == generate(base, greedy())
    after = spec.llm_engine.get_scheduler_stats().spec_decoding
    assert after.num_drafts > before.num_drafts
    assert after.num_accepted_tokens > before.num_accepted_tokens
    assert_engine_idle(spec)


@pytest.mark.parametrize("params", [
    greedy(repetition_penalty=1.4),
    greedy(frequency_penalty=0.6, presence_penalty=0.4),
    greedy(logit_bias={50: 4.0, 51: -100.0}),
    greedy(bad_words=["12"]),
], ids=["repetition", "frequency-presence", "logit-bias", "bad-words"])
def test_sampling_features_give_the_same_tokens(base, spec, params):
    assert generate(spec, params) == generate(base, params)
    assert_engine_idle(spec)


def test_stops_inside_an_accepted_run_and_max_tokens(base, spec):
    reference = generate(base, greedy())
    for prompt, ref in zip(PROMPTS, reference, strict=True):
        stop_id = ref[5]  # a token the greedy run emits at index 5 (maybe earlier too)
        first = ref.index(stop_id)
        for params in (greedy(stop_token_ids=[stop_id]), greedy(stop_token_ids=[stop_id], min_tokens=first + 2)):
            ours, = generate(spec, params, [prompt])
            assert ours == generate(base, params, [prompt])[0]
            assert ours[-1] == stop_id or len(ours) == 40
    for max_tokens in (1, 2, 5, 17):
        outputs = generate(spec, greedy(max_tokens=max_tokens))
        assert outputs == [ref[:max_tokens] for ref in reference]
    assert_engine_idle(spec)


def test_stop_strings_and_text(base, spec):
    ref = base.generate(PROMPTS, greedy(), use_tqdm=False)
    stops = [o.outputs[0].text[len(o.outputs[0].text) // 2:][:3] for o in ref]
    for prompt, stop in zip(PROMPTS, stops, strict=True):
        if not stop.strip():
            continue
        ours = spec.generate([prompt], greedy(stop=[stop]), use_tqdm=False)[0].outputs[0]
        theirs = base.generate([prompt], greedy(stop=[stop]), use_tqdm=False)[0].outputs[0]
        assert (ours.text, ours.token_ids, ours.finish_reason) == (theirs.text, theirs.token_ids, theirs.finish_reason)


def test_logprobs_of_the_emitted_tokens(base, spec):
    params = greedy(logprobs=3, max_tokens=24)
    ours = spec.generate(PROMPTS, params, use_tqdm=False)
    theirs = base.generate(PROMPTS, params, use_tqdm=False)
    for a, b in zip(ours, theirs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pos_a, pos_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert pos_a.keys() == pos_b.keys()
            for token_id in pos_a:
                assert pos_a[token_id].logprob == pytest.approx(pos_b[token_id].logprob, abs=1e-4)
                assert pos_a[token_id].rank == pos_b[token_id].rank


def test_seeded_sampling_repeats_and_n(spec):
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=30, ignore_eos=True, seed=11, n=3)
    first = spec.generate(PROMPTS[:2], params, use_tqdm=False)
    second = spec.generate(PROMPTS[:2], params, use_tqdm=False)
    for a, b in zip(first, second, strict=True):
        assert len(a.outputs) == 3
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        assert all(len(c.token_ids) == 30 for c in a.outputs)
    assert_engine_idle(spec)


def test_structured_output_with_drafts(make_tiny_model, make_llm):
    """Over the full vocabulary (what the grammar backends need); the grammar makes the output
    repeat, so lookup hits."""
    model = make_tiny_model("llama")
    base, spec = make_llm(model, **ENGINE), make_llm(model, speculative_config=NGRAM, **ENGINE)
    params = [
        greedy(structured_outputs=StructuredOutputsParams(regex=r"(ab|cd){3,8}x"), ignore_eos=False),
        greedy(structured_outputs=StructuredOutputsParams(choice=["yes yes yes", "no no no"]), ignore_eos=False),
    ]
    for p in params:
        ours = spec.generate(PROMPTS, p, use_tqdm=False)
        theirs = base.generate(PROMPTS, p, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in theirs]
    assert all(re.fullmatch(r"(ab|cd){3,8}x", o.outputs[0].text) for o in spec.generate(PROMPTS, params[0]))
    assert spec.llm_engine.get_scheduler_stats().spec_decoding.num_accepted_tokens > 0
    assert_engine_idle(spec)


def test_chunked_prefill_prefix_caching_and_preemption(model_dir, make_llm, base):
    """A small token budget chunks every prompt, a small cache preempts, shared prefixes hit."""
    prompts = PROMPTS + [PROMPTS[1] + [7, 8, 9], PROMPTS[3][:50] + [1, 2]]
    llm = make_llm(model_dir, speculative_config=NGRAM, max_num_batched_tokens=32, num_gpu_blocks_override=18,
                   **ENGINE)
    params = greedy(max_tokens=60)
    assert generate(llm, params, prompts) == generate(base, params, prompts)
    assert num_preemptions(llm) > 0
    assert llm.llm_engine.get_scheduler_stats().prefix_cache_hits > 0
    assert_engine_idle(llm)


def test_metrics_under_vllm_names(spec):
    generate(spec, greedy(max_tokens=10))
    stats = spec.llm_engine.get_scheduler_stats().spec_decoding
    metrics = {(m.name, m.labels.get("position")): m.value for m in spec.get_metrics()
               if m.name.startswith("vllm:spec_decode")}
    assert metrics[("vllm:spec_decode_num_drafts", None)] == stats.num_drafts > 0
    assert metrics[("vllm:spec_decode_num_draft_tokens", None)] == stats.num_draft_tokens
    assert metrics[("vllm:spec_decode_num_accepted_tokens", None)] == stats.num_accepted_tokens
    per_pos = [metrics[("vllm:spec_decode_num_accepted_tokens_per_pos", str(p))] for p in range(3)]
    assert per_pos == stats.num_accepted_tokens_per_pos
    # Position j counts drafts with their first j + 1 tokens accepted: it cannot grow with j.
    assert per_pos[0] >= per_pos[1] >= per_pos[2] and sum(per_pos) == stats.num_accepted_tokens


@pytest.mark.parametrize("drafter", ["itself-bfloat16", "another-model"])
def test_draft_model_gives_the_same_tokens(model_dir, make_tiny_model, make_llm, base, drafter):
    """The target drafting for itself in bfloat16 (its own dtype: KV pages of another dtype in the
    same blocks; most drafts accepted) and a model of other weights (most rejected), with chunked
    prefill, prefix caching and preemption."""
    if drafter == "itself-bfloat16":
        spec = {"model": str(model_dir), "num_speculative_tokens": 3, "dtype": "bfloat16"}
    else:
        spec = {"method": "draft_model", "model": str(make_tiny_model("llama", vocab_size=128, seed=1)),
                "num_speculative_tokens": 2}
    prompts = PROMPTS + [PROMPTS[1] + [7, 8, 9]]
    llm = make_llm(model_dir, speculative_config=spec, max_num_batched_tokens=32, num_gpu_blocks_override=24,
                   **ENGINE)
    for params in (greedy(max_tokens=50), greedy(max_tokens=30, repetition_penalty=1.3, logprobs=2)):
        ours = llm.generate(prompts, params, use_tqdm=False)
        theirs = base.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in theirs]
    stats = llm.llm_engine.get_scheduler_stats()
    accepted = stats.spec_decoding.num_accepted_tokens / stats.spec_decoding.num_draft_tokens
    # (Not higher: the drafter does not apply the repetition penalty the target does.)
    assert accepted > 0.7 if drafter == "itself-bfloat16" else accepted < 0.5
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    # One request alone: its prompt takes steps where nobody samples, whose tokens the drafter
    # must run all the same (its KV would miss them, and its drafts would mostly be rejected).
    before = stats.spec_decoding
    prompt = [list(range(10, 110))]
    assert generate(llm, greedy(max_tokens=40), prompt) == generate(base, greedy(max_tokens=40), prompt)
    after = llm.llm_engine.get_scheduler_stats().spec_decoding
    accepted = (after.num_accepted_tokens - before.num_accepted_tokens) / (after.num_draft_tokens - before.num_draft_tokens)
    assert accepted > 0.85 if drafter == "itself-bfloat16" else accepted < 0.5
    assert_engine_idle(llm)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_heads_give_the_same_tokens(make_tiny_model, make_llm, tmp_path, method):
    """Random heads written in the published layouts (so most drafts are rejected: exactness is
    what this checks), over a 4-layer target (EAGLE-3 reads three of its layers), with chunked
    prefill, prefix caching and preemption."""
    target = make_tiny_model("llama", vocab_size=128, num_hidden_layers=4)
    if method == "eagle":
        config, tensors = eagle1_checkpoint(num_layers=1, fc_bias=False, vocab=128)
    else:
        config, tensors = eagle3_checkpoint(vocab=128, draft_vocab=64)
    head = write_hf(tmp_path / method, config, tensors)
    spec = {"method": method, "model": str(head), "num_speculative_tokens": 3}
    prompts = PROMPTS + [PROMPTS[1] + [7, 8, 9]]
    base = make_llm(target, **ENGINE)
    llm = make_llm(target, speculative_config=spec, max_num_batched_tokens=32, num_gpu_blocks_override=24, **ENGINE)
    for params in (greedy(max_tokens=50), greedy(max_tokens=30, repetition_penalty=1.3, logprobs=2)):
        assert generate(llm, params, prompts) == generate(base, params, prompts)
    stats = llm.llm_engine.get_scheduler_stats()
    assert stats.spec_decoding.num_draft_tokens > 100
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert_engine_idle(llm)


def test_eagle_head_of_another_hidden_size_is_refused(make_tiny_model, make_llm, tmp_path):
    target = make_tiny_model("llama", vocab_size=128, hidden_size=32, head_dim=8)
    head = write_hf(tmp_path / "head", *eagle1_checkpoint(num_layers=1, fc_bias=False, vocab=128))
    with pytest.raises(Exception, match="hidden_size 64 does not match the target's hidden size 32"):
        make_llm(target, speculative_config={"method": "eagle", "model": str(head), "num_speculative_tokens": 2},
                 **ENGINE)
