"""The OpenAI-compatible HTTP server: FastAPI routes over one AsyncLLM, run by uvicorn.

Every error leaves as an OpenAI error body with the right status: 400 for bad input (including
malformed JSON and validation errors, never a 500), 401 without the API key, 404 for an unknown
model or route, 405 for a wrong method, 408 for a body too slow to arrive, 413 for one too large,
415 for one that is not JSON, 503 once the engine is dead (a stream it cuts ends with an error
event; the server then exits with status 1, so that a supervisor restarts it); a 500 names only
the exception's type. A client that disconnects aborts its request in the engine. Middleware
(middleware.py) checks the API key and bounds the body; CORS headers are sent only for the
--allowed-origins.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import minivllm
from minivllm.engine.arg_utils import AsyncEngineArgs
from minivllm.engine.async_llm import AsyncLLM
from minivllm.engine.exceptions import EngineDeadError
from minivllm.entrypoints.dashboard.routes import add_dashboard_routes
from minivllm.entrypoints.openai.cli_args import FrontendArgs
from minivllm.entrypoints.openai.http_protocol import h11_protocol
from minivllm.entrypoints.openai.lifecycle import DrainingServer, DrainMiddleware, ServerLifecycle
from minivllm.entrypoints.openai.middleware import (
    OPEN_ROUTES,
    AuthenticationMiddleware,
    RequestBodyLimitMiddleware,
)
from minivllm.entrypoints.openai.openapi import BODY_ERRORS, document, errors, json_or_stream
from minivllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from minivllm.entrypoints.openai.serving import SSE_DONE, OpenAIError, error_body, off_loop, sse
from minivllm.entrypoints.openai.serving_chat import OpenAIServingChat
from minivllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from minivllm.logger import init_logger
from minivllm.metrics.prometheus import render

logger = init_logger(__name__)


def error_response(message: str, status: int, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status, headers=headers)


def _is_json(content_type: str | None) -> bool:
    media_type = (content_type or "").split(";")[0].strip().lower()
    return media_type == "application/json" or (media_type.startswith("application/") and media_type.endswith("+json"))


# After the engine dies, the server answers 503 this long (open streams get their error events
# out, a health check sees the death) before it exits non-zero.
ENGINE_DEATH_EXIT_DELAY_S = 1.0


def build_app(engine: AsyncLLM, served_model_names: list[str], frontend: FrontendArgs | None = None,
              lifecycle: ServerLifecycle | None = None) -> FastAPI:
    """lifecycle: shared with the CLI's server (lifecycle.py): the app counts the requests in
    flight for its drain on SIGTERM, and tells it when the engine core has died."""
    frontend = frontend or FrontendArgs()
    completions = OpenAIServingCompletion(engine, served_model_names)
    chat = OpenAIServingChat(engine, served_model_names, frontend.trust_request_chat_template)
    model_config = engine.vllm_config.model_config

    async def watch_engine() -> None:
        while not engine.errored:
            await asyncio.sleep(0.2)
        logger.error("The engine core died; the server exits in %.0f s.", ENGINE_DEATH_EXIT_DELAY_S)
        await asyncio.sleep(ENGINE_DEATH_EXIT_DELAY_S)
        assert lifecycle is not None
        lifecycle.on_engine_death()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        watcher = asyncio.create_task(watch_engine()) if lifecycle is not None else None
        yield
        if watcher is not None:
            watcher.cancel()
        engine.shutdown()

    app = FastAPI(title="minivllm OpenAI-compatible server", version=minivllm.__version__, lifespan=lifespan)
    app.openapi = document(app, OPEN_ROUTES, api_key=frontend.api_key is not None,  # type: ignore[method-assign]
                           stream_chunks=(CompletionStreamResponse, ChatCompletionStreamResponse))

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, exc: ValueError) -> JSONResponse:
        return error_response(str(exc), 400)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        if not _is_json(request.headers.get("content-type")):
            # FastAPI reads no other body as JSON: say so rather than that fields are missing.
            return error_response("The request body must be JSON, sent with Content-Type: application/json.", 415)
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return error_response(f"Malformed JSON body: {first.get('ctx', {}).get('error', 'cannot parse')}", 400)
        location = [str(x) for x in first.get("loc", ()) if x != "body"]
        message = f"{first.get('msg', 'Invalid request')}" + (f" (at {'.'.join(location)})" if location else "")
        # OpenAI's param names the request's field, not the path inside it.
        return error_response(message, 400, location[0] if location else None)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(str(exc), 503)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(str(exc.detail), exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("Unhandled error")
        return error_response(f"Internal server error: {type(exc).__name__}", 500)

    # The last added runs first: CORS (so that refusals carry its headers too), the drain on
    # SIGTERM, the body's bounds, then the API key.
    if frontend.api_key is not None:
        app.add_middleware(AuthenticationMiddleware, api_key=frontend.api_key)
    app.add_middleware(RequestBodyLimitMiddleware, max_bytes=frontend.max_request_body_bytes,
                       timeout=frontend.request_read_timeout)
    if lifecycle is not None:
        app.add_middleware(DrainMiddleware, lifecycle=lifecycle)
    if frontend.allowed_origins:
        # Bearer keys, not cookies: no credentials. Any header, for the clients' own (x-stainless-*).
        app.add_middleware(CORSMiddleware, allow_origins=list(frontend.allowed_origins),
                           allow_methods=["GET", "POST"], allow_headers=["*"])

    async def respond(result: Any, raw: Request) -> Response:
        if isinstance(result, AsyncIterator):
            return StreamingResponse(with_error_events(result), media_type="text/event-stream")
        return JSONResponse(result.model_dump())

    @app.post("/v1/completions", responses={**json_or_stream(CompletionResponse, CompletionStreamResponse),
                                            **errors(*BODY_ERRORS, 404, 503)})
    async def create_completion(request: CompletionRequest, raw: Request) -> Response:
        return await with_cancellation(raw, lambda: completions.create_completion(request), respond)

    @app.post("/v1/chat/completions", responses={
        **json_or_stream(ChatCompletionResponse, ChatCompletionStreamResponse), **errors(*BODY_ERRORS, 404, 503)})
    async def create_chat_completion(request: ChatCompletionRequest, raw: Request) -> Response:
        return await with_cancellation(raw, lambda: chat.create_chat_completion(request), respond)

    @app.get("/v1/models", responses=errors())
    async def show_models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, root=model_config.model, max_model_len=model_config.max_model_len)
                               for name in served_model_names])

    # response_class=Response on the routes that answer no JSON: FastAPI then documents their
    # success as given and their errors as JSON (it would put an error model under text/plain).
    @app.get("/health", response_class=Response,
             responses={200: {"description": "The engine is alive (an empty body)."}, **errors(503)})
    async def health() -> Response:
        engine.check_health()
        return Response(status_code=200)

    @app.get("/version", responses=errors())
    async def version() -> VersionResponse:
        return VersionResponse(version=minivllm.__version__)

    @app.post("/tokenize", responses=errors(*BODY_ERRORS, 404))
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        completions.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise OpenAIError("Give exactly one of prompt and messages.", 400)
        if request.messages is not None:
            _, tokens = await off_loop(chat.render, request.messages, request)
        else:
            tokens = await off_loop(completions.tokenizer.encode, request.prompt,
                                    add_special_tokens=request.add_special_tokens)
        return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=model_config.max_model_len)

    @app.post("/detokenize", responses=errors(*BODY_ERRORS, 404))
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        completions.check_model(request.model)
        vocab = model_config.hf_config.vocab_size
        if any(not 0 <= t < vocab for t in request.tokens):
            raise OpenAIError(f"Token ids must be in [0, {vocab}).", 400, "tokens")
        return DetokenizeResponse(prompt=await off_loop(completions.tokenizer.decode, request.tokens))

    @app.get("/metrics", response_class=Response,
             responses={200: {"description": "Prometheus text exposition.",
                              "content": {"text/plain": {"schema": {"type": "string"}}}}, **errors()})
    async def metrics() -> Response:
        return Response(render(engine.get_metrics), media_type="text/plain; version=0.0.4; charset=utf-8")

    # Open event streams end when the server starts draining (else the drain would wait for them).
    add_dashboard_routes(app, engine, frontend.api_key, lambda: lifecycle is not None and lifecycle.draining)
    return app


async def with_error_events(stream: AsyncIterator[str]) -> AsyncIterator[str]:
    """An SSE stream that ends with an error event and [DONE] if the request fails mid-stream
    (the engine died, say): the status line is long sent, so the error goes in the stream, as
    vLLM sends it, rather than as a cut connection the client cannot tell from a network fault."""
    try:
        async for chunk in stream:
            yield chunk
    except EngineDeadError as e:
        yield sse(error_body(str(e), 503))
        yield SSE_DONE
    except OpenAIError as e:
        yield sse(e.body())
        yield SSE_DONE
    except Exception as e:  # noqa: BLE001 - reported to the client without internals, logged here
        logger.exception("A streamed request failed")
        yield sse(error_body(f"Internal server error: {type(e).__name__}", 500))
        yield SSE_DONE


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
    frontend = FrontendArgs.from_cli_args(args)
    lifecycle = ServerLifecycle()
    factory = _AppFactory(vllm_config, names, frontend, url, lifecycle)
    server = DrainingServer(uvicorn.Config(
        factory, factory=True, host=args.host, port=args.port,
        http=h11_protocol(head_timeout=frontend.request_read_timeout),
        log_level=args.uvicorn_log_level, timeout_graceful_shutdown=args.shutdown_timeout,
    ), lifecycle, timeout=args.shutdown_timeout)
    # uvicorn re-raises a second SIGTERM/SIGINT once its shutdown is done; by then the engine is
    # shut down, so that is a clean exit (status 0).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    if lifecycle.engine_died:
        raise SystemExit(1)


class _AppFactory:
    """Builds the engine inside uvicorn's event loop (AsyncLLM's sockets belong to that loop)."""

    def __init__(self, vllm_config: Any, names: list[str], frontend: FrontendArgs, url: str,
                 lifecycle: ServerLifecycle) -> None:
        self.vllm_config, self.names, self.frontend, self.url = vllm_config, names, frontend, url
        self.lifecycle = lifecycle

    def __call__(self) -> FastAPI:
        engine = AsyncLLM(self.vllm_config)
        mc, cc = engine.vllm_config.model_config, engine.vllm_config.cache_config
        logger.info(
            "Serving %s as %s at %s: dtype %s, max_model_len %d, KV cache %d blocks of %d tokens",
            mc.model, self.names, self.url, mc.dtype, mc.max_model_len, cc.num_gpu_blocks, cc.block_size,
        )
        logger.info("Dashboard at %s/dashboard", self.url)
        return build_app(engine, self.names, self.frontend, self.lifecycle)
