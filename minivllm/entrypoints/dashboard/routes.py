"""The dashboard's routes: the page (/dashboard, plain HTML + JS + SVG/canvas from static/, no
build step, nothing fetched from the network) and its data, /v1/engine/events.

/v1/engine/events is a Server-Sent Events stream: one `data:` message per engine step while the
client is connected (JSON: {"events": EngineEvents (core/events.py), "stats": SchedulerStats, the
same snapshot /metrics renders}), an `event: dropped` message with the count of messages this
client lost when it fell behind (its queue keeps the newest 256), and a comment each second the
stream is idle, to keep the connection alive. Connecting turns the engine's event collection on
(with a full snapshot first); the last client leaving turns it off. The stream ends when the
server shuts down.

With --api-key, /v1/engine/events is checked like every /v1 route (the Authorization header: the
page reads the stream with fetch() and a ReadableStream, which can send it, instead of
EventSource, which cannot, so the key never travels in a URL). /dashboard itself takes the key as
`?api_key=KEY` (a browser's navigation cannot send a header); the page keeps it in memory, drops
it from the address bar and sends it as a header. The static files hold code only, no data, and
are served without a key.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse

from minivllm.engine.async_llm import AsyncLLM
from minivllm.entrypoints.openai.serving import error_body

STATIC_DIR = Path(__file__).parent / "static"
STATIC_FILES = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
KEEP_ALIVE_S = 1.0  # also how soon an idle stream notices a shutdown


def add_dashboard_routes(app: FastAPI, engine: AsyncLLM, api_key: str | None,
                         shutting_down: Callable[[], bool] = lambda: False) -> None:
    """shutting_down: the server is stopping; open event streams end (else uvicorn's graceful
    shutdown would wait for them until its timeout)."""

    # Not in /openapi.json: a page, its files, and an endless event stream (documented in the
    # README) are no request/response contract for clients or the fuzzer.
    @app.get("/dashboard", include_in_schema=False)
    async def dashboard(raw: Request) -> Response:
        if api_key is not None and not _has_key(raw, api_key):
            return JSONResponse(error_body("Invalid or missing API key: open /dashboard?api_key=KEY.", 401),
                                status_code=401)
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html")

    @app.get("/dashboard/static/{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        if name not in STATIC_FILES:
            return JSONResponse(error_body(f"No such file: {name}", 404), status_code=404)
        return FileResponse(STATIC_DIR / name, media_type=STATIC_FILES[name])

    @app.get("/v1/engine/events", include_in_schema=False)
    async def engine_events(raw: Request) -> Response:
        try:
            subscription = await engine.subscribe_events()
        except ValueError as e:
            return JSONResponse(error_body(str(e), 501), status_code=501)

        async def stream() -> AsyncIterator[bytes]:
            dropped = 0
            try:
                yield b": connected\n\n"
                while not shutting_down():
                    try:
                        message = await asyncio.wait_for(subscription.get(), KEEP_ALIVE_S)
                    except asyncio.TimeoutError:
                        yield b": keep-alive\n\n"
                        continue
                    if subscription.dropped != dropped:
                        dropped = subscription.dropped
                        yield f"event: dropped\ndata: {dropped}\n\n".encode()
                    yield message
            finally:
                engine.unsubscribe_events(subscription)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _has_key(raw: Request, api_key: str) -> bool:
    given = raw.query_params.get("api_key")
    if given is None:
        return hmac.compare_digest(raw.headers.get("Authorization", "").encode(), f"Bearer {api_key}".encode())
    return hmac.compare_digest(given.encode(), api_key.encode())
