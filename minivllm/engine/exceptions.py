"""Errors the front end raises to its callers about the engine itself."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine core is gone (crashed, killed, or shut down): no request can complete."""

    def __init__(self, message: str = "The engine core died; restart the engine to continue.") -> None:
        super().__init__(message)
