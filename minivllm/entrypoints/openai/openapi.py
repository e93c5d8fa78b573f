"""What /openapi.json says each route answers: its success body (JSON; an SSE stream for the
generating routes; Prometheus text for /metrics) and every error status it can send, each with
OpenAI's error body (protocol.ErrorResponse).

FastAPI documents a validation error as a 422 with its own body; this server sends it as a 400
with OpenAI's (api_server.py), so `document` drops FastAPI's entry. tests/entrypoints/openai/
test_server_fuzz.py holds the server to this document: every response's status, media type
and body must be documented here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from minivllm.entrypoints.openai.protocol import ErrorResponse

ERROR_DESCRIPTIONS = {
    400: "The request is malformed or invalid: bad JSON, a field's type or value, a prompt over the context.",
    401: "The API key (`Authorization: Bearer KEY`) is missing or wrong.",
    404: "The request names a model this server does not serve.",
    408: "The request body did not arrive within the server's read timeout.",
    413: "The request body is larger than the server's limit.",
    415: "The request body is not JSON (Content-Type: application/json).",
    500: "An unexpected server error; the message names the exception's type only.",
    503: "The engine has died; the server exits shortly, for a supervisor to restart it.",
}

# What any route with a JSON body can be refused for before its handler runs (the body's
# bounds, middleware.py; its parsing and validation, api_server.py), and what any route can fail with.
BODY_ERRORS = (400, 408, 413, 415)
REF = "#/components/schemas/"
ANY_ROUTE_ERRORS = (500,)


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` entries for these error statuses, and for every route's own."""
    return {status: {"model": ErrorResponse, "description": ERROR_DESCRIPTIONS[status]}
            for status in sorted({*statuses, *ANY_ROUTE_ERRORS})}


def json_or_stream(model: type[BaseModel], chunk: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """The 200 of a route that answers `model` as JSON, or with `"stream": true` a stream of
    server-sent events, each `data: <chunk JSON>` (an ErrorResponse if the request fails after the
    first), then `data: [DONE]`. The schema is each event's, as OpenAPI 3.1 reads an event
    stream's (`document` puts `chunk` in the components)."""
    data = {"type": "string", "contentMediaType": "application/json", "contentSchema": {"anyOf": [
        {"$ref": f"{REF}{chunk.__name__}"}, {"$ref": f"{REF}{ErrorResponse.__name__}"}]}}
    return {200: {
        "model": model,
        "description": f"A {model.__name__}; with `stream: true`, server-sent events of {chunk.__name__}s, "
                       "then `data: [DONE]`.",
        "content": {"text/event-stream": {"schema": {
            "type": "object", "required": ["data"],
            "properties": {"event": {"type": "string"}, "data": {"anyOf": [{"const": "[DONE]"}, data]}},
        }}},
    }}


def document(app: FastAPI, open_routes: frozenset[str], api_key: bool,
             stream_chunks: tuple[type[BaseModel], ...]) -> Callable[[], dict[str, Any]]:
    """app.openapi, corrected: no 422 (validation errors are 400s, documented on each route) nor
    the schemas only it used; the `stream_chunks` (json_or_stream's, which FastAPI does not see)
    in the components; with an API key, the bearer scheme and a 401 on every route but
    `open_routes`."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = generate()
        schemas = doc["components"]["schemas"]
        schemas.pop("HTTPValidationError", None)
        schemas.pop("ValidationError", None)
        for chunk in stream_chunks:
            chunk_schema = chunk.model_json_schema(ref_template=REF + "{model}", mode="serialization")
            schemas.update(chunk_schema.pop("$defs", {}))
            schemas[chunk.__name__] = chunk_schema
        if api_key:
            doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, operations in doc["paths"].items():
            for operation in operations.values():
                operation["responses"].pop("422", None)
                if api_key and path not in open_routes:
                    operation["security"] = [{"bearer": []}]
                    operation["responses"]["401"] = {
                        "description": ERROR_DESCRIPTIONS[401],
                        "content": {"application/json": {"schema": {"$ref": f"{REF}{ErrorResponse.__name__}"}}},
                    }
        return doc

    return openapi
