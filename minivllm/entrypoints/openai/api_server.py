"""The OpenAI-compatible HTTP server: FastAPI routes over one AsyncLLM, run by uvicorn.

Every error leaves as an OpenAI error body with the right status: 400 for bad input (including
malformed JSON and validation errors, never a 500), 401 without the API key, 404 for an unknown
model, 503 once the engine is dead. A client that disconnects aborts its request in the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hmac
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import minivllm
from minivllm.engine.arg_utils import AsyncEngineArgs
from minivllm.engine.async_llm import AsyncLLM
from minivllm.engine.exceptions import EngineDeadError
from minivllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from minivllm.entrypoints.openai.serving import OpenAIError, error_body
from minivllm.entrypoints.openai.serving_chat import OpenAIServingChat
from minivllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from minivllm.logger import init_logger
from minivllm.metrics.prometheus import render

logger = init_logger(__name__)


def error_response(message: str, status: int, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status)


def build_app(engine: AsyncLLM, served_model_names: list[str], api_key: str | None = None) -> FastAPI:
    completions = OpenAIServingCompletion(engine, served_model_names)
    chat = OpenAIServingChat(engine, served_model_names)
    model_config = engine.vllm_config.model_config

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        engine.shutdown()

    app = FastAPI(title="minivllm OpenAI-compatible server", version=minivllm.__version__, lifespan=lifespan)

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, exc: ValueError) -> JSONResponse:
        return error_response(str(exc), 400)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return error_response(f"Malformed JSON body: {first.get('ctx', {}).get('error', 'cannot parse')}", 400)
        location = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        message = f"{first.get('msg', 'Invalid request')}" + (f" (at {location})" if location else "")
        return error_response(message, 400, location or None)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(str(exc), 503)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(str(exc.detail), exc.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("Unhandled error")
        return error_response(f"Internal server error: {type(exc).__name__}", 500)

    if api_key is not None:
        @app.middleware("http")
        async def _authenticate(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
            if request.url.path.startswith("/v1"):
                expected = f"Bearer {api_key}"
                given = request.headers.get("Authorization", "")
                if not hmac.compare_digest(given.encode(), expected.encode()):
                    return error_response("Invalid or missing API key.", 401)
            return await call_next(request)

    async def respond(result: Any, raw: Request) -> Response:
        if isinstance(result, AsyncIterator):
            return StreamingResponse(result, media_type="text/event-stream")
        return JSONResponse(result.model_dump())

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw: Request) -> Response:
        return await with_cancellation(raw, lambda: completions.create_completion(request), respond)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw: Request) -> Response:
        return await with_cancellation(raw, lambda: chat.create_chat_completion(request), respond)

    @app.get("/v1/models")
    async def show_models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, root=model_config.model, max_model_len=model_config.max_model_len)
                               for name in served_model_names])

    @app.get("/health")
    async def health() -> Response:
        engine.check_health()
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": minivllm.__version__}

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        completions.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise OpenAIError("Give exactly one of prompt and messages.", 400)
        if request.messages is not None:
            _, tokens = chat.render(request.messages, request)
        else:
            tokens = completions.tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
        return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=model_config.max_model_len)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        completions.check_model(request.model)
        vocab = model_config.hf_config.vocab_size
        if any(not 0 <= t < vocab for t in request.tokens):
            raise OpenAIError(f"Token ids must be in [0, {vocab}).", 400, "tokens")
        return DetokenizeResponse(prompt=completions.tokenizer.decode(request.tokens))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render(engine.get_metrics), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


async def with_cancellation(
    raw: Request, handler: Callable[[], Awaitable[Any]], respond: Callable[[Any, Request], Awaitable[Response]]
) -> Response:
    """Run a handler, but cancel it (aborting its requests) if the client goes away first.

    Streaming responses are cancelled by Starlette itself when the client disconnects; this
    covers the time before the first byte, and whole non-streaming responses.
    """
    task = asyncio.ensure_future(handler())
    disconnect = asyncio.ensure_future(_wait_for_disconnect(raw))
    done, _ = await asyncio.wait({task, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        disconnect.cancel()
        return await respond(task.result(), raw)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return Response(status_code=499)


async def _wait_for_disconnect(raw: Request) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


# ---- CLI --------------------------------------------------------------------------------------


def served_names(args: argparse.Namespace) -> list[str]:
    if args.served_model_name:
        return list(args.served_model_name)
    return [args.model if args.model is not None else "SmolLM2-135M-Instruct"]


def run_server(args: argparse.Namespace) -> None:
    if args.model_tag is not None:
        args.model = args.model_tag
    engine_args = AsyncEngineArgs.from_cli_args(args)
    vllm_config = engine_args.create_engine_config()
    names = served_names(args)
    vllm_config = dataclasses.replace(
        vllm_config, model_config=dataclasses.replace(vllm_config.model_config, served_model_name=names[0])
    )
    url = f"http://{args.host or '0.0.0.0'}:{args.port}"
    server = uvicorn.Server(uvicorn.Config(
        _AppFactory(vllm_config, names, args.api_key, url), factory=True, host=args.host, port=args.port,
        log_level=args.uvicorn_log_level, timeout_graceful_shutdown=args.shutdown_timeout,
    ))
    # uvicorn re-raises SIGTERM/SIGINT once its graceful shutdown is done; by then every in-flight
    # request has finished and the engine is shut down, so that is a clean exit (status 0).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()


class _AppFactory:
    """Builds the engine inside uvicorn's event loop (AsyncLLM's sockets belong to that loop)."""

    def __init__(self, vllm_config: Any, names: list[str], api_key: str | None, url: str) -> None:
        self.vllm_config, self.names, self.api_key, self.url = vllm_config, names, api_key, url

    def __call__(self) -> FastAPI:
        engine = AsyncLLM(self.vllm_config)
        mc, cc = engine.vllm_config.model_config, engine.vllm_config.cache_config
        logger.info(
            "Serving %s as %s at %s: dtype %s, max_model_len %d, KV cache %d blocks of %d tokens",
            mc.model, self.names, self.url, mc.dtype, mc.max_model_len, cc.num_gpu_blocks, cc.block_size,
        )
        return build_app(engine, self.names, self.api_key)
