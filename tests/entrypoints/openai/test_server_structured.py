"""Structured output through the server (the session's tiny random Llama) with the official
`openai` client: response_format, vLLM's structured_outputs extra body and the older guided_*
fields, streaming, and bad constraints refused with a 400 while the server keeps serving."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from server_utils import MODEL_NAME, assert_openai_error

FLAT = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                         "ok": {"type": "boolean"}}, "required": ["name", "ok"]}
MESSAGES = [{"role": "user", "content": "Describe a user as JSON."}]
PHONE = r"\d{3}-\d{4}"


def test_chat_response_format_json_schema(client):
    for temperature in (0.0, 1.0):
        reply = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=200, temperature=temperature, seed=3,
            response_format={"type": "json_schema", "json_schema": {"name": "user", "schema": FLAT, "strict": True}})
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), FLAT)


def test_chat_stream_with_response_format(client):
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=200, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "user", "schema": FLAT}})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    jsonschema.validate(json.loads(text), FLAT)


def test_completions_structured_outputs_and_guided_fields(client):
    for extra in ({"structured_outputs": {"regex": PHONE}}, {"guided_regex": PHONE}):
        reply = client.completions.create(model=MODEL_NAME, prompt="Call", max_tokens=20, temperature=0,
                                          extra_body=extra)
        assert re.fullmatch(PHONE, reply.choices[0].text), reply.choices[0].text
    choices = ["alpha", "beta"]
    for extra in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
        reply = client.completions.create(model=MODEL_NAME, prompt="Pick", max_tokens=10, temperature=1.0,
                                          n=3, extra_body=extra)
        assert all(c.text in choices and c.finish_reason == "stop" for c in reply.choices)
    reply = client.completions.create(model=MODEL_NAME, prompt="User:", max_tokens=200, temperature=0,
                                      extra_body={"guided_json": FLAT})
    jsonschema.validate(json.loads(reply.choices[0].text), FLAT)


@pytest.mark.parametrize("body, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "Unknown response_format type"),
    ({"structured_outputs": {"json": {"type": "object"}, "regex": "a"}}, "exactly one of"),
    ({"structured_outputs": {"regex": "(a"}}, "Invalid regex"),
    ({"structured_outputs": {"bogus": 1}}, "Bad structured_outputs"),
    ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "not structured_outputs and guided"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{nope"}}}, "not valid JSON"),
])
def test_bad_constraints_are_a_400(server, body, message):
    for route, base in (("v1/chat/completions", {"messages": MESSAGES}), ("v1/completions", {"prompt": "x"})):
        error = assert_openai_error(server.post(route, {"model": MODEL_NAME, "max_tokens": 5, **base, **body}), 400)
        assert message in error["message"], error
    assert server.post("v1/completions", {"model": MODEL_NAME, "prompt": "x", "max_tokens": 3}).status_code == 200


def test_openai_client_raises_on_a_bad_schema(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5,
                                       response_format={"type": "json_schema", "json_schema": {"name": "x"}})
