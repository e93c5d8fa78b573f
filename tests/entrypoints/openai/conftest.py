"""Fixtures of the OpenAI server tests: one tiny-Llama `minivllm serve` subprocess shared by the
whole session (several served names, float32, seed 0), and an `openai.OpenAI` client for it."""

from __future__ import annotations

from pathlib import Path

import pytest
from server_utils import (
    MODEL_ALIAS,
    MODEL_NAME,
    TINY_SERVER_ARGS,
    RemoteServer,
)


@pytest.fixture(scope="session")
def tiny_llama_dir(make_tiny_model) -> Path:
    return make_tiny_model("llama")


@pytest.fixture(scope="session")
def server(tiny_llama_dir) -> RemoteServer:
    with RemoteServer(
        tiny_llama_dir, [*TINY_SERVER_ARGS, "--served-model-name", MODEL_NAME, MODEL_ALIAS]
    ) as remote:
        yield remote


@pytest.fixture(scope="session")
def client(server):
    with server.client() as c:
        yield c
