"""Structured output through the engine with a tiny random Llama (the SmolLM2 tokenizer): its
logits favour nothing in particular, so every valid output is the mask's doing. Batches mix
constrained and free requests, with chunked prefill, prefix caching and preemption forced."""

from __future__ import annotations

import argparse
import json
import math
import re
import time

import pytest
from structured_cases import ARITHMETIC, CHOICES, SCHEMAS, check_json, check_regex, parse_arithmetic

from minivllm import SamplingParams
from minivllm.core.request import RequestStatus
from minivllm.sampling_params import StructuredOutputsParams

PROMPTS = ["Reply in JSON about a user and their scores.", "Colour and size?", "Write an expression:",
           "Call me at", "How was it?", "Tell me a story about a cat who"]


@pytest.fixture(scope="module")
def llm(make_tiny_model, make_module_llm):
    # 40 blocks of 16 tokens for up to 12 requests of ~30-230 tokens: preemptions happen;
    # 48-token steps chunk every prompt.
    return make_module_llm(make_tiny_model("llama"), dtype="float32", max_num_batched_tokens=48,
                           num_gpu_blocks_override=40, max_model_len=512)


def constrained(so: StructuredOutputsParams, temperature: float, seed: int = 0) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=200, structured_outputs=so)


# (a JSON content would be xgrammar's own JSON grammar, whose whitespace a random model never ends)
TAGGED = {"type": "structural_tag", "format": {
    "type": "tag", "begin": "<call>", "end": "</call>", "content": {"type": "regex", "pattern": "[0-9]{2,4}"}}}

# json_object is left to the real model (test_smollm2.py): any object's strings are unbounded,
# and a random model never closes one.
CASES = [(StructuredOutputsParams(json=schema), name) for name, schema in SCHEMAS.items()] + [
    (StructuredOutputsParams(regex=r"\(\d{3}\) \d{3}-\d{4}"), "regex"),
    (StructuredOutputsParams(choice=CHOICES), "choice"),
    (StructuredOutputsParams(grammar=ARITHMETIC), "grammar"),
    (StructuredOutputsParams(json=SCHEMAS["flat"], disable_any_whitespace=True), "compact"),
    (StructuredOutputsParams(structural_tag=json.dumps(TAGGED)), "structural_tag"),
]


def check(text: str, name: str) -> None:
    if name in SCHEMAS:
        check_json(text, SCHEMAS[name])
    elif name == "compact":
        check_json(text, SCHEMAS["flat"])
        # No whitespace outside the strings: the text is its own compact serialization.
        assert json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False) == text
    elif name == "structural_tag":
        assert re.fullmatch(r"<call>[0-9]{2,4}</call>", text), text
    elif name == "regex":
        check_regex(text)
    elif name == "choice":
        assert text in CHOICES
    else:
        parse_arithmetic(text)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_constraint_holds_in_a_mixed_batch(llm, temperature):
    free = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts, params = [], []
    for i, (so, _) in enumerate(CASES):
        prompts += [PROMPTS[i % len(PROMPTS)] * (1 + i % 3), PROMPTS[(i + 1) % len(PROMPTS)]]
        params += [constrained(so, temperature, seed=i), free]
    preemptions = llm.llm_engine.get_scheduler_stats().num_preemptions
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.llm_engine.get_scheduler_stats().num_preemptions > preemptions  # recomputed mid-grammar
    for (_, name), out in zip(CASES, outputs[::2], strict=True):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (name, completion.text)
        check(completion.text, name)
    # The free requests beside them: the same tokens as with no structured request at all.
    alone = llm.generate(prompts[1::2], free, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs[1::2]] == [o.outputs[0].token_ids for o in alone]
    assert llm.generate(["ok"], free, use_tqdm=False)[0].outputs[0].finish_reason == "length"


def test_logprobs_are_those_of_the_masked_distribution(llm, tokenizer_dir):
    """With logprobs, every token reported with a finite logprob is one the grammar allowed at
    that position (a prefix of a choice at the first), and the allowed tokens' probabilities sum
    to at most 1: the distribution after the mask, renormalised over what it allows."""
    from minivllm.transformers_utils.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(str(tokenizer_dir))
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=5,
                            structured_outputs=StructuredOutputsParams(choice=["alpha", "beta"]))
    [out] = llm.generate(["Pick one:"], params, use_tqdm=False)
    completion = out.outputs[0]
    assert completion.text in ("alpha", "beta")
    first = completion.logprobs[0]
    finite = {t: lp.logprob for t, lp in first.items() if lp.logprob > float("-inf")}
    assert finite and all(("alpha".startswith(s) or "beta".startswith(s)) and s
                          for s in (tokenizer.decode([t]) for t in finite))
    assert sum(math.exp(lp) for lp in finite.values()) <= 1 + 1e-5
    assert completion.token_ids[0] in finite


def test_max_tokens_cuts_a_constrained_reply_with_length(llm):
    [out] = llm.generate(["x"], SamplingParams(temperature=0, max_tokens=3,
                                               structured_outputs=StructuredOutputsParams(json=SCHEMAS["nested"])),
                         use_tqdm=False)
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 3
    assert out.outputs[0].text.startswith("{")


@pytest.mark.parametrize("so, message", [
    (StructuredOutputsParams(json="{bad"), "not valid JSON"),
    (StructuredOutputsParams(regex="(a"), "Invalid regex"),
    (StructuredOutputsParams(json={"type": "array", "uniqueItems": True}), "uniqueItems"),
])
def test_bad_constraint_is_a_value_error_and_the_engine_goes_on(llm, so, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(["x"], SamplingParams(structured_outputs=so), use_tqdm=False)
    [out] = llm.generate(["x"], constrained(StructuredOutputsParams(choice=CHOICES), 0.0), use_tqdm=False)
    assert out.outputs[0].text in CHOICES


def test_engine_backend_option(make_tiny_model, make_llm):
    """structured_outputs_config picks the backend for every request: guidance serves what it
    takes; xgrammar alone refuses what it cannot enforce instead of falling back."""
    model = make_tiny_model("llama")
    guidance = make_llm(model, dtype="float32", structured_outputs_config={"backend": "guidance"})
    [out] = guidance.generate(["x"], constrained(StructuredOutputsParams(choice=CHOICES), 1.0), use_tqdm=False)
    assert out.outputs[0].text in CHOICES
    xgrammar = make_llm(model, dtype="float32", structured_outputs_config={"backend": "xgrammar"})
    with pytest.raises(ValueError, match="xgrammar does not support: multipleOf"):
        xgrammar.generate(["x"], constrained(StructuredOutputsParams(json={"type": "integer", "multipleOf": 3}), 0.0),
                          use_tqdm=False)


def test_backend_option_on_the_command_line():
    from minivllm.engine.arg_utils import AsyncEngineArgs

    parser = argparse.ArgumentParser()
    AsyncEngineArgs.add_cli_args(parser)
    args = AsyncEngineArgs.from_cli_args(parser.parse_args(["--structured-outputs-config.backend", "guidance"]))
    assert args.structured_outputs_config == {"backend": "guidance"}
    assert AsyncEngineArgs.from_cli_args(parser.parse_args([])).structured_outputs_config is None
    with pytest.raises(ValueError, match="must be one of auto, xgrammar, guidance"):
        AsyncEngineArgs(structured_outputs_config={"backend": "outlines"}).create_engine_config()
    with pytest.raises(ValueError, match="Unknown structured_outputs_config keys: bogus"):
        AsyncEngineArgs(structured_outputs_config={"bogus": 1}).create_engine_config()


def test_a_step_that_can_run_nothing_waits_for_the_grammar(make_tiny_model, monkeypatch):
    """The engine core holds only a request whose grammar compiles (slowed by 0.5 s). Every step
    that can run nothing waits for the compile, at most GRAMMAR_WAIT_S each, so the steps taken
    meanwhile are at most the time waited over GRAMMAR_WAIT_S (spinning took one every ~0.1 ms
    and held the GIL from the compile threads: SmolLM2's first grammar in a fresh server took
    47 s, 4.5 s with the wait). Those waits are not step times: the step histogram counts only the
    step that ran the prompt. Then the request runs to a valid reply."""
    from minivllm.engine.arg_utils import EngineArgs
    from minivllm.engine.core import GRAMMAR_WAIT_S, EngineCore
    from minivllm.engine.messages import EngineCoreRequest
    from minivllm.structured_output.backend_xgrammar import XgrammarBackend
    from minivllm.transformers_utils.tokenizer import get_tokenizer

    compile_grammar = XgrammarBackend.compile

    def slow_compile(self, params):
        time.sleep(0.5)
        return compile_grammar(self, params)

    monkeypatch.setattr(XgrammarBackend, "compile", slow_compile)
    config = EngineArgs(model=str(make_tiny_model("llama")), dtype="float32", kv_cache_memory_bytes=1 << 20,
                        max_model_len=256).create_engine_config()
    core = EngineCore(config)
    try:
        params = constrained(StructuredOutputsParams(choice=CHOICES), 0.0)
        core.add_request(EngineCoreRequest("r", [1, 2, 3], params, eos_token_id=None, arrival_time=time.time()))
        request = core.scheduler.requests["r"]
        start, steps, token_ids = time.monotonic(), 0, []
        while core.has_unfinished_requests():
            compiling = request.status == RequestStatus.WAITING_FOR_FSM
            token_ids += [t for out in core.step().outputs for t in out.new_token_ids]
            if compiling:
                steps += 1
                waited = time.monotonic() - start
                observed = core.scheduler.step_seconds.count
        assert waited >= 0.5 and steps <= waited / GRAMMAR_WAIT_S + 2
        assert observed == 1  # the step that admitted the request and ran its prompt
        tokenizer = get_tokenizer(config.model_config.tokenizer)
        assert tokenizer.decode(token_ids, skip_special_tokens=True) in CHOICES
    finally:
        core.shutdown()
