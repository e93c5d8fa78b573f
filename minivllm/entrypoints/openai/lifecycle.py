"""How the server ends: drained on SIGTERM, at once (status 1) when its engine dies.

SIGTERM (or SIGINT) is how a supervisor asks a server to go. The server then stops taking work
(new requests, /health included, get 503, so a load balancer routes elsewhere), lets the requests
in flight run to their end, and once none is left, or --shutdown-timeout has passed, shuts down
as uvicorn does (which waits up to the same timeout for connections to close). A second signal
ends it at once. When the engine core dies nothing can finish: the app answers 503 for a moment
and the server exits with status 1, so that the supervisor restarts it.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import uvicorn
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from minivllm.entrypoints.openai.serving import error_body


class ServerLifecycle:
    """What the HTTP server and the app share: the requests in flight, whether the server is
    draining, and whether the engine died."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.draining = False
        self.engine_died = False
        self.server: uvicorn.Server | None = None

    def on_engine_death(self) -> None:
        self.engine_died = True
        if self.server is not None:
            self.server.should_exit = True


class DrainMiddleware:
    """Counts the requests in flight; while draining, refuses new ones with 503."""

    def __init__(self, app: ASGIApp, lifecycle: ServerLifecycle) -> None:
        self.app, self.lifecycle = app, lifecycle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.lifecycle.draining:
            response = JSONResponse(error_body("The server is shutting down.", 503), status_code=503,
                                    headers={"Connection": "close"})
            await response(scope, receive, send)
            return
        self.lifecycle.in_flight += 1
        try:
            await self.app(scope, receive, send)  # returns once a streamed body has been sent whole
        finally:
            self.lifecycle.in_flight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining on the first SIGTERM/SIGINT (see the module's docstring)."""

    def __init__(self, config: uvicorn.Config, lifecycle: ServerLifecycle, timeout: float) -> None:
        super().__init__(config)
        self.lifecycle, self.timeout = lifecycle, timeout
        lifecycle.server = self

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.lifecycle.draining:  # a second signal: uvicorn's own shutdown, now
            super().handle_exit(sig, frame)
            return
        self.lifecycle.draining = True
        threading.Thread(target=self._exit_when_drained, name="ServerDrain", daemon=True).start()

    def _exit_when_drained(self) -> None:
        deadline = time.monotonic() + self.timeout
        while self.lifecycle.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        self.should_exit = True
