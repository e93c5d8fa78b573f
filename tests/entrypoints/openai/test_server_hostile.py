"""A catalogue of hostile requests: each gets a 4xx with an OpenAI error body that shows no
traceback and no path of the server's, and the next good request succeeds.

The catalogue runs against the session's shared tiny-Llama server. What needs other server flags
(an API key, a small body limit, a short read timeout, CORS origins, trusted request chat
templates) shares one module-scoped `guarded` server. test_server_errors.py keeps the plain bad
values (out-of-range sampling values, unknown models, prompts over the context, the first
malformed bodies); this module adds the hostile ones, the server's guards, and tenants' prefix
caches kept apart by cache_salt.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn
from server_utils import (
    HOST,
    MAX_MODEL_LEN,
    MODEL_NAME,
    TINY_SERVER_ARGS,
    RemoteServer,
    assert_openai_error,
    engine_core_pids,
    fake_engine,
    is_alive,
)
from starlette.testclient import TestClient
from uvicorn.server import ServerState

from minivllm.engine.exceptions import EngineDeadError
from minivllm.entrypoints.openai import middleware
from minivllm.entrypoints.openai.api_server import build_app
from minivllm.entrypoints.openai.cli_args import DEFAULT_MAX_REQUEST_BODY_BYTES, FrontendArgs
from minivllm.entrypoints.openai.http_protocol import LINGER_S, h11_protocol
from minivllm.entrypoints.openai.serving_completion import OpenAIServingCompletion

COMPLETION = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 1}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 1}
# The tiny Llama's vocabulary is SmolLM2's tokenizer's (its config.json).
VOCAB_SIZE = 49152
HUGE_INT = 10**30  # wider than any integer msgpack, numpy or torch carries

# What an error body must not show: a traceback, a Python or C++ source file, a server path.
LEAK = re.compile(r'Traceback|File "|\.pyc?\b|\.cc:\d|/(home|usr|opt|work|project|tmp|root|site-packages)/')


def assert_refused(response: httpx.Response, status: int) -> dict[str, Any]:
    error = assert_openai_error(response, status)
    assert not LEAK.search(response.text), response.text
    return error


def assert_serving(server: RemoteServer) -> None:
    """A good one-token completion succeeds: the hostile request broke nothing."""
    response = server.post("v1/completions", {**COMPLETION, "ignore_eos": True})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 1


def raw_field(base: dict[str, Any], field: str, literal: str) -> bytes:
    """`base` as JSON with `field` set to a literal no JSON encoder writes (1e400, which Python's
    parser reads as infinity)."""
    return json.dumps(base)[:-1].encode() + f', "{field}": {literal}}}'.encode()


@dataclass(frozen=True)
class Hostile:
    """One hostile request: a JSON value (NaN and Infinity written as Python's json does), or
    bytes sent as they are; the status it must get, and a word its message or param holds."""

    kind: str
    body: Any
    says: str
    status: int = 400
    route: str = "v1/completions"
    method: str = "POST"
    content_type: str | None = "application/json"
    content_encoding: str | None = None

    def send(self, server: RemoteServer) -> httpx.Response:
        content = self.body if isinstance(self.body, bytes) else json.dumps(self.body).encode()
        headers = {"Content-Type": self.content_type} if self.content_type else {}
        if self.content_encoding:
            headers["Content-Encoding"] = self.content_encoding
        return httpx.request(self.method, server.url_for(self.route), content=content if self.method == "POST" else None,
                             headers=headers, timeout=60.0)


def completion(**fields: Any) -> dict[str, Any]:
    return {**COMPLETION, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {**CHAT, **fields}


def chat_message(message: Any) -> dict[str, Any]:
    return chat(messages=[message])


# Every numeric field: NaN, Infinity, and a number past what the field can hold (a literal that
# overflows a double, 1e400, for floats; 10**30 for integers). The word is what the error names.
FLOAT_FIELDS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"]
INT_FIELDS = ["top_k", "max_tokens", "n", "seed", "logprobs", "priority", "min_tokens", "prompt_logprobs"]
# Chat's integer fields, and the word their errors say (they become logprobs and max_tokens).
CHAT_INT_FIELDS = {"top_logprobs": "logprobs", "max_completion_tokens": "max_tokens"}


def numeric_rows() -> list[Hostile]:
    rows = []
    for name in FLOAT_FIELDS:
        rows += [Hostile(f"{name}-nan", completion(**{name: float("nan")}), name),
                 Hostile(f"{name}-infinity", completion(**{name: float("inf")}), name),
                 Hostile(f"{name}-1e400", raw_field(COMPLETION, name, "1e400"), name)]
    for name in INT_FIELDS:
        rows += [Hostile(f"{name}-nan", completion(**{name: float("nan")}), name),
                 Hostile(f"{name}-minus-infinity", completion(**{name: float("-inf")}), name),
                 Hostile(f"{name}-huge", completion(**{name: HUGE_INT}), name)]
    logprobs_chat = chat(logprobs=True)
    for name, says in CHAT_INT_FIELDS.items():
        rows += [Hostile(f"{name}-nan", {**logprobs_chat, name: float("nan")}, name, route="v1/chat/completions"),
                 Hostile(f"{name}-huge", {**logprobs_chat, name: HUGE_INT}, says, route="v1/chat/completions")]
    rows += [Hostile("logit_bias-nan", completion(logit_bias={"5": float("nan")}), "logit_bias"),
             Hostile("logit_bias-infinity", completion(logit_bias={"5": float("inf")}), "logit_bias"),
             Hostile("logit_bias-1e400", raw_field(COMPLETION, "logit_bias", '{"5": 1e400}'), "logit_bias"),
             # Past int64 but within uint64: msgpack carried it, and the worker's numpy row overflowed.
             Hostile("top_k-2**63", completion(top_k=2**63), "top_k")]
    return rows


# One wrong JSON type per field: the word is the field, named by the message or the param.
WRONG_TYPES = {
    "model": 5, "n": "two", "max_tokens": [1], "temperature": {}, "top_p": "high", "stop": 5, "seed": 1.5,
    "presence_penalty": "x", "frequency_penalty": [], "logit_bias": [1, 2], "user": 5, "top_k": 1.5,
    "min_p": "x", "repetition_penalty": {}, "min_tokens": "x", "ignore_eos": "sometimes",
    "stop_token_ids": "x", "skip_special_tokens": [], "allowed_token_ids": {"a": 1}, "bad_words": 5,
    "prompt_logprobs": "x", "priority": 1.5, "echo": "x", "logprobs": "x", "best_of": "x", "suffix": 5,
    "response_format": "json", "structured_outputs": 5, "stream_options": 5, "cache_salt": 5,
}
CHAT_WRONG_TYPES = {
    "tools": {}, "tool_choice": 5, "chat_template_kwargs": 5, "add_generation_prompt": "x",
    "top_logprobs": "x", "max_completion_tokens": "x", "continue_final_message": [],
}


def wrong_type_rows() -> list[Hostile]:
    return ([Hostile(f"wrong-type-{name}", completion(**{name: value}), name) for name, value in WRONG_TYPES.items()]
            + [Hostile(f"wrong-type-{name}", chat(**{name: value}), name, route="v1/chat/completions")
               for name, value in CHAT_WRONG_TYPES.items()])


COMPLETION_JSON = json.dumps(COMPLETION).encode()

CATALOGUE = [
    # -- malformed bodies
    Hostile("json-trailing-garbage", COMPLETION_JSON + b" and more", "JSON"),
    Hostile("json-single-quotes", b"{'prompt': 'Hello', 'max_tokens': 1}", "JSON"),
    Hostile("json-comment", b'{"prompt": "Hello", /* note */ "max_tokens": 1}', "JSON"),
    Hostile("json-truncated-in-string", b'{"prompt": "Hel', "JSON"),
    Hostile("json-bad-escape", b'{"prompt": "\\x41", "max_tokens": 1}', "JSON"),
    Hostile("json-raw-control-char", b'{"prompt": "a\x01b", "max_tokens": 1}', "JSON"),
    Hostile("json-empty-body", b"", "required"),
    Hostile("json-null", b"null", "dictionary"),
    Hostile("json-nested-100000-deep", b'{"prompt": "Hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "body"),
    Hostile("utf8-invalid-bytes", b'{"prompt": "\xff\xfe", "max_tokens": 1}', "body"),
    Hostile("utf8-truncated-sequence", b'{"prompt": "\xe2\x82", "max_tokens": 1}', "body"),
    Hostile("gzip-body-not-decompressed", b"\x1f\x8b\x08\x00" + bytes(range(64)), "body", content_encoding="gzip"),
    Hostile("content-type-text", COMPLETION_JSON, "JSON", status=415, content_type="text/plain"),
    Hostile("content-type-form", b"prompt=Hello&max_tokens=1", "JSON", status=415,
            content_type="application/x-www-form-urlencoded"),
    Hostile("content-type-multipart", b"--b\r\n\r\nx\r\n--b--\r\n", "JSON", status=415,
            content_type="multipart/form-data; boundary=b"),
    # -- lone surrogates (JSON escapes that decode to no character)
    Hostile("surrogate-prompt", completion(prompt="\ud800"), "prompt"),
    Hostile("surrogate-prompt-list", completion(prompt=["fine", "x\udfff"]), "prompt"),
    Hostile("surrogate-chat-content", chat_message({"role": "user", "content": "hi \udc00"}), "messages",
            route="v1/chat/completions"),
    Hostile("surrogate-stop", completion(stop=["\ud83d"]), "stop"),
    Hostile("surrogate-logit-bias-key", completion(logit_bias={"\ud800": 1}), "logit_bias"),
    Hostile("surrogate-model", completion(model="\ud800"), "model"),
    Hostile("surrogate-guided-regex", completion(guided_regex="a\ud800"), "guided_regex"),
    Hostile("surrogate-tokenize", {"prompt": "\ud800"}, "prompt", route="tokenize"),
    Hostile("surrogate-tokenize-messages", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages",
            route="tokenize"),
    # -- prompts
    Hostile("prompt-empty-string", completion(prompt=""), "empty"),
    Hostile("prompt-empty-list", completion(prompt=[]), "empty"),
    Hostile("prompt-empty-token-list", completion(prompt=[[]]), "empty"),
    Hostile("prompt-token-id-vocab-size", completion(prompt=[1, VOCAB_SIZE]), "vocabulary"),
    Hostile("prompt-token-id-negative", completion(prompt=[-1]), "vocabulary"),
    Hostile("prompt-token-id-2**63", completion(prompt=[2**63]), "vocabulary"),
    Hostile("prompt-token-id-float", completion(prompt=[1.5, 2.5]), "prompt"),
    Hostile("prompt-mixed-text-and-ids", completion(prompt=["a", 5]), "prompt"),
    Hostile("prompt-token-ids-over-context", completion(prompt=[7] * (MAX_MODEL_LEN + 1)), "prompt"),
    # -- counts out of range
    Hostile("n-over-128", completion(n=129), "128"),
    Hostile("logprobs-over-20", completion(logprobs=21), "20"),
    Hostile("prompt-logprobs-over-20", completion(prompt_logprobs=21), "20"),
    Hostile("top-logprobs-over-20", chat(logprobs=True, top_logprobs=21), "20", route="v1/chat/completions"),
    Hostile("top-logprobs-negative", chat(logprobs=True, top_logprobs=-1), "logprobs", route="v1/chat/completions"),
    Hostile("top-logprobs-without-logprobs", chat(top_logprobs=2), "top_logprobs", route="v1/chat/completions"),
    # -- logit_bias
    Hostile("logit-bias-key-word", completion(logit_bias={"abc": 1}), "logit_bias"),
    Hostile("logit-bias-key-float", completion(logit_bias={"1e3": 1}), "logit_bias"),
    Hostile("logit-bias-key-vocab-size", completion(logit_bias={str(VOCAB_SIZE): 1}), "vocabulary"),
    Hostile("logit-bias-key-negative", completion(logit_bias={"-1": 1}), "vocabulary"),
    Hostile("logit-bias-value-over-100", completion(logit_bias={"5": 101}), "[-100, 100]"),
    Hostile("logit-bias-value-under-minus-100", completion(logit_bias={"5": -1e308}), "[-100, 100]"),
    # -- stop strings (at most 64)
    Hostile("stop-65-strings", completion(stop=[f"s{i}" for i in range(65)]), "64"),
    Hostile("stop-5000-strings", completion(stop=[f"s{i}" for i in range(5000)]), "64"),
    Hostile("stop-empty-string", completion(stop=[""]), "stop"),
    Hostile("stop-token-ids-negative", completion(stop_token_ids=[-1]), "stop_token_ids"),
    Hostile("allowed-token-ids-empty", completion(allowed_token_ids=[]), "allowed_token_ids"),
    Hostile("bad-words-empty-string", completion(bad_words=[""]), "bad_words"),
    # -- chat messages
    Hostile("chat-unknown-role", chat_message({"role": "wizard", "content": "hi"}), "role",
            route="v1/chat/completions"),
    Hostile("chat-role-not-a-string", chat_message({"role": ["user"], "content": "hi"}), "role",
            route="v1/chat/completions"),
    Hostile("chat-message-without-role", chat_message({"content": "hi"}), "role", route="v1/chat/completions"),
    Hostile("chat-message-not-an-object", chat(messages=["hi"]), "messages", route="v1/chat/completions"),
    Hostile("chat-content-a-number", chat_message({"role": "user", "content": 5}), "content",
            route="v1/chat/completions"),
    Hostile("chat-content-part-unknown-type", chat_message({"role": "user", "content": [{"type": "input_audio"}]}),
            "text content parts", route="v1/chat/completions"),
    Hostile("chat-content-part-a-string", chat_message({"role": "user", "content": ["hi"]}), "text content parts",
            route="v1/chat/completions"),
    Hostile("chat-text-part-without-text", chat_message({"role": "user", "content": [{"type": "text"}]}), "text",
            route="v1/chat/completions"),
    Hostile("chat-no-messages", chat(messages=[]), "messages", route="v1/chat/completions"),
    Hostile("chat-request-template-untrusted", chat(chat_template="{{ messages }}"), "--trust-request-chat-template",
            route="v1/chat/completions"),
    Hostile("chat-template-kwargs-tokenize", chat(chat_template_kwargs={"tokenize": True}), "tokenize",
            route="v1/chat/completions"),
    Hostile("chat-template-kwargs-chat-template", chat(chat_template_kwargs={"chat_template": "{{ 1 }}"}),
            "chat_template", route="v1/chat/completions"),
    Hostile("chat-continue-and-generation-prompt", chat(continue_final_message=True), "continue_final_message",
            route="v1/chat/completions"),
    Hostile("chat-tool-choice-without-tools", chat(tool_choice={"type": "function", "function": {"name": "f"}}),
            "tool_choice", route="v1/chat/completions"),
    # -- structured output and other fields
    Hostile("guided-regex-unbalanced", completion(guided_regex="(a"), "regex"),
    Hostile("guided-grammar-broken", completion(guided_grammar="root ::= ("), "grammar"),
    Hostile("guided-two-constraints", completion(guided_regex="a", structured_outputs={"choice": ["a"]}),
            "one structured output"),
    Hostile("stream-options-without-stream", completion(stream_options={"include_usage": True}), "stream_options"),
    Hostile("cache-salt-empty", completion(cache_salt=""), "cache_salt"),
    Hostile("best-of-different-from-n", completion(best_of=3), "best_of"),
    Hostile("detokenize-id-2**63", {"tokens": [2**63]}, "tokens", route="detokenize"),
    Hostile("tokenize-prompt-and-messages", {"prompt": "a", "messages": CHAT["messages"]}, "prompt", route="tokenize"),
    # -- routes and methods
    Hostile("route-unknown", COMPLETION, "Not Found", status=404, route="v1/embeddings"),
    Hostile("route-dot-segments", None, "Not Found", status=404, route="v1/%2e%2e/%2e%2e/etc/passwd", method="GET"),
    Hostile("method-put-completions", COMPLETION, "Method Not Allowed", status=405, method="PUT"),
    Hostile("method-delete-models", None, "Method Not Allowed", status=405, route="v1/models", method="DELETE"),
    Hostile("method-post-health", COMPLETION, "Method Not Allowed", status=405, route="health"),
    Hostile("method-get-tokenize", None, "Method Not Allowed", status=405, route="tokenize", method="GET"),
    *numeric_rows(),
    *wrong_type_rows(),
]


@pytest.mark.parametrize("case", CATALOGUE, ids=[c.kind for c in CATALOGUE])
def test_hostile_request_is_refused(server, case: Hostile):
    error = assert_refused(case.send(server), case.status)
    assert case.says in error["message"] or case.says == error["param"], error
    assert_serving(server)


def test_wrong_method_is_typed_method_not_allowed(server):
    """405s are not InternalServerErrors (they were: only 400/401/404/503 had a type)."""
    error = assert_refused(server.get("v1/completions"), 405)
    assert error["type"] == "MethodNotAllowedError"
    assert assert_refused(server.post("v1/embeddings", {}), 404)["type"] == "NotFoundError"


def test_huge_prompt_is_refused_without_stalling_other_clients(server):
    """3 MB of text takes the tokenizer seconds (it is refused as too long at the end): that work
    runs off the event loop, so /health and a small request are served meanwhile."""
    prompt = "x" * 3_000_000
    with ThreadPoolExecutor(1) as pool:
        huge = pool.submit(server.post, "v1/completions", completion(prompt=prompt))
        time.sleep(0.3)
        assert server.get("health").status_code == 200
        assert_serving(server)
        served_meanwhile = not huge.done()
        error = assert_refused(huge.result(), 400)
    assert served_meanwhile
    assert error["param"] == "prompt" and str(MAX_MODEL_LEN) in error["message"]


def test_client_request_ids_are_not_trusted(server):
    """The server names requests itself: two at once with the same client-chosen id (vLLM's
    request_id field, the X-Request-Id header) both complete, under ids of their own."""
    body = completion(request_id="same-id", max_tokens=4, ignore_eos=True)
    with ThreadPoolExecutor(2) as pool:
        responses = list(pool.map(lambda _: server.post("v1/completions", body, headers={"X-Request-Id": "same-id"}),
                                  range(2)))
    assert [r.status_code for r in responses] == [200, 200], [r.text for r in responses]
    ids = [r.json()["id"] for r in responses]
    assert len(set(ids)) == 2 and "same-id" not in ids
    assert [r.json()["usage"]["completion_tokens"] for r in responses] == [4, 4]


def test_cache_salt_separates_prefix_caches(server):
    """Tenants with different cache_salts never hit each other's prefix-cache blocks; the same
    salt does, as unsalted requests do among themselves."""
    prompt = random.Random(uuid.uuid4().int).sample(range(1000, 40000), 40)  # sent by nobody before
    # Every full 16-token block but the one holding the prompt's last token: 2 blocks.
    reusable = (len(prompt) - 1) // 16 * 16
    alice, bob = f"alice-{uuid.uuid4()}", f"bob-{uuid.uuid4()}"

    def hits(cache_salt: str | None) -> float:
        before = server.metric("vllm:prefix_cache_hits_total")
        response = server.post("v1/completions", completion(prompt=prompt, cache_salt=cache_salt))
        assert response.status_code == 200, response.text
        return server.metric("vllm:prefix_cache_hits_total") - before

    assert hits(alice) == 0
    assert hits(bob) == 0  # alice's blocks are cached, but not for bob
    assert hits(None) == 0  # nor for requests without a salt
    assert hits(alice) == reusable
    assert hits(bob) == reusable
    assert hits(None) == reusable


def test_no_cors_headers_without_allowed_origins(server):
    origin = {"Origin": "https://evil.example"}
    response = server.post("v1/completions", COMPLETION, headers=origin)
    assert response.status_code == 200
    assert "access-control-allow-origin" not in response.headers
    preflight = httpx.options(server.url_for("v1", "completions"), headers={
        **origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})
    assert_refused(preflight, 405)
    assert not any(h.startswith("access-control-") for h in preflight.headers)


def test_default_body_limit_refuses_before_reading(server):
    """A Content-Length over the default 16 MiB is a 413 at once: the body is never sent."""
    sock = open_request(server, "v1/completions", content_length=DEFAULT_MAX_REQUEST_BODY_BYTES + 1)
    status, headers, body = read_response(sock, timeout=30)
    assert status == 413 and headers["connection"] == "close"
    assert set(json.loads(body)) == {"error"} and json.loads(body)["error"]["code"] == 413
    assert_serving(server)


def test_engine_survived_the_catalogue(server):
    assert server.get("health").status_code == 200
    engines = engine_core_pids(server.proc.pid)
    assert len(engines) == 1 and is_alive(engines[0])
    assert_serving(server)


# ---- raw HTTP ---------------------------------------------------------------------------------


def open_request(server: RemoteServer, route: str, content_length: int | None = None, body: bytes = b"",
                 headers: dict[str, str] | None = None) -> socket.socket:
    """A POST whose head (and the start of its body) is sent, and nothing more."""
    lines = [f"POST /{route} HTTP/1.1", f"Host: {HOST}:{server.port}", "Content-Type: application/json"]
    lines += [f"{k}: {v}" for k, v in {**server.headers(), **(headers or {})}.items()]
    if content_length is not None:
        lines.append(f"Content-Length: {content_length}")
    sock = socket.create_connection((HOST, server.port), timeout=60)
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
    return sock


def exchange(server: RemoteServer, sock: socket.socket, body: dict[str, Any]) -> int:
    """One request on a kept-alive connection; its response's status (the body read by length)."""
    content = json.dumps(body).encode()
    head = ["POST /v1/completions HTTP/1.1", f"Host: {HOST}:{server.port}", "Content-Type: application/json",
            f"Content-Length: {len(content)}", *(f"{k}: {v}" for k, v in server.headers().items())]
    sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + content)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536) or pytest.fail("the server closed a kept-alive connection")
    head_bytes, _, rest = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: *(\d+)", head_bytes).group(1))
    while len(rest) < length:
        rest += sock.recv(65536)
    return int(head_bytes.split()[1])


def read_response(sock: socket.socket, timeout: float) -> tuple[int, dict[str, str], bytes]:
    """The response, read until the server closes the connection (a socket timeout if it does not)."""
    sock.settimeout(timeout)
    data = b""
    with sock:
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in header_lines)}
    return int(status_line.split()[1]), headers, body


# ---- a server with every guard set ------------------------------------------------------------

API_KEY = "sk-minivllm-test-key"
BODY_LIMIT = 4096
READ_TIMEOUT_S = 2.0
GOOD_ORIGIN = "https://good.example"


@pytest.fixture(scope="module")
def guarded(tiny_llama_dir):
    with RemoteServer(tiny_llama_dir, [
        *TINY_SERVER_ARGS, "--served-model-name", MODEL_NAME, "--max-request-body-bytes", str(BODY_LIMIT),
        "--request-read-timeout", str(READ_TIMEOUT_S), "--allowed-origins", GOOD_ORIGIN,
        "--trust-request-chat-template",
    ], api_key=API_KEY) as remote:
        yield remote


KEYED_ROUTES = [("GET", "v1/models"), ("POST", "v1/completions"), ("POST", "v1/chat/completions"),
                ("POST", "tokenize"), ("POST", "detokenize"), ("GET", "metrics"), ("GET", "version"),
                ("GET", "docs"), ("GET", "openapi.json"), ("GET", "no-such-route")]
WRONG_KEYS = [{}, {"Authorization": "Bearer wrong-key"}, {"Authorization": API_KEY},
              {"Authorization": f"Basic {API_KEY}"}, {"Authorization": f"Bearer {API_KEY}x"},
              {"Authorization": f"Bearer {API_KEY[:-1]}"}, {"Authorization": f"bearer {API_KEY}"}]


@pytest.mark.parametrize(("method", "route"), KEYED_ROUTES, ids=[r for _, r in KEYED_ROUTES])
def test_api_key_guards_every_route_but_health(guarded, method, route):
    url = guarded.url_for(route)
    for headers in WRONG_KEYS:
        response = httpx.request(method, url, json={} if method == "POST" else None, headers=headers)
        assert assert_refused(response, 401)["type"] == "AuthenticationError"
        assert response.headers["www-authenticate"] == "Bearer"
    with_key = httpx.request(method, url, json=COMPLETION if method == "POST" else None,
                             headers=guarded.headers())
    assert with_key.status_code != 401, with_key.text


def test_health_is_open_and_the_key_opens_the_rest(guarded):
    assert httpx.get(guarded.url_for("health")).status_code == 200
    assert guarded.get("metrics").status_code == 200
    assert guarded.get("version").status_code == 200
    with guarded.client() as good:
        assert [m.id for m in good.models.list().data] == [MODEL_NAME]
        assert good.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=2).usage.completion_tokens >= 1
    assert_serving(guarded)


def test_body_limit_counts_bytes_exactly(guarded):
    """A body of exactly the limit is served; one byte more is a 413, by Content-Length."""
    body = json.dumps(completion(ignore_eos=True)).encode()
    at_limit = body[:-1] + b" " * (BODY_LIMIT - len(body)) + b"}"
    assert len(at_limit) == BODY_LIMIT
    response = guarded.post("v1/completions", content=at_limit, headers={"Content-Type": "application/json"})
    assert response.status_code == 200, response.text
    sock = open_request(guarded, "v1/completions", content_length=BODY_LIMIT + 1, body=at_limit + b" ")
    status, headers, raw = read_response(sock, timeout=30)
    assert status == 413 and headers["connection"] == "close"
    assert str(BODY_LIMIT) in json.loads(raw)["error"]["message"]
    assert_serving(guarded)


def test_body_limit_counts_a_chunked_body_as_it_arrives(guarded):
    """Without a Content-Length the body is counted chunk by chunk: the one that crosses the
    limit ends the request with a 413 (the rest is never read)."""
    chunk = b" " * 1000
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(5)) + b"0\r\n\r\n"
    sock = open_request(guarded, "v1/completions", headers={"Transfer-Encoding": "chunked"}, body=chunks)
    status, headers, raw = read_response(sock, timeout=30)
    assert status == 413 and headers["connection"] == "close"
    # The type is the status's phrase, which Python 3.13 renamed (Content Too Large).
    assert json.loads(raw)["error"]["code"] == 413 and json.loads(raw)["error"]["type"].endswith("TooLargeError")
    assert_serving(guarded)


def test_a_client_still_sending_a_refused_body_reads_its_response(guarded):
    """A client that sends all of an 8 MiB body before it reads gets the 413 and then end of file.
    Closing with the body unread would make the kernel answer with a reset, which ends the
    client's read with an error and can destroy the response; so the server, its response out,
    reads and discards what still comes (for up to LINGER_S, 2 s) before it closes."""
    size = 8 << 20
    sock = open_request(guarded, "v1/completions", content_length=size)
    try:
        sock.sendall(b" " * size)
    except OSError as e:
        raise AssertionError(f"the server cut the body off: {e!r}") from None
    status, headers, raw = read_response(sock, timeout=30)
    assert status == 413 and headers["connection"] == "close"
    assert str(BODY_LIMIT) in json.loads(raw)["error"]["message"]
    assert_serving(guarded)


def trickle(sock: socket.socket, byte: bytes, until: float) -> threading.Thread:
    """A thread sending `byte` every 0.2 s until `until` (monotonic) or the server closes."""

    def send() -> None:
        try:
            while time.monotonic() < until:
                sock.sendall(byte)
                time.sleep(0.2)
        except OSError:  # the server closed the connection
            pass

    sender = threading.Thread(target=send)
    sender.start()
    return sender


def test_slow_loris_is_cut_off_while_others_are_served(guarded):
    """Two clients send their headers and part of a body: one then stops, one trickles a byte at
    a time. Others are served meanwhile; both slow ones get a 408 and a closed connection once
    the read timeout has passed since their headers (trickling does not extend it).

    The trickling one reads its response only after it has sent for another second: bytes sent
    to a socket already closed would draw a reset, which can destroy the unread 408, so the
    server lingers (LINGER_S, 2 s) before it closes a connection whose client is still sending."""
    start = time.monotonic()
    silent = open_request(guarded, "v1/completions", content_length=1000, body=b'{"prompt": ')
    trickling = open_request(guarded, "v1/completions", content_length=1000, body=b'{"prompt": ')

    sender = trickle(trickling, b" ", until=start + READ_TIMEOUT_S + 1.0)
    assert_serving(guarded)
    assert time.monotonic() - start < READ_TIMEOUT_S  # served while both hang
    for sock in (silent, trickling):
        if sock is trickling:
            sender.join()
        status, headers, raw = read_response(sock, timeout=30)
        assert status == 408 and headers["connection"] == "close"
        assert json.loads(raw)["error"]["type"] == "RequestTimeoutError"
    elapsed = time.monotonic() - start
    assert READ_TIMEOUT_S <= elapsed < 3 * READ_TIMEOUT_S
    assert_serving(guarded)


def test_slow_heads_are_cut_off_while_others_are_served(guarded):
    """A client that connects and sends nothing, and one that trickles its headers, lose their
    connections once the read timeout has passed (no response: no request came). Meanwhile a
    keep-alive connection is served three times, idle between for longer than the timeout in all
    (each response restarts its wait for the next head)."""
    start = time.monotonic()
    silent = socket.create_connection((HOST, guarded.port))
    trickling = socket.create_connection((HOST, guarded.port))
    trickling.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Pad: ")

    sender = trickle(trickling, b"a", until=start + READ_TIMEOUT_S + 1.0)  # past the cut, within the linger
    with socket.create_connection((HOST, guarded.port), timeout=60) as keep_alive:
        for i in range(3):
            if i:
                time.sleep(0.6 * READ_TIMEOUT_S)
            assert exchange(guarded, keep_alive, completion(ignore_eos=True)) == 200
            if not i:
                assert time.monotonic() - start < READ_TIMEOUT_S  # served while both hang
    sender.join()
    for sock in (silent, trickling):
        sock.settimeout(30)
        with sock:
            assert sock.recv(1024) == b""  # closed, nothing sent
    elapsed = time.monotonic() - start
    assert READ_TIMEOUT_S <= elapsed < 3 * READ_TIMEOUT_S
    assert_serving(guarded)


def test_unauthenticated_body_is_never_read(guarded):
    """Without the key the request is refused at once, its body unread, and the connection
    closed: no slow-loris hold on a guarded server either."""
    sock = open_request(guarded, "v1/completions", content_length=1000, body=b'{"prompt": ',
                        headers={"Authorization": "Bearer wrong-key"})
    status, headers, raw = read_response(sock, timeout=READ_TIMEOUT_S / 2)
    assert status == 401 and headers["connection"] == "close"
    assert json.loads(raw)["error"]["type"] == "AuthenticationError"


def test_cors_allows_the_given_origins_only(guarded):
    keyed = guarded.headers()
    response = guarded.get("v1/models", headers={"Origin": GOOD_ORIGIN})
    assert response.status_code == 200 and response.headers["access-control-allow-origin"] == GOOD_ORIGIN
    response = guarded.get("v1/models", headers={"Origin": "https://evil.example"})
    assert response.status_code == 200 and "access-control-allow-origin" not in response.headers
    # A refusal carries the header too, so the page's script can read why.
    response = httpx.get(guarded.url_for("v1", "models"), headers={"Origin": GOOD_ORIGIN})
    assert_refused(response, 401)
    assert response.headers["access-control-allow-origin"] == GOOD_ORIGIN
    # Preflights carry no key (browsers send none); only the given origin passes.
    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"}
    preflight = httpx.options(guarded.url_for("v1", "chat", "completions"), headers={"Origin": GOOD_ORIGIN, **ask})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == GOOD_ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    preflight = httpx.options(guarded.url_for("v1", "chat", "completions"),
                              headers={"Origin": "https://evil.example", **ask})
    assert preflight.status_code == 400 and "access-control-allow-origin" not in preflight.headers
    assert guarded.post("v1/completions", COMPLETION, headers={**keyed, "Origin": GOOD_ORIGIN}).status_code == 200


def test_trusted_request_chat_template_runs_and_its_errors_are_400s(guarded, tiny_llama_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    response = guarded.post("v1/chat/completions", chat(chat_template=template, add_generation_prompt=False))
    assert response.status_code == 200, response.text
    expected = len(tokenizer.encode("[user] Hello there\n", add_special_tokens=False))
    assert response.json()["usage"]["prompt_tokens"] == expected
    for bad, says in (("{{ raise_exception('no system prompt allowed') }}", "no system prompt allowed"),
                      ("{% for m in messages %}", "chat template"),
                      ("{{ ''.__class__.__mro__ }}", "unsafe"),
                      ("{% for i in range(10**9) %}x{% endfor %}", "range")):
        error = assert_refused(guarded.post("v1/chat/completions", chat(chat_template=bad)), 400)
        assert says in error["message"], error
    assert_serving(guarded)


# ---- in process: the app over a fake engine ---------------------------------------------------


def test_internal_errors_show_no_message_path_or_data(monkeypatch):
    """An exception inside a handler is a 500 that names its type only: its message (here a path
    and another user's prompt) stays in the server's log."""
    secret = "/home/alice/.cache/minivllm/key.py: alice's prompt was 'launch codes'"

    async def broken(self, request):
        raise RuntimeError(secret)

    monkeypatch.setattr(OpenAIServingCompletion, "create_completion", broken)
    client = TestClient(build_app(fake_engine(), ["fake"]), raise_server_exceptions=False)
    response = client.post("/v1/completions", json={"prompt": "hi"})
    error = assert_refused(response, 500)
    assert error == {"message": "Internal server error: RuntimeError", "type": "InternalServerError",
                     "param": None, "code": 500}
    assert "alice" not in response.text and "launch" not in response.text

    async def dead(self, request):
        raise EngineDeadError("The engine core died; restart the engine to continue.")

    monkeypatch.setattr(OpenAIServingCompletion, "create_completion", dead)
    assert_refused(client.post("/v1/completions", json={"prompt": "hi"}), 503)


def test_api_key_is_compared_in_constant_time(monkeypatch):
    """The key check is hmac.compare_digest over the whole header, whatever route is asked."""
    compared: list[tuple[bytes, bytes]] = []
    real = middleware.hmac.compare_digest

    def spy(given: bytes, expected: bytes) -> bool:
        compared.append((given, expected))
        return real(given, expected)

    monkeypatch.setattr(middleware.hmac, "compare_digest", spy)
    client = TestClient(build_app(fake_engine(), ["fake"], FrontendArgs(api_key="k3y")))
    assert client.get("/version", headers={"Authorization": "Bearer guess"}).status_code == 401
    assert client.get("/version", headers={"Authorization": "Bearer k3y"}).status_code == 200
    assert client.get("/health").status_code == 200
    assert compared == [(b"Bearer guess", b"Bearer k3y"), (b"Bearer k3y", b"Bearer k3y")]


class FakeTransport:
    """Just what uvicorn's protocol asks of a connection."""

    def __init__(self) -> None:
        self.written, self.eof_written, self.closed = b"", False, False

    def get_extra_info(self, name: str) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(name)

    def write(self, data: bytes) -> None:
        self.written += data

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof_written = True

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def test_head_timeout_spares_requests_in_progress():
    """The protocol closes a connection whose next head is late: none at all, or a trickled one
    (that one lingers: end of file sent, what still comes read and dropped, closed once LINGER_S
    has passed); never one whose request, however slow, is in progress; and, once that request is
    answered, it waits for the next head afresh."""
    timeout = 0.2
    release = asyncio.Event()

    async def slow_app(scope, receive, send):
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async def main():
        config = uvicorn.Config(slow_app, log_config=None, http=h11_protocol(timeout))
        config.load()

        def connect() -> tuple[Any, FakeTransport]:
            protocol = config.http_protocol_class(config=config, server_state=ServerState(), app_state={})
            transport = FakeTransport()
            protocol.connection_made(transport)
            return protocol, transport

        _, silent = connect()
        trickling_protocol, trickling = connect()
        busy_protocol, busy = connect()
        busy_protocol.data_received(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        for i in range(6):  # 0.3 s of one header byte every 0.05 s
            trickling_protocol.data_received(b"a" if i else b"GET / HTTP/1.1\r\nX: a")
            await asyncio.sleep(timeout / 4)
        in_time = (silent.closed, trickling.eof_written and not trickling.closed, busy.eof_written or busy.closed)
        trickling_protocol.data_received(b"\r\n\r\nGET / HTTP/1.1\r\n\r\n")  # too late: dropped
        release.set()
        await asyncio.sleep(timeout / 4)
        answered = busy.written.startswith(b"HTTP/1.1 200") and not busy.closed
        await asyncio.sleep(timeout * 1.5)
        assert not trickling.closed and trickling.written == b""
        await asyncio.sleep(LINGER_S)
        assert trickling.closed
        return in_time, answered, busy.closed

    in_time, answered, busy_closed_later = asyncio.run(main())
    assert in_time == (True, True, False)
    assert answered and busy_closed_later
