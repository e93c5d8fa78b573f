"""Structured output with the real SmolLM2-135M-Instruct: replies to real instructions, each
checked by jsonschema, re.fullmatch, membership or the arithmetic parser; greedy and sampled."""

from __future__ import annotations

import json

import pytest
from schemas import ARITHMETIC, CHOICES, PHONE, SCHEMAS, check_json, check_regex, parse_arithmetic

from minivllm import SamplingParams
from minivllm.sampling_params import StructuredOutputsParams


@pytest.fixture(scope="module")
def llm(smollm2_gguf, make_module_llm):
    return make_module_llm(smollm2_gguf, dtype="float32", max_model_len=1024)


def chat(llm, instruction: str, so: StructuredOutputsParams, temperature: float, max_tokens: int = 120):
    params = SamplingParams(temperature=temperature, seed=7, max_tokens=max_tokens, structured_outputs=so)
    [out] = llm.chat([{"role": "user", "content": instruction}], params, use_tqdm=False)
    return out.outputs[0]


INSTRUCTIONS = {
    "flat": "Give a user's name and whether the account is ok, as JSON.",
    "nested": "Give a user with an id, up to three short tags, and one to three scores, as JSON.",
    "enum": "Pick a T-shirt colour (red, green or blue) and size (S, M or L), as JSON.",
    "optional": "Give a number a, and optionally a short word b, as JSON.",
    "bounded": "Give an adult's age and a small number n between -5 and 5, as JSON.",
    "pattern": "Give a product code like AB-123, as JSON.",
    "recursive": 'Copy this tree exactly: {"v": 1, "kids": [{"v": 2}, {"v": 3}]}',
}


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_json_schemas(llm, temperature):
    for name, schema in SCHEMAS.items():
        reply = chat(llm, f"{INSTRUCTIONS[name]} Schema: {json.dumps(schema)}", StructuredOutputsParams(json=schema),
                     temperature)
        assert reply.finish_reason == "stop", (name, reply.text)
        check_json(reply.text, schema)
    reply = chat(llm, "Give the title and the author of a famous book as a JSON object with two keys.",
                 StructuredOutputsParams(json_object=True), temperature,
                 max_tokens=300)
    assert reply.finish_reason == "stop", reply.text
    assert isinstance(json.loads(reply.text), dict)


def test_regex_choice_and_grammar(llm):
    reply = chat(llm, "What is the phone number of the office?", StructuredOutputsParams(regex=PHONE), 0.0)
    check_regex(reply.text)
    reply = chat(llm, "Is 'I loved this film' positive, negative or neutral?",
                 StructuredOutputsParams(choice=CHOICES), 0.0)
    assert reply.text in CHOICES and reply.finish_reason == "stop"
    reply = chat(llm, "Write an arithmetic expression that equals 12.", StructuredOutputsParams(grammar=ARITHMETIC),
                 0.0, max_tokens=40)
    assert reply.finish_reason == "stop"
    parse_arithmetic(reply.text)
