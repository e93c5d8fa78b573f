"""The last decoder layer runs o_proj and the MLP for the sampled rows only (LlamaModel.forward's
logits_indices), every row when prompt logprobs need them, and the output still matches
transformers'. Rows are counted at the first and the last layer's down_proj in every forward."""

from __future__ import annotations

import random

import pytest
import torch
from engine_utils import assert_engine_idle, model_runner
from reference import check_logprobs_close, hf_greedy, load_hf_model

from minivllm import LLM, SamplingParams

PROMPT_LENS = (77, 40, 5)  # the first longer than a 32-token step
MAX_TOKENS = 4


@pytest.fixture(autouse=True)
def in_process_engine(monkeypatch):
    monkeypatch.setenv("MINIVLLM_ENABLE_MULTIPROCESSING", "0")  # to reach the model


@pytest.fixture(scope="module")
def case(make_tiny_model):
    model_dir = make_tiny_model("llama", head_dim=64)  # the C++ CPU kernels' head size
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in PROMPT_LENS]
    reference = [r.as_output() for r in hf_greedy(model_dir, prompts, MAX_TOKENS)]
    return model_dir, prompts, reference


def run_counting_rows(llm: LLM, prompts: list[list[int]], params: SamplingParams):
    """The outputs, and (first layer rows, last layer rows) of every forward."""
    model = model_runner(llm).model
    first, last = model.model.layers[0].mlp.down_proj, model.model.layers[-1].mlp.down_proj
    rows: list[list[int]] = []
    hooks = [
        first.register_forward_pre_hook(lambda m, args: rows.append([args[0].shape[0]])),
        last.register_forward_pre_hook(lambda m, args: rows[-1].append(args[0].shape[0])),
    ]
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        for hook in hooks:
            hook.remove()
    return outputs, rows


@pytest.mark.parametrize("max_num_batched_tokens", [None, 32])
def test_last_layer_takes_only_sampled_rows(case, make_llm, max_num_batched_tokens):
    model_dir, prompts, reference = case
    kwargs = {"max_num_batched_tokens": max_num_batched_tokens} if max_num_batched_tokens else {}
    llm = make_llm(model_dir, dtype="float32", enforce_eager=True, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    outputs, rows = run_counting_rows(llm, prompts, params)
    ours = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]
    check_logprobs_close(outputs_0=reference, outputs_1=ours, name_0="hf", name_1="minivllm")
    # Every prompt token and every fed-back output token enters the first layer once; one row
    # per sampled token leaves the last.
    assert sum(r[0] for r in rows) == sum(PROMPT_LENS) + len(prompts) * (MAX_TOKENS - 1)
    assert sum(r[1] for r in rows) == len(prompts) * MAX_TOKENS
    assert all(r[1] <= min(r[0], len(prompts)) for r in rows)
    if max_num_batched_tokens:
        assert any(r[1] == 0 for r in rows), "a step of mid-prompt chunks samples nothing"
    assert_engine_idle(llm)


def test_prompt_logprobs_keep_every_row(case, make_llm):
    model_dir, prompts, _ = case
    llm = make_llm(model_dir, dtype="float32", enforce_eager=True)
    with_prompt = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=1)
    outputs, rows = run_counting_rows(llm, prompts, with_prompt)
    assert all(first == last for first, last in rows)
    # The prompt logprobs come from every row's final state: they match transformers'.
    hf = load_hf_model(model_dir)
    for prompt, out in zip(prompts, outputs, strict=True):
        with torch.inference_mode():
            ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
        for j in range(1, len(prompt)):
            assert out.prompt_logprobs[j][prompt[j]].logprob == pytest.approx(ref[j - 1, prompt[j]].item(), abs=1e-3)
