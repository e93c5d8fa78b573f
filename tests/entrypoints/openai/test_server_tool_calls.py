"""Tool calls forced by tool_choice (a named function, or "required") through the server with the
official `openai` client, on the session's tiny random Llama: whatever the weights, every call
names a given tool and its arguments validate against that tool's parameters schema."""

from __future__ import annotations

import json

import jsonschema
import pytest
from server_utils import MODEL_NAME, assert_openai_error

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Time in a zone", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def check_calls(calls, names=tuple(SCHEMAS)) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_function(client):
    for temperature in (0.0, 1.0):
        reply = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED,
                                               max_tokens=200, temperature=temperature, seed=5)
        choice = reply.choices[0]
        assert choice.finish_reason == "stop" and choice.message.content is None
        check_calls(choice.message.tool_calls, ("get_weather",))
        assert len(choice.message.tool_calls) == 1


def test_required(client):
    reply = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           max_tokens=300, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    check_calls(choice.message.tool_calls)


def test_streamed_tool_call_deltas(client):
    stream = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED,
                                            max_tokens=200, temperature=0, stream=True)
    deltas = [c.choices[0] for c in stream if c.choices]
    calls = [d.delta.tool_calls[0] for d in deltas if d.delta.tool_calls]
    assert calls[0].id and calls[0].function.name == "get_weather" and calls[0].type == "function"
    assert all(c.index == 0 and c.id is None for c in calls[1:])
    arguments = "".join(c.function.arguments for c in calls)
    jsonschema.validate(json.loads(arguments), WEATHER)
    assert deltas[-1].finish_reason == "stop"
    stream = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                            max_tokens=300, temperature=0, stream=True)
    deltas = [c.choices[0] for c in stream if c.choices]
    assert deltas[-1].finish_reason == "tool_calls"
    check_calls(deltas[-1].delta.tool_calls)


@pytest.mark.parametrize("body, message", [
    ({"tools": TOOLS}, '"auto" needs a tool parser'),
    ({"tools": TOOLS, "tool_choice": "auto"}, '"auto" needs a tool parser'),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
    ({"tools": [{"type": "function", "function": {}}], "tool_choice": "required"}, "needs type 'function'"),
    ({"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}}, "already a structured"),
])
def test_tool_requests_that_cannot_be_served_are_a_400(server, body, message):
    response = server.post("v1/chat/completions", {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 5, **body})
    assert message in assert_openai_error(response, 400)["message"]
    # tool_choice "none": the tools are ignored and the reply is text.
    response = server.post("v1/chat/completions", {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 5,
                                                   "tools": TOOLS, "tool_choice": "none"})
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["tool_calls"] is None
