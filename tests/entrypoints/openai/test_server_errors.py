"""Bad requests get the right status and an OpenAI error body ({"error": {message, type, param,
code}}), never a 500 or FastAPI's 422, and the server keeps serving afterwards. The hostile ones,
and the API key, are test_server_hostile.py's."""

from __future__ import annotations

import openai
import pytest
from server_utils import (
    MAX_MODEL_LEN,
    MODEL_NAME,
    RemoteServer,
    assert_openai_error,
)

MESSAGES = [{"role": "user", "content": "Hello there"}]
COMPLETION = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 3}
CHAT = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 3}


def assert_still_serving(server: RemoteServer) -> None:
    """A normal request succeeds (the bad ones did not break the server)."""
    response = server.post("v1/completions", COMPLETION)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1
    response = server.post("v1/chat/completions", CHAT)
    assert response.status_code == 200, response.text
    assert server.get("health").status_code == 200


@pytest.mark.parametrize("route", ["v1/completions", "v1/chat/completions"])
@pytest.mark.parametrize("body", [b'{"prompt": "Hello", "max_tokens": ', b"not json at all", b"[1, 2"])
def test_malformed_json(server, route, body):
    response = server.post(route, content=body, headers={"Content-Type": "application/json"})
    error = assert_openai_error(response, 400)
    assert "json" in error["message"].lower()
    assert_still_serving(server)


WRONG_TYPES = [
    ("v1/completions", {**COMPLETION, "max_tokens": "abc"}, "max_tokens"),
    ("v1/completions", {**COMPLETION, "temperature": "hot"}, "temperature"),
    ("v1/completions", {**COMPLETION, "n": [2]}, "n"),
    ("v1/completions", {**COMPLETION, "stream": "perhaps"}, "stream"),
    ("v1/completions", {"model": MODEL_NAME, "max_tokens": 3}, "prompt"),  # prompt missing
    ("v1/completions", {**COMPLETION, "prompt": {"text": "Hello"}}, "prompt"),
    ("v1/chat/completions", {**CHAT, "messages": 5}, "messages"),
    ("v1/chat/completions", {**CHAT, "messages": "Hello"}, "messages"),
    ("v1/chat/completions", {**CHAT, "max_tokens": "abc"}, "max_tokens"),
    ("v1/chat/completions", {"model": MODEL_NAME}, "messages"),  # messages missing
    ("v1/chat/completions", {**CHAT, "stop_token_ids": ["x"]}, "stop_token_ids"),
]


@pytest.mark.parametrize(("route", "body", "field"), WRONG_TYPES,
                         ids=[f"{r.split('/')[-1]}-{f}-{i}" for i, (r, _, f) in enumerate(WRONG_TYPES)])
def test_wrong_types(server, route, body, field):
    response = server.post(route, body)
    error = assert_openai_error(response, 400)
    assert field in error["message"] or error["param"] == field or (error["param"] or "").startswith(field)
    assert_still_serving(server)


def test_body_not_an_object(server):
    for body in ([1, 2, 3], "hello", 42):
        assert_openai_error(server.post("v1/completions", body), 400)
        assert_openai_error(server.post("v1/chat/completions", body), 400)
    assert_still_serving(server)


BAD_VALUES = [
    ({"temperature": -1}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n"),
    ({"top_k": -5, "extra": True}, "top_k"),
    ({"min_p": 2.0, "extra": True}, "min_p"),
    ({"repetition_penalty": 0.0, "extra": True}, "repetition_penalty"),
    ({"presence_penalty": 5.0}, "presence_penalty"),
    ({"priority": 1, "extra": True}, "priority"),  # this server schedules fcfs
]


@pytest.mark.parametrize(("values", "field"), BAD_VALUES, ids=[f for _, f in BAD_VALUES])
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_bad_sampling_values(server, client, values, field, kind):
    values = dict(values)
    # vLLM's own fields go in extra_body; OpenAI's are keyword arguments of the client.
    kwargs = {"extra_body": values} if values.pop("extra", False) else values
    with pytest.raises(openai.BadRequestError) as info:
        if kind == "completion":
            client.completions.create(model=MODEL_NAME, prompt="Hello", **kwargs)
        else:
            client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **kwargs)
    error = assert_openai_error(info.value.response, 400)
    assert field in error["message"]
    assert info.value.status_code == 400
    assert_still_serving(server)


def test_max_tokens_zero_and_temperature_negative_raw(server):
    """The two cases the issue names, raw: 400 with an OpenAI body, on both endpoints."""
    for route, base in (("v1/completions", COMPLETION), ("v1/chat/completions", CHAT)):
        assert_openai_error(server.post(route, {**base, "max_tokens": 0}), 400)
        assert_openai_error(server.post(route, {**base, "temperature": -1}), 400)
    assert_still_serving(server)


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**30])
def test_out_of_range_seed_is_a_400_not_a_500(server, seed):
    """A seed no 64-bit generator can take is bad input (vLLM bounds it to int64): 400, with
    `seed` named, on both endpoints. (It used to escape as a 500 OverflowError from msgpack.)"""
    for route, base in (("v1/completions", COMPLETION), ("v1/chat/completions", CHAT)):
        error = assert_openai_error(server.post(route, {**base, "seed": seed, "temperature": 1.0}), 400)
        assert "seed" in error["message"] or error["param"] == "seed"
    assert_still_serving(server)


def test_prompt_longer_than_context(server, client):
    prompt = "hello " * (MAX_MODEL_LEN + 100)
    prompt_len = server.count_tokens(prompt)
    assert prompt_len > MAX_MODEL_LEN
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5)
    error = assert_openai_error(info.value.response, 400)
    assert str(prompt_len) in error["message"] and str(MAX_MODEL_LEN) in error["message"]

    messages = [{"role": "user", "content": prompt}]
    chat_len = server.count_tokens(messages=messages)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=5)
    error = assert_openai_error(info.value.response, 400)
    assert str(chat_len) in error["message"] and str(MAX_MODEL_LEN) in error["message"]

    # Without max_tokens, and streamed: still a 400 before any event.
    response = server.post("v1/completions", {"model": MODEL_NAME, "prompt": prompt, "stream": True})
    error = assert_openai_error(response, 400)
    assert str(prompt_len) in error["message"] and str(MAX_MODEL_LEN) in error["message"]
    assert_still_serving(server)


def test_prompt_exactly_at_context_limit(server):
    """A prompt of exactly max_model_len tokens leaves no room to generate: 400."""
    tokens = [1000 + (i % 500) for i in range(MAX_MODEL_LEN)]
    error = assert_openai_error(server.post("v1/completions", {"model": MODEL_NAME, "prompt": tokens,
                                                               "max_tokens": 1}), 400)
    assert str(MAX_MODEL_LEN) in error["message"]
    # One token fewer leaves room for exactly one.
    response = server.post("v1/completions", {"model": MODEL_NAME, "prompt": tokens[:-1],
                                              "max_tokens": 1, "ignore_eos": True})
    assert response.status_code == 200, response.text
    assert response.json()["usage"] == {"prompt_tokens": MAX_MODEL_LEN - 1, "completion_tokens": 1,
                                        "total_tokens": MAX_MODEL_LEN}
    assert_still_serving(server)


def test_prompt_plus_max_tokens_longer_than_context(server, client):
    prompt_len = server.count_tokens("Hello")
    max_tokens = MAX_MODEL_LEN
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=max_tokens)
    message = assert_openai_error(info.value.response, 400)["message"]
    assert str(MAX_MODEL_LEN) in message and str(prompt_len + max_tokens) in message
    assert_still_serving(server)


def test_over_long_prompt_param_names_the_prompt_field(server):
    """The error's `param` names the field at fault: `prompt` for completions, not `messages`."""
    prompt = "hello " * (MAX_MODEL_LEN + 100)
    error = assert_openai_error(server.post("v1/completions", {"model": MODEL_NAME, "prompt": prompt}), 400)
    assert error["param"] == "prompt"
    error = assert_openai_error(server.post("v1/chat/completions", {
        "model": MODEL_NAME, "messages": [{"role": "user", "content": prompt}]}), 400)
    assert error["param"] == "messages"


def test_unknown_model(server, client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt="Hello", max_tokens=2)
    error = assert_openai_error(info.value.response, 404)
    assert "no-such-model" in error["message"]
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=2)
    assert_openai_error(info.value.response, 404)
    # Streamed requests are refused before the stream starts.
    response = server.post("v1/chat/completions", {**CHAT, "model": "no-such-model", "stream": True})
    assert_openai_error(response, 404)
    assert_openai_error(server.post("tokenize", {"model": "no-such-model", "prompt": "Hi"}), 404)
    assert_still_serving(server)


def test_unknown_route_and_method(server):
    assert_openai_error(server.get("v1/no-such-route"), 404)
    assert_openai_error(server.get("v1/completions"), 405)
    assert_still_serving(server)


def test_bad_auxiliary_requests(server):
    # Neither or both of prompt / messages.
    assert_openai_error(server.post("tokenize", {}), 400)
    assert_openai_error(server.post("tokenize", {"prompt": "a", "messages": MESSAGES}), 400)
    # Token ids outside the vocabulary.
    assert_openai_error(server.post("detokenize", {"tokens": [10**9]}), 400)
    assert_openai_error(server.post("detokenize", {"tokens": [-1]}), 400)
    assert_openai_error(server.post("detokenize", {"tokens": "abc"}), 400)
    # Messages the chat template cannot take.
    assert_openai_error(server.post("v1/chat/completions", {**CHAT, "messages": [{"content": "x"}]}), 400)
    assert_openai_error(server.post("v1/chat/completions", {
        **CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}), 400)
    assert_still_serving(server)


def test_unsupported_features_are_refused(server, client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt="Hello", suffix="end", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2,
                                       top_logprobs=2)  # without logprobs=True
    assert_still_serving(server)
