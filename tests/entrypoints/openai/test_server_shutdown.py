"""Graceful shutdown: on SIGTERM the server refuses new requests (503, /health too) and lets the
requests in flight finish (streamed and not), then exits with code 0 within its shutdown timeout,
taking its engine-core process with it."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
from server_utils import (
    MODEL_NAME,
    TINY_SERVER_ARGS,
    RemoteServer,
    engine_core_pids,
    is_alive,
    wait_for,
)

SHUTDOWN_TIMEOUT_S = 60
MAX_TOKENS = 1000  # ~4 s on an idle CPU: both run long enough to be seen together; well under the timeout


def test_sigterm_finishes_in_flight_requests_then_exits(tiny_llama_dir):
    server = RemoteServer(tiny_llama_dir, [*TINY_SERVER_ARGS, "--served-model-name", MODEL_NAME,
                                           "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)])
    try:
        engines = engine_core_pids(server.proc.pid)
        assert len(engines) == 1, f"expected one engine-core child, found {engines}"
        assert is_alive(engines[0])

        body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": MAX_TOKENS,
                "ignore_eos": True}
        results: dict[str, object] = {}

        def non_streamed() -> None:
            try:
                results["response"] = httpx.post(server.url_for("v1/completions"), json=body, timeout=120.0)
            except Exception as e:  # reported by the assertions below
                results["error"] = e

        with httpx.Client(timeout=120.0) as http, http.stream(
            "POST", server.url_for("v1/completions"),
            json={**body, "stream": True, "stream_options": {"include_usage": True}},
        ) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            thread = threading.Thread(target=non_streamed, daemon=True)
            thread.start()
            # Both requests are in the engine before the signal.
            assert wait_for(lambda: server.metrics()["vllm:num_requests_running"] == 2, 10.0), \
                server.metrics()
            server.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            # Draining: new requests (and health checks) are refused while these two run on.
            refused = httpx.post(server.url_for("v1/completions"), json={**body, "max_tokens": 1}, timeout=10.0)
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["message"] == "The server is shutting down."
            assert httpx.get(server.url_for("health"), timeout=10.0).status_code == 503
            try:
                events = [first] + [line for line in lines if line.startswith("data: ")]
            except httpx.HTTPError as e:
                raise AssertionError(f"the stream broke after SIGTERM: {e!r}\n{server.output()[-4000:]}") from e

        # The streamed request ran to its end: every token, the usage chunk, [DONE].
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
        assert chunks[-1]["choices"] == []
        assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"

        # So did the non-streamed one.
        thread.join(timeout=60)
        assert "error" not in results, results
        response = results["response"]
        assert isinstance(response, httpx.Response)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == MAX_TOKENS
        assert response.json()["choices"][0]["finish_reason"] == "length"

        # Then the server exits cleanly, within the shutdown timeout.
        returncode = server.proc.wait(timeout=SHUTDOWN_TIMEOUT_S + 15)
        elapsed = time.monotonic() - signalled
        assert returncode == 0, server.output()[-4000:]
        assert elapsed < SHUTDOWN_TIMEOUT_S + 10
        # ... and its engine-core process is gone too.
        assert wait_for(lambda: not any(is_alive(p) for p in engines), 10.0), \
            f"engine-core process {engines} outlived the server"
    finally:
        server.stop()
        server.log_path.unlink(missing_ok=True)


def test_sigterm_when_idle_exits_promptly(tiny_llama_dir):
    server = RemoteServer(tiny_llama_dir, [*TINY_SERVER_ARGS, "--served-model-name", MODEL_NAME])
    try:
        engines = engine_core_pids(server.proc.pid)
        assert len(engines) == 1
        assert httpx.post(server.url_for("v1/completions"),
                          json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}).status_code == 200
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=30) == 0, server.output()[-4000:]
        assert time.monotonic() - start < 15
        assert wait_for(lambda: not any(is_alive(p) for p in engines), 10.0)
    finally:
        server.stop()
        server.log_path.unlink(missing_ok=True)
