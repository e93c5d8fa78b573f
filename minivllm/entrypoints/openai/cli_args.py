"""The `minivllm serve` command line: server options plus every engine option (AsyncEngineArgs).

Kept apart from api_server.py so that building the `minivllm` parser does not import the server
(FastAPI, uvicorn, pydantic: ~0.6 s) for the other commands.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

from minivllm.engine.arg_utils import AsyncEngineArgs

# Room for a prompt of a few million characters, or of a million token ids, as JSON.
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024
# A client slower than this to send a request's head, or then its body, holds a connection for
# nothing (nginx's client_header_timeout and client_body_timeout).
DEFAULT_REQUEST_READ_TIMEOUT = 60.0


@dataclasses.dataclass(frozen=True)
class FrontendArgs:
    """The options of the HTTP front end (vLLM's name), as `build_app` takes them."""

    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    request_read_timeout: float = DEFAULT_REQUEST_READ_TIMEOUT
    trust_request_chat_template: bool = False

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> FrontendArgs:
        return cls(
            api_key=args.api_key,
            allowed_origins=tuple(args.allowed_origins or ()),
            max_request_body_bytes=args.max_request_body_bytes,
            request_read_timeout=args.request_read_timeout,
            trust_request_chat_template=args.trust_request_chat_template,
        )


def _positive(kind: Callable[[str], float]) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    return parse


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, help="The model (HF directory or .gguf file).")
    parser.add_argument("--host", default=None, help="Host to bind (default: all interfaces).")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="Model name(s) the API answers to (default: the model argument).")
    parser.add_argument("--api-key", default=None,
                        help="Require `Authorization: Bearer KEY` on every route but /health.")
    parser.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                        help="Origins (e.g. https://app.example.com, or *) whose browser pages may call the "
                             "API (CORS). Default: none; no CORS header is sent.")
    parser.add_argument("--max-request-body-bytes", type=_positive(int), default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                        help="Larger request bodies are refused with 413, unread "
                             f"(default: {DEFAULT_MAX_REQUEST_BODY_BYTES} bytes, 16 MiB).")
    parser.add_argument("--request-read-timeout", type=_positive(float), default=DEFAULT_REQUEST_READ_TIMEOUT,
                        help="Seconds a client has to send a request's head (from connecting, or from the "
                             "previous response), then as many for its body; a slower one loses its connection "
                             f"(after a 408 if its head was in) (default: {DEFAULT_REQUEST_READ_TIMEOUT:g}).")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="Accept a `chat_template` in chat requests (it runs on the server; refused by default).")
    parser.add_argument("--uvicorn-log-level", default="info")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="On SIGTERM, seconds to let in-flight requests finish before exiting.")
    AsyncEngineArgs.add_cli_args(parser)
