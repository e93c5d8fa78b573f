"""Structured output with the real SmolLM2-135M-Instruct: replies to real instructions, each
checked by jsonschema, re.fullmatch, membership or the arithmetic parser. The schema replies run
as one batch beside free requests, with chunked prefill (64-token steps), prefix caching (every
conversation shares the system prompt) and preemption (42 blocks of 16 for ~3000 tokens) forced;
greedy and sampled. (Through the server: tests/entrypoints/openai/test_server_smollm2.py.)"""

from __future__ import annotations

import json

import pytest
from structured_cases import (
    ARITHMETIC,
    CHOICES,
    PHONE,
    SCHEMAS,
    check_json,
    check_regex,
    conversation,
    parse_arithmetic,
    schema_prompt,
)

from minivllm import SamplingParams
from minivllm.sampling_params import StructuredOutputsParams


@pytest.fixture(scope="module")
def llm(smollm2_gguf, make_module_llm):
    return make_module_llm(smollm2_gguf, dtype="float32", max_model_len=640, max_num_batched_tokens=64,
                           num_gpu_blocks_override=42)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_json_schemas_in_a_mixed_batch(llm, temperature):
    conversations, params = [], []
    for name, schema in SCHEMAS.items():
        conversations.append(schema_prompt(name))
        params.append(SamplingParams(temperature=temperature, seed=7, max_tokens=150,
                                     structured_outputs=StructuredOutputsParams(json=schema)))
        conversations.append(conversation(f"Tell me about {name} things."))
        params.append(SamplingParams(temperature=temperature, seed=7, max_tokens=120, ignore_eos=True))
    conversations.append(conversation("Give the title and the author of a famous book as a JSON object with two keys."))
    params.append(SamplingParams(temperature=temperature, seed=7, max_tokens=300,
                                 structured_outputs=StructuredOutputsParams(json_object=True)))
    preemptions = llm.llm_engine.get_scheduler_stats().num_preemptions
    outputs = llm.chat(conversations, params, use_tqdm=False)
    assert llm.llm_engine.get_scheduler_stats().num_preemptions > preemptions
    for name, out in zip(SCHEMAS, outputs[0:-1:2], strict=True):
        reply = out.outputs[0]
        assert reply.finish_reason == "stop", (name, reply.text)
        check_json(reply.text, SCHEMAS[name])
    assert all(len(out.outputs[0].token_ids) == 120 for out in outputs[1:-1:2])
    book = outputs[-1].outputs[0]
    assert book.finish_reason == "stop" and isinstance(json.loads(book.text), dict), book.text


def test_regex_choice_and_grammar(llm):
    def reply(text: str, so: StructuredOutputsParams, max_tokens: int = 60):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=so)
        return llm.chat(conversation(text), params, use_tqdm=False)[0].outputs[0]

    check_regex(reply("What is the phone number of the office?", StructuredOutputsParams(regex=PHONE)).text)
    choice = reply("Is 'I loved this film' positive, negative or neutral?", StructuredOutputsParams(choice=CHOICES))
    assert choice.text in CHOICES and choice.finish_reason == "stop"
    expression = reply("Write an arithmetic expression that equals 12.", StructuredOutputsParams(grammar=ARITHMETIC))
    assert expression.finish_reason == "stop"
    parse_arithmetic(expression.text)
