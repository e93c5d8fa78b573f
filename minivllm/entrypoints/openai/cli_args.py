"""The `minivllm serve` command line: server options plus every engine option (AsyncEngineArgs).

Kept apart from api_server.py so that building the `minivllm` parser does not import the server
(FastAPI, uvicorn, pydantic: ~0.6 s) for the other commands.
"""

from __future__ import annotations

import argparse

from minivllm.engine.arg_utils import AsyncEngineArgs


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, help="The model (HF directory or .gguf file).")
    parser.add_argument("--host", default=None, help="Host to bind (default: all interfaces).")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="Model name(s) the API answers to (default: the model argument).")
    parser.add_argument("--api-key", default=None, help="Require `Authorization: Bearer KEY` on /v1 routes.")
    parser.add_argument("--uvicorn-log-level", default="info")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="On SIGTERM, seconds to let in-flight requests finish before exiting.")
    AsyncEngineArgs.add_cli_args(parser)
