"""The offline API surface: prompt forms, per-prompt params, output shapes, chat, bad input."""

from __future__ import annotations

import pytest
from engine_utils import assert_engine_idle
from reference import check_logprobs_close, hf_greedy

from minivllm import LLM, SamplingParams
from minivllm.engine.arg_utils import EngineArgs


@pytest.fixture(scope="module")
def llm(make_tiny_model, make_module_llm) -> LLM:
    return make_module_llm(make_tiny_model("llama"), dtype="float32", max_model_len=256)


def greedy(max_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_prompt_forms_agree_and_keep_order(llm):
    tok = llm.get_tokenizer()
    texts = ["Hello there, how are", "The quick brown fox", "A"]
    ids = [tok.encode(t) for t in texts]
    by_text = llm.generate(texts, greedy(), use_tqdm=False)
    by_ids = llm.generate(ids, greedy(), use_tqdm=False)
    by_dict = llm.generate([{"prompt_token_ids": i} for i in ids], greedy(), use_tqdm=False)
    by_prompt_dict = llm.generate([{"prompt": t} for t in texts], greedy(), use_tqdm=False)
    for outs in (by_ids, by_dict, by_prompt_dict):
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in by_text]
    for text, token_ids, out in zip(texts, ids, by_text, strict=True):
        assert out.prompt == text and out.prompt_token_ids == token_ids and out.finished
    assert by_ids[0].prompt is None
    # A single prompt (string or token list) is accepted too.
    assert llm.generate(texts[0], greedy(), use_tqdm=False)[0].outputs[0].token_ids == by_text[0].outputs[0].token_ids
    assert llm.generate(ids[0], greedy(), use_tqdm=False)[0].outputs[0].token_ids == by_text[0].outputs[0].token_ids


def test_request_output_fields(llm, make_tiny_model):
    prompt = [5, 6, 7, 8]
    out = llm.generate([prompt], greedy(max_tokens=6, logprobs=2), use_tqdm=False)[0]
    completion = out.outputs[0]
    assert completion.index == 0 and len(completion.token_ids) == 6
    assert completion.finish_reason == "length" and completion.stop_reason is None
    assert completion.text == llm.get_tokenizer().decode(completion.token_ids, skip_special_tokens=True)
    # logprobs: one dict per token holding the sampled token (rank 1 when greedy) and the top-2.
    assert len(completion.logprobs) == 6
    for token_id, position in zip(completion.token_ids, completion.logprobs, strict=True):
        assert position[token_id].rank == 1 and 2 <= len(position) <= 3
    ref = hf_greedy(make_tiny_model("llama"), [prompt], 6, top_k=1)[0]
    expected = sum(lp[t] for t, lp in zip(ref.token_ids, ref.top_logprobs, strict=True))
    assert completion.cumulative_logprob == pytest.approx(expected, abs=1e-3)


def test_per_prompt_params_and_stop_conditions(llm):
    prompts = [[11, 12, 13], [21, 22, 23]]
    base = llm.generate(prompts, greedy(max_tokens=10), use_tqdm=False)
    stop_at = base[1].outputs[0].token_ids[3]
    first_stop = base[1].outputs[0].token_ids.index(stop_at)
    outs = llm.generate(
        prompts, [greedy(max_tokens=4), greedy(max_tokens=10, stop_token_ids=[stop_at])], use_tqdm=False
    )
    assert outs[0].outputs[0].token_ids == base[0].outputs[0].token_ids[:4]
    assert outs[1].outputs[0].token_ids == base[1].outputs[0].token_ids[: first_stop + 1]
    assert outs[1].outputs[0].finish_reason == "stop" and outs[1].outputs[0].stop_reason == stop_at
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate(prompts[:1], [greedy(), greedy()], use_tqdm=False)


def test_eos_stops_unless_ignored(llm):
    eos = llm.get_tokenizer().eos_token_id
    base = llm.generate([[3, 4, 5]], greedy(max_tokens=6), use_tqdm=False)[0].outputs[0].token_ids
    # Make the first generated token the EOS: it is then the only token, finish reason "stop".
    params = SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[], ignore_eos=False)
    req = llm.llm_engine.processor.process_inputs("probe", [3, 4, 5], params)[0]
    assert req.eos_token_id == eos
    engine = llm.llm_engine
    req.eos_token_id = base[0]
    for engine_request in engine.output_processor.add_request(req, None):
        engine.engine_core.add_request(engine_request)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[0].outputs[0].token_ids == [base[0]] and outs[0].outputs[0].finish_reason == "stop"
    assert_engine_idle(llm)


def test_max_model_len_caps_output(llm):
    prompt = list(range(10, 10 + 250))
    out = llm.generate([prompt], greedy(max_tokens=50), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 256 - 250 and out.finish_reason == "length"


def test_seeded_sampling_reproducible_alone_and_in_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=16, ignore_eos=True)
    prompt = [31, 32, 33]
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in (5, 20, 9)]
    batch = llm.generate(
        [[1, 2], prompt, list(range(40, 90)), [9]], [others[0], seeded, others[1], others[2]],
        use_tqdm=False,
    )
    assert batch[1].outputs[0].token_ids == alone
    unseeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    draws = {tuple(llm.generate([prompt], unseeded, use_tqdm=False)[0].outputs[0].token_ids) for _ in range(3)}
    assert len(draws) > 1, "unseeded sampling should vary between calls"


def test_chat_applies_template(llm):
    tok = llm.get_tokenizer()
    messages = [{"role": "user", "content": "Hi!"}]
    out = llm.chat(messages, greedy(), use_tqdm=False)[0]
    expected = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False)
    assert out.prompt_token_ids == expected
    assert out.prompt.endswith("<|im_start|>assistant\n")
    two = llm.chat([messages, [{"role": "user", "content": "Bye"}]], greedy(), use_tqdm=False)
    assert len(two) == 2 and two[0].outputs[0].token_ids == out.outputs[0].token_ids


BAD_PROMPTS = [
    ("", "prompt is empty"),
    ([], "prompt is empty"),
    (list(range(1, 300)), r"prompt \(length 299\) is longer than the maximum model length of 256"),
    ([1, 2, 10**7], "out of the vocabulary"),
]


@pytest.mark.parametrize(("prompt", "message"), BAD_PROMPTS)
def test_bad_prompt_is_rejected_and_engine_keeps_serving(llm, prompt, message):
    good = [[7, 8, 9], [10, 11]]
    expected = llm.generate(good, greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match=message):
        llm.generate([good[0], prompt, good[1]], greedy(), use_tqdm=False)
    assert_engine_idle(llm)
    again = llm.generate(good, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in expected]


def test_bad_request_does_not_disturb_running_ones(llm):
    """A rejected add_request while others are mid-generation leaves them untouched."""
    engine = llm.llm_engine
    expected = llm.generate([[7, 8, 9], [10, 11]], greedy(max_tokens=12), use_tqdm=False)
    engine.add_request("a", [7, 8, 9], greedy(max_tokens=12))
    engine.add_request("b", [10, 11], greedy(max_tokens=12))
    engine.step()
    engine.step()
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("bad", [], greedy())
    with pytest.raises(ValueError, match="already in the engine"):
        engine.add_request("a", [1, 2], greedy())
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step()})
    assert finished["a"].outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert finished["b"].outputs[0].token_ids == expected[1].outputs[0].token_ids
    assert_engine_idle(llm)


def test_abort_frees_blocks(llm):
    engine = llm.llm_engine
    engine.add_request("x", list(range(3, 100)), greedy(max_tokens=50))
    engine.add_request("y", [3, 4], greedy(max_tokens=50))
    engine.step()
    engine.abort_request(["x", "y"])
    assert engine.step() == []
    assert_engine_idle(llm)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be at least 1"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"temperature": -0.5}, "temperature must be non-negative"),
        ({"top_k": -2}, "top_k must be"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"n": 0}, "n must be at least 1"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2, 2\]"),
        ({"repetition_penalty": 0}, "repetition_penalty must be greater than zero"),
        ({"min_tokens": 5, "max_tokens": 3}, "min_tokens must be less than or equal to max_tokens"),
        ({"stop": ["ok", ""]}, "stop strings must be non-empty"),
        ({"stop": "x", "detokenize": False}, "only supported when detokenize is True"),
        ({"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
        ({"prompt_logprobs": -1}, "prompt_logprobs must be non-negative"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_engine_args(tmp_path, make_tiny_model, make_llm):
    with pytest.raises(ValueError, match="does not exist"):
        make_llm(tmp_path / "nope")
    unsupported = tmp_path / "gpt2"
    unsupported.mkdir()
    (unsupported / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ValueError, match="not supported. Supported architectures: Gemma3ForCausalLM, LlamaForCausalLM"):
        make_llm(unsupported)
    model = str(make_tiny_model("llama"))
    with pytest.raises(ValueError, match="larger than the model's maximum context length of 1024"):
        EngineArgs(model=model, max_model_len=5000).create_engine_config()
    with pytest.raises(ValueError, match="Unsupported dtype"):
        EngineArgs(model=model, dtype="int3").create_engine_config()
    with pytest.raises(ValueError, match="cannot hold one request"):
        make_llm(model, num_gpu_blocks_override=4, max_model_len=1024)


def test_bfloat16_runs_close_to_float32(make_tiny_model, make_llm):
    """bf16 is a different rounding, not a different model: outputs agree up to near-ties."""
    model = str(make_tiny_model("qwen3"))
    prompts = [[5, 6, 7, 8, 9], list(range(40, 90))]
    params = greedy(max_tokens=8, logprobs=5)
    fp32 = make_llm(model, dtype="float32").generate(prompts, params, use_tqdm=False)
    bf16 = make_llm(model, dtype="bfloat16").generate(prompts, params, use_tqdm=False)
    check_logprobs_close(
        outputs_0=[(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in fp32],
        outputs_1=[(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in bf16],
        name_0="float32", name_1="bfloat16",
    )


def test_priority_scheduling(make_tiny_model, make_llm, llm, monkeypatch):
    """One seat: the prompts run one at a time, lowest priority value first, ties by arrival;
    an engine scheduling fcfs refuses priorities, and keeps serving."""
    prompts = [[5 + i, 6, 7] for i in range(4)]
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        llm.generate(prompts, greedy(), priority=[2, 0, 1, 0], use_tqdm=False)
    assert_engine_idle(llm)
    # In-process, every request is queued before the first step (an engine process may start
    # on the first one before the others arrive).
    monkeypatch.setenv("MINIVLLM_ENABLE_MULTIPROCESSING", "0")
    ranked = make_llm(make_tiny_model("llama"), dtype="float32", max_num_seqs=1, scheduling_policy="priority")
    with pytest.raises(ValueError, match="Got 2 priorities for 4 prompts"):
        ranked.generate(prompts, greedy(), priority=[0, 1], use_tqdm=False)
    outs = ranked.generate(prompts, greedy(), priority=[2, 0, 1, 0], use_tqdm=False)
    assert sorted(range(4), key=lambda i: outs[i].metrics.first_token_time) == [1, 3, 2, 0]
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids
                                                      for o in llm.generate(prompts, greedy(), use_tqdm=False)]
