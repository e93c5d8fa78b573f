"""Faults under load: clients that go away at random points (every block comes back), and an
engine core killed while streams run (each stream ends with an error event within 5 s, /health
turns 503, and the server exits with status 1 so that a supervisor restarts it)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import threading
import time

import httpx
from server_utils import (
    MODEL_NAME,
    RUNNING,
    TINY_SERVER_ARGS,
    RemoteServer,
    engine_core_pids,
    wait_for,
    wait_until_idle,
)

LONG = 900  # tokens: seconds of generation, so every request is still running when it is cut


async def _leave_at_random(client: httpx.AsyncClient, url: str, rng: random.Random, i: int) -> str:
    """One request, abandoned at a random point: before any response, after a few events of its
    stream, or as a non-streamed request that times out. Returns how it left."""
    body = {"model": MODEL_NAME, "prompt": f"Story number {i}:", "max_tokens": LONG, "ignore_eos": True}
    how = rng.choice(["before-response", "mid-stream", "timeout"])
    if how == "timeout":
        try:
            await client.post(url, json=body, timeout=httpx.Timeout(30.0, read=rng.uniform(0.05, 1.0)))
        except httpx.ReadTimeout:
            return how
        raise AssertionError("a 900-token request answered within a second")
    if how == "before-response":
        task = asyncio.create_task(client.post(url, json={**body, "stream": True}))
        await asyncio.sleep(rng.uniform(0.0, 0.3))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return how
    events = rng.randint(1, 10)
    async with client.stream("POST", url, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events -= 1
                if events == 0:
                    break  # leaving the block closes the connection mid-stream
    return how


def test_a_hundred_clients_leaving_at_random_points_give_every_block_back(server):
    async def main() -> list[str]:
        rng = random.Random(0)
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=60.0, limits=limits) as client:
            return await asyncio.gather(*(_leave_at_random(client, server.url_for("v1/completions"), rng, i)
                                          for i in range(100)))

    ways = asyncio.run(main())
    assert {"before-response", "mid-stream", "timeout"} <= set(ways)
    idle, metrics = wait_until_idle(server, refresh=True)
    assert idle, f"after 100 clients left: {metrics}"
    response = server.post("v1/completions", {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 3, "ignore_eos": True})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3


def test_engine_killed_under_load_fails_every_stream_then_the_server_exits_1(tiny_llama_dir):
    server = RemoteServer(tiny_llama_dir, [*TINY_SERVER_ARGS, "--served-model-name", MODEL_NAME])
    try:
        [engine] = engine_core_pids(server.proc.pid)
        endings: dict[int, tuple[float, list[str]]] = {}

        def stream(i: int) -> None:
            body = {"model": MODEL_NAME, "prompt": f"Tale {i}", "max_tokens": LONG, "ignore_eos": True, "stream": True}
            with httpx.Client(timeout=60.0) as http, http.stream("POST", server.url_for("v1/completions"),
                                                                 json=body) as response:
                events = [line for line in response.iter_lines() if line.startswith("data: ")]
            endings[i] = (time.monotonic(), events[-2:])

        threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(4)]
        for thread in threads:
            thread.start()
        assert wait_for(lambda: server.metrics()[RUNNING] == 4, 20.0), server.metrics()
        health: list[int] = []
        os.kill(engine, signal.SIGKILL)
        killed = time.monotonic()
        while server.proc.poll() is None and time.monotonic() - killed < 10:
            try:
                health.append(httpx.get(server.url_for("health"), timeout=1.0).status_code)
            except httpx.TransportError:
                pass  # the server has closed its port: it is exiting
            time.sleep(0.05)
        for thread in threads:
            thread.join(timeout=10)
        assert len(endings) == 4
        print(f"streams ended {max(ended for ended, _ in endings.values()) - killed:.2f} s after the SIGKILL")
        for ended, (error, done) in endings.values():
            assert ended - killed < 5
            assert done == "data: [DONE]"
            assert json.loads(error.removeprefix("data: "))["error"]["code"] == 503
        assert 503 in health and 200 not in health[health.index(503):]
        assert server.proc.wait(timeout=15) == 1, server.output()[-3000:]
    finally:
        server.stop()
        server.log_path.unlink(missing_ok=True)
