"""The API fuzzed from its own OpenAPI document (schemathesis): requests generated from every
route's documented request schema, valid and not, against the session's shared tiny-Llama server.

Every response must be documented: no 5xx, a documented status, a documented media type, and a
body that conforms to the documented schema (protocol.py's models; OpenAI's error body for every
error). Afterwards the server still serves and its KV cache is idle again.

Seeded and derandomized, so CI sends the same requests each run: about a thousand, most from
schemathesis's coverage phase (each field's boundary and invalid values). MINIVLLM_FUZZ_EXAMPLES
sets how many each route's random fuzzing phase adds (CI's 8; 150 makes about 1,600 requests in
all). Generating requests are bounded (`bound`): the engine is asked for a few tokens and
samples each, not for the rest of its context.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from server_utils import RemoteServer, fake_engine, wait_until_idle
from starlette.testclient import TestClient

from minivllm.entrypoints.openai.api_server import build_app
from minivllm.entrypoints.openai.cli_args import FrontendArgs
from minivllm.entrypoints.openai.middleware import OPEN_ROUTES
from minivllm.entrypoints.openai.protocol import ErrorResponse

FUZZ_EXAMPLES = int(os.environ.get("MINIVLLM_FUZZ_EXAMPLES", "8"))
SEED = 26
# A generated request asks for at most this many tokens and samples: enough to stream and to
# stop, little enough that a thousand requests take a CPU minutes, not hours.
MAX_TOKENS = 4
MAX_N = 2
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]

# Requests sent, by operation and status (reported by the last test; the long run counts them).
SENT: Counter[tuple[str, int]] = Counter()


# The document build_app writes (over a fake engine: it names no model); the first test checks
# that the server serves this very document. (Loaded at import, not from the server's URL
# through schemathesis.pytest.from_fixture: its lazy loader sets a private attribute of pytest's
# items that pytest 9 no longer has.)
DOCUMENT = build_app(fake_engine(), ["fake"]).openapi()
schema = schemathesis.openapi.from_dict(DOCUMENT)
schema.config.seed = SEED
schema.config.generation.update(max_examples=FUZZ_EXAMPLES, deterministic=True, database="none")


def test_the_fuzzed_document_is_the_servers(server: RemoteServer) -> None:
    response = server.get("openapi.json")
    assert response.status_code == 200
    assert response.json() == DOCUMENT


def bound(body: Any) -> None:
    """Cap a generating request's token and sample counts in place (a value of the wrong type
    stays, for the server to refuse)."""
    if not isinstance(body, dict):
        return
    for field in ("max_tokens", "max_completion_tokens"):
        value = body.get(field)
        if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS):
            body[field] = MAX_TOKENS
    for field in ("n", "best_of"):
        value = body.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_N:
            body[field] = MAX_N


@schema.parametrize()
@settings(derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_fuzz(case: schemathesis.Case, server: RemoteServer) -> None:
    if case.operation.path in ("/v1/completions", "/v1/chat/completions"):
        bound(case.body)
    response = case.call(base_url=server.url, timeout=60)
    SENT[(case.operation.label, response.status_code)] += 1
    case.validate_response(response, checks=CHECKS)


def test_the_document_with_an_api_key() -> None:
    """With --api-key (which the shared server has not), every route but /health documents the
    bearer scheme and the 401 that the key check sends, and that 401 is the documented body."""
    app = build_app(fake_engine(), ["fake"], FrontendArgs(api_key="k3y"))
    doc = app.openapi()
    assert doc["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, operations in doc["paths"].items():
        for operation in operations.values():
            guarded = path not in OPEN_ROUTES
            assert ("401" in operation["responses"]) == guarded, path
            assert ("security" in operation) == guarded, path
    response = TestClient(app).get("/version")
    assert response.status_code == 401
    ErrorResponse.model_validate(response.json())


def test_server_is_alive_and_idle_after_fuzzing(server: RemoteServer) -> None:
    print("fuzz requests by operation and status:", dict(sorted(SENT.items())), "total", SENT.total())
    assert SENT.total() > 0
    assert server.get("health").status_code == 200
    idle, metrics = wait_until_idle(server, refresh=True)
    assert idle, metrics
