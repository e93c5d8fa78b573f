"""uvicorn's HTTP/1.1 protocol with a deadline on each request's head, and a lingering close.

uvicorn waits for a request's head (request line and headers) without limit: a client that
connects and sends nothing, or trickles its headers a byte at a time (the classic slow loris),
holds its connection and a file descriptor for good. Here a connection whose next head has not
arrived `head_timeout` seconds after it opened, or after its previous response, is closed. The
body's deadline is RequestBodyLimitMiddleware's: the app sees a request once its head is in.

A connection closed while its client is still sending (a 408 or 413 before the whole body came,
a 400 for a malformed request, a head cut off) must not simply be closed: bytes arriving at a
closed socket make the kernel answer with a reset, and a reset can destroy the response in the
client's buffer before the client has read it. So such a close lingers, as Apache's and nginx's
do: the server shuts down its sending side (the client reads the response, then end of file),
discards whatever still arrives, and closes once the client closes or LINGER_S has passed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

# The longest a closing connection keeps reading (and discarding) a client's unsent remainder.
LINGER_S = 2.0


class LingeringTransport:
    """The connection's transport, as uvicorn's protocol sees it: close() lingers while
    `client_sending()` says the client may still be sending; everything else is the transport's."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop,
                 client_sending: Callable[[], bool]) -> None:
        self._transport, self._loop, self._client_sending = transport, loop, client_sending
        self._linger: asyncio.TimerHandle | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    @property
    def lingering(self) -> bool:
        return self._linger is not None

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def write(self, data: bytes) -> None:
        if not self.lingering:  # closed, as far as uvicorn is concerned
            self._transport.write(data)

    def close(self) -> None:
        if (self.lingering or self._transport.is_closing() or not self._client_sending()
                or not self._transport.can_write_eof()):
            self.stop_lingering()
            return
        self._transport.write_eof()  # end of file once the response is out
        self._transport.resume_reading()  # read on: a paused socket fills up and the client stalls
        self._linger = self._loop.call_later(LINGER_S, self._transport.close)

    def stop_lingering(self) -> None:
        if self._linger is not None:
            self._linger.cancel()
        self._transport.close()


class HeadTimeoutH11Protocol(H11Protocol):
    head_timeout: float

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._lingering_transport = LingeringTransport(transport, asyncio.get_running_loop(), self._client_sending)
        super().connection_made(self._lingering_transport)  # type: ignore[arg-type]
        self._head_timer: asyncio.TimerHandle | None = None
        self._await_head(after=None)

    def data_received(self, data: bytes) -> None:
        if not self._lingering_transport.lingering:  # a closing connection's input is discarded
            super().data_received(data)

    def on_response_complete(self) -> None:
        finished = self.cycle
        super().on_response_complete()  # may start a pipelined request's cycle at once
        self._await_head(after=finished)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._lingering_transport.stop_lingering()
        super().connection_lost(exc)

    def _client_sending(self) -> bool:
        """Whether the client may have more of a request on its way: a body not read whole, a
        request h11 refused, or part of a head."""
        state = self.conn.their_state
        return state in (h11.SEND_BODY, h11.ERROR) or (state is h11.IDLE and bool(self.conn.trailing_data[0]))

    def _await_head(self, after: object) -> None:
        """Close the connection unless a request head newer than the cycle `after` arrives in time
        (a head starts a new cycle; one in progress, however long, is never cut)."""
        if self._head_timer is not None:
            self._head_timer.cancel()

        def check() -> None:
            if self.cycle is after and not self.transport.is_closing():
                self.transport.close()

        self._head_timer = self.loop.call_later(self.head_timeout, check)


def h11_protocol(head_timeout: float) -> type[H11Protocol]:
    """The protocol class for uvicorn.Config(http=...), with this head timeout."""
    return type("HeadTimeoutH11Protocol", (HeadTimeoutH11Protocol,), {"head_timeout": head_timeout})
