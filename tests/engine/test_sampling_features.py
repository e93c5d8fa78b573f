"""Issue-3 features end to end on a tiny model: penalties vs transformers, logprobs and prompt
logprobs vs transformers' log_softmax, n > 1, output kinds, stop strings, token-level controls."""

from __future__ import annotations

import pytest
import torch
from engine_utils import assert_engine_idle, num_preemptions
from reference import load_hf_model

from minivllm import LLM, SamplingParams
from minivllm.sampling_params import RequestOutputKind

PROMPTS = [[5, 6, 7, 8], list(range(100, 160)), [42] * 9, list(range(300, 420))]


@pytest.fixture(scope="module")
def model_dir(make_tiny_model):
    return make_tiny_model("llama")


@pytest.fixture(scope="module")
def llm(model_dir, make_module_llm) -> LLM:
    return make_module_llm(model_dir, dtype="float32", max_model_len=512)


@pytest.fixture(scope="module")
def hf(model_dir):
    return load_hf_model(model_dir)


def assert_rank(rank: int, ref_row: torch.Tensor, token_id: int, tol: float = 1e-4) -> None:
    """1 + the number of tokens more likely, allowing for float noise among near-equal logprobs."""
    value = ref_row[token_id]
    assert int((ref_row > value + tol).sum()) + 1 <= rank <= int((ref_row > value - tol).sum()) + 1


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 12, "ignore_eos": True, **kw})


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_repetition_penalty_matches_transformers(llm, hf):
    ours = tokens(llm.generate(PROMPTS, greedy(max_tokens=40, repetition_penalty=1.8), use_tqdm=False))
    for prompt, out in zip(PROMPTS, ours, strict=True):
        ref = hf.generate(
            torch.tensor([prompt]), max_new_tokens=40, do_sample=False, repetition_penalty=1.8,
            eos_token_id=None, pad_token_id=0,
        )[0, len(prompt):].tolist()
        assert out == ref
    assert ours != tokens(llm.generate(PROMPTS, greedy(max_tokens=40), use_tqdm=False))


def test_presence_penalty_makes_repeats_rarer(llm):
    """The exact formula is checked in tests/sample; here: it reaches the model's outputs."""
    strong = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, presence_penalty=2.0)
    base = tokens(llm.generate(PROMPTS, greedy(max_tokens=30), use_tqdm=False))
    penalised = tokens(llm.generate(PROMPTS, strong, use_tqdm=False))
    repeats = lambda seqs: sum(len(s) - len(set(s)) for s in seqs)  # noqa: E731
    assert repeats(penalised) < repeats(base)


def test_logprobs_match_transformers(llm, hf):
    outs = llm.generate(PROMPTS, greedy(logprobs=5), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        seq = prompt + out.outputs[0].token_ids
        with torch.inference_mode():
            ref = torch.log_softmax(hf(torch.tensor([seq])).logits[0].float(), dim=-1)
        for i, position in enumerate(out.outputs[0].logprobs):
            ref_row = ref[len(prompt) - 1 + i]
            top5 = ref_row.topk(5).indices.tolist()
            assert set(top5) <= set(position)
            for token_id, lp in position.items():
                assert lp.logprob == pytest.approx(ref_row[token_id].item(), abs=1e-3)
                assert_rank(lp.rank, ref_row, token_id)
                assert lp.decoded_token == llm.get_tokenizer().decode([token_id])
        chosen = [p[t].logprob for p, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids, strict=True)]
        assert out.outputs[0].cumulative_logprob == pytest.approx(sum(chosen), abs=1e-4)


@pytest.mark.parametrize("chunked", [False, True])
def test_prompt_logprobs_match_transformers(model_dir, llm, make_llm, hf, chunked):
    if chunked:  # prompts prefilled 16 tokens a step
        llm = make_llm(model_dir, dtype="float32", max_num_batched_tokens=16)
    outs = llm.generate(PROMPTS, greedy(max_tokens=2, prompt_logprobs=3), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        with torch.inference_mode():
            ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for j in range(1, len(prompt)):
            position = out.prompt_logprobs[j]
            ref_row = ref[j - 1]
            assert position[prompt[j]].logprob == pytest.approx(ref_row[prompt[j]].item(), abs=1e-3)
            assert_rank(position[prompt[j]].rank, ref_row, prompt[j])
            assert set(ref_row.topk(3).indices.tolist()) <= set(position)


def test_prompt_logprobs_survive_preemption(model_dir, llm, make_llm):
    """A preempted request recomputes its prompt but reports each prompt logprob once."""
    small = make_llm(model_dir, dtype="float32", num_gpu_blocks_override=17, max_model_len=256)
    prompts = [list(range(10, 10 + 120)), list(range(500, 500 + 120))]
    outs = small.generate(prompts, greedy(max_tokens=100, prompt_logprobs=1), use_tqdm=False)
    assert num_preemptions(small) > 0
    alone = llm.generate(prompts, greedy(max_tokens=100, prompt_logprobs=1), use_tqdm=False)
    for a, b in zip(outs, alone, strict=True):
        assert len(a.prompt_logprobs) == 120
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
            assert pa.keys() == pb.keys()


def test_n_samples(llm):
    out = llm.generate([PROMPTS[0]], SamplingParams(n=4, temperature=1.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert len(out) == 1 and [c.index for c in out[0].outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out[0].outputs}) == 4
    out = llm.generate([PROMPTS[0]], SamplingParams(n=4, temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert len({tuple(c.token_ids) for c in out[0].outputs}) == 1
    seeded = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    a = llm.generate([PROMPTS[1]], seeded, use_tqdm=False)[0]
    b = llm.generate([PROMPTS[1]], seeded, use_tqdm=False)[0]
    assert tokens([a]) == tokens([b]) and [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]


def test_output_kinds_stream_consistently(llm):
    engine = llm.llm_engine
    final = llm.generate([PROMPTS[2]], greedy(max_tokens=10), use_tqdm=False)[0].outputs[0]
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
        engine.add_request(f"k{kind}", PROMPTS[2], greedy(max_tokens=10, output_kind=kind))
        steps = []
        while engine.has_unfinished_requests():
            steps += engine.step()
        assert len(steps) == 10 and steps[-1].finished and not any(s.finished for s in steps[:-1])
        if kind == RequestOutputKind.DELTA:
            assert sum((s.outputs[0].token_ids for s in steps), []) == final.token_ids
            assert "".join(s.outputs[0].text for s in steps) == final.text
        else:
            assert steps[-1].outputs[0].token_ids == final.token_ids and steps[-1].outputs[0].text == final.text
            assert all(final.text.startswith(s.outputs[0].text) for s in steps)


def test_stop_strings(llm):
    tok = llm.get_tokenizer()
    base = llm.generate([PROMPTS[3]], greedy(max_tokens=20), use_tqdm=False)[0].outputs[0]
    pieces = [tok.decode([t]) for t in base.token_ids]
    # A stop string made of the end of token 5 and the start of token 6 spans two tokens.
    stop = pieces[5][-2:] + pieces[6][:2]
    assert stop in base.text
    cut = base.text.index(stop)
    out = llm.generate([PROMPTS[3]], greedy(max_tokens=20, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.text == base.text[:cut] and out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) < 20
    kept = llm.generate([PROMPTS[3]], greedy(max_tokens=20, stop=stop, include_stop_str_in_output=True), use_tqdm=False)
    assert kept[0].outputs[0].text == base.text[: cut + len(stop)]
    # The engine core aborted the request: nothing is left running, no block is held.
    assert_engine_idle(llm)


def test_token_controls(llm):
    base = tokens(llm.generate(PROMPTS, greedy(), use_tqdm=False))
    forced = tokens(llm.generate(PROMPTS, greedy(logit_bias={77: 100.0}), use_tqdm=False))
    assert all(set(t) == {77} for t in forced)
    allowed = [3000, 3001, 3002]
    assert all(set(t) <= set(allowed) for t in tokens(llm.generate(PROMPTS, greedy(allowed_token_ids=allowed), use_tqdm=False)))
    # min_tokens: with the first greedy token as a stop id, generation continues until 3 tokens.
    first = base[0][0]
    out = llm.generate([PROMPTS[0]], greedy(stop_token_ids=[first], min_tokens=3), use_tqdm=False)[0].outputs[0]
    assert first not in out.token_ids[:3] and len(out.token_ids) >= 3
    stopped = llm.generate([PROMPTS[0]], greedy(stop_token_ids=[first]), use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == [first] and stopped.stop_reason == first


def test_bad_words(llm):
    tok = llm.get_tokenizer()
    base = llm.generate([PROMPTS[1]], greedy(max_tokens=16), use_tqdm=False)[0].outputs[0]
    word = tok.decode([base.token_ids[2]]).strip()
    assert word
    out = llm.generate([PROMPTS[1]], greedy(max_tokens=16, bad_words=[word]), use_tqdm=False)[0].outputs[0]
    banned = {tuple(tok.encode(w, add_special_tokens=False)) for w in (word, " " + word)}
    for seq in banned:
        n = len(seq)
        assert all(tuple(out.token_ids[i : i + n]) != seq for i in range(len(out.token_ids) - n + 1))
    assert out.token_ids[:2] == base.token_ids[:2] and out.token_ids[2] != base.token_ids[2]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"logprobs": 21}, "greater than max allowed: 20"),
        ({"prompt_logprobs": 50}, "greater than max allowed: 20"),
        ({"logit_bias": {10**7: 1.0}}, "logit_bias contains token id"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids contains token id"),
        # Past int64 it used to reach the worker, whose numpy row overflowed: the engine died.
        ({"top_k": 2**63}, "top_k must be"),
    ],
)
def test_bad_params_rejected_by_engine(llm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([PROMPTS[0]], SamplingParams(**kwargs), use_tqdm=False)


def test_priority_beyond_int64_rejected_by_engine(llm):
    """msgpack cannot carry it to the engine core: a ValueError here, not an OverflowError there."""
    with pytest.raises(ValueError, match="priority must be a 64-bit signed integer"):
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=1), priority=[2**64], use_tqdm=False)
    assert len(llm.generate([PROMPTS[0]], SamplingParams(max_tokens=1), use_tqdm=False)[0].outputs[0].token_ids) == 1
