"""One logging setup for the whole package: `init_logger(__name__)` in every module."""

from __future__ import annotations

import logging
import sys

from minivllm import envs

_ROOT = "minivllm"
_configured = False


def _configure_root() -> None:
    global _configured
    root = logging.getLogger(_ROOT)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s", "%m-%d %H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(envs.logging_level())
    root.propagate = False
    _configured = True


def init_logger(name: str) -> logging.Logger:
    if not _configured:
        _configure_root()
    return logging.getLogger(name)
