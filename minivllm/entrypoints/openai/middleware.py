"""The HTTP front end's guards, as ASGI middleware around the FastAPI app: the API key, and
bounds on a request body's size and on the time a client may take to send it (the head's is
http_protocol.py's).

Pure ASGI (not Starlette's BaseHTTPMiddleware): a refusal reads none of the body, and streamed
responses pass through untouched.
"""

from __future__ import annotations

import asyncio
import hmac

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minivllm.entrypoints.openai.serving import error_body

# Routes open without the API key: a load balancer's health probe carries none; the dashboard's
# page and files, which hold no data (the page takes the key as ?api_key=, checked by its route,
# and sends it as a header on every call).
OPEN_ROUTES = frozenset({"/health", "/dashboard"})
OPEN_PREFIXES = ("/dashboard/static/",)


class AuthenticationMiddleware:
    """`Authorization: Bearer KEY` on every route but OPEN_ROUTES, or a 401."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"] if scope["type"] == "http" else ""
        if path and path not in OPEN_ROUTES and not path.startswith(OPEN_PREFIXES):
            given = Headers(scope=scope).get("authorization", "").encode("latin-1")
            # Constant time: how long the comparison takes must not tell how much of a guess matched.
            if not hmac.compare_digest(given, self.expected):
                response = JSONResponse(error_body("Invalid or missing API key.", 401), status_code=401,
                                        headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RequestBodyLimitMiddleware:
    """A body over `max_bytes` is refused with 413, and one not complete `timeout` seconds after
    its headers with 408: a slow-loris client, trickling its body or never finishing it, would
    hold a connection and a buffer for nothing.

    A Content-Length over the limit is refused before any of the body is read; a chunked body is
    counted as it arrives, so at most `max_bytes` (and one chunk) is ever buffered. A response
    that leaves before its request's body was read whole closes the connection (the rest of the
    body is never read, so the connection cannot carry another request).
    """

    def __init__(self, app: ASGIApp, max_bytes: int, timeout: float) -> None:
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        length = headers.get("content-length")  # h11 has refused a malformed one already
        body_done = length in (None, "0") and "chunked" not in headers.get("transfer-encoding", "").lower()
        received = 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout

        async def receive_bounded() -> Message:
            nonlocal body_done, received
            if body_done:  # then only the disconnect is left to receive
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), deadline - loop.time())
            except asyncio.TimeoutError:
                raise HTTPException(408, f"The request body did not arrive within {self.timeout:g} s.") from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(413, self._too_large())
                body_done = not message.get("more_body", False)
            return message

        async def send_closing_unread(message: Message) -> None:
            if message["type"] == "http.response.start" and not body_done:
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        if length is not None and int(length) > self.max_bytes:
            response = JSONResponse(error_body(self._too_large(), 413), status_code=413)
            await response(scope, receive, send_closing_unread)
            return
        await self.app(scope, receive_bounded, send_closing_unread)

    def _too_large(self) -> str:
        return f"The request body is larger than this server's limit of {self.max_bytes} bytes."
