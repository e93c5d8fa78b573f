"""The real SmolLM2-135M-Instruct (GGUF, dequantized to float32) behind `minivllm serve`: greedy
chat over HTTP is exactly what the offline `LLM.chat` gives, and it is real text."""

from __future__ import annotations

import json

import jsonschema
import pytest
import reference
from server_utils import RemoteServer
from structured_cases import CHOICES, SCHEMAS, conversation, schema_prompt

from minivllm import SamplingParams

NAME = "smollm2-135m-instruct"
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf, make_module_llm):
    # Start the server first and load the offline reference while it starts.
    server = RemoteServer(smollm2_gguf, ["--dtype", "float32", "--seed", "0", "--max-model-len", str(MAX_MODEL_LEN),
                                         "--served-model-name", NAME], wait=False)
    with server:
        llm = make_module_llm(smollm2_gguf, dtype="float32", max_model_len=MAX_MODEL_LEN)
        server.wait_ready()
        yield server, llm


def test_greedy_chat_equals_llm_chat_smollm2(smollm2):
    server, llm = smollm2
    messages = reference.SMOLLM2_CHECK_MESSAGES
    with server.client() as client:
        for ignore_eos, max_tokens in ((True, 24), (False, 40)):
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
            [want] = llm.chat(messages, params, use_tqdm=False)
            chat = client.chat.completions.create(model=NAME, messages=messages, temperature=0,
                                                  max_tokens=max_tokens,
                                                  extra_body={"ignore_eos": ignore_eos})
            [choice] = chat.choices
            assert choice.message.content == want.outputs[0].text
            assert choice.finish_reason == want.outputs[0].finish_reason
            assert chat.usage.prompt_tokens == len(want.prompt_token_ids)
            assert chat.usage.completion_tokens == len(want.outputs[0].token_ids)
            streamed = "".join(
                c.choices[0].delta.content or ""
                for c in client.chat.completions.create(model=NAME, messages=messages, temperature=0,
                                                        max_tokens=max_tokens, stream=True,
                                                        extra_body={"ignore_eos": ignore_eos})
                if c.choices
            )
            assert streamed == want.outputs[0].text
            if ignore_eos:
                assert chat.usage.completion_tokens == max_tokens
        # Real text: SmolLM2 answers the question and ends its turn by itself.
        assert choice.finish_reason == "stop"
        assert "4" in choice.message.content
        assert chat.usage.completion_tokens < 40


def test_structured_output_with_the_openai_client_smollm2(smollm2):
    """response_format json_schema and vLLM's structured_outputs: replies that validate."""
    server, _ = smollm2
    with server.client() as client:
        for name in ("nested", "enum", "pattern"):
            schema = SCHEMAS[name]
            reply = client.chat.completions.create(
                model=NAME, messages=schema_prompt(name), max_tokens=150, temperature=0,
                response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}})
            assert reply.choices[0].finish_reason == "stop"
            jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
        reply = client.chat.completions.create(
            model=NAME, messages=conversation("Is 'I loved this film' positive, negative or neutral?"),
            max_tokens=10, temperature=0, extra_body={"structured_outputs": {"choice": CHOICES}})
        assert reply.choices[0].message.content in CHOICES
