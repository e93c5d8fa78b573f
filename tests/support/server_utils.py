"""Helpers for the OpenAI server tests: run `minivllm serve` as a real subprocess, scrape and parse
its Prometheus /metrics, check OpenAI-style error bodies, find the engine-core child process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

HOST = "127.0.0.1"
STARTUP_TIMEOUT_S = 120.0

# The session's shared tiny-Llama server (conftest.py `server`).
MODEL_NAME = "tiny-llama"
MODEL_ALIAS = "tiny-llama-alias"
MAX_MODEL_LEN = 1024
TINY_SERVER_ARGS = ["--dtype", "float32", "--seed", "0", "--max-model-len", str(MAX_MODEL_LEN)]


def free_port() -> int:
    """A loopback port nobody is listening on (bind to port 0 and let the kernel choose)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class RemoteServer:
    """`python -m minivllm.entrypoints.cli serve MODEL --port P ARGS...` on a free loopback port.

    Started on construction; ready once GET /health answers 200. The server's stdout and stderr
    go to a temporary log file, shown when the server fails to start or dies. It leads its own
    process group, so that `kill` and `stop` also reach its engine-core child.
    """

    def __init__(
        self,
        model: str | Path,
        args: Sequence[str] = (),
        *,
        api_key: str | None = None,
        startup_timeout: float = STARTUP_TIMEOUT_S,
        wait: bool = True,
    ) -> None:
        self.model = str(model)
        self.api_key = api_key
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        cmd = [sys.executable, "-m", "minivllm.entrypoints.cli", "serve", self.model,
               "--host", HOST, "--port", str(self.port), *args]
        if api_key is not None:
            cmd += ["--api-key", api_key]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        self._log = tempfile.NamedTemporaryFile(prefix="minivllm-serve-", suffix=".log", delete=False)
        self.log_path = Path(self._log.name)
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.startup_timeout = startup_timeout
        if wait:
            try:
                self.wait_ready()
            except BaseException:
                self.stop()
                raise

    # ---- lifecycle --------------------------------------------------------------------------

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(
                    f"minivllm serve exited with code {self.proc.returncode} during start-up:\n"
                    f"{self.output()[-8000:]}", pytrace=False,
                )
            try:
                if httpx.get(self.url_for("health"), timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        pytest.fail(f"minivllm serve not ready after {self.startup_timeout:.0f} s:\n"
                    f"{self.output()[-8000:]}", pytrace=False)

    def stop(self, timeout: float = 40.0) -> int | None:
        """SIGTERM, then SIGKILL if it has not exited after `timeout` seconds; whatever is left
        of its process group (an engine core that outlived it) is killed too."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL to the server and its engine core at once, as a crash or the OOM killer would."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)

    def __enter__(self) -> RemoteServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        if exc[0] is None:
            self.log_path.unlink(missing_ok=True)

    # ---- clients ----------------------------------------------------------------------------

    def url_for(self, *parts: str) -> str:
        return "/".join([self.url, *parts])

    def client(self, **kwargs: Any) -> openai.OpenAI:
        kwargs.setdefault("api_key", self.api_key or "EMPTY")
        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", 120.0)
        return openai.OpenAI(base_url=self.url_for("v1"), **kwargs)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def post(self, route: str, json: Any = None, **kwargs: Any) -> httpx.Response:
        kwargs.setdefault("timeout", 120.0)
        headers = {**self.headers(), **kwargs.pop("headers", {})}
        return httpx.post(self.url_for(route), json=json, headers=headers, **kwargs)

    def get(self, route: str, **kwargs: Any) -> httpx.Response:
        kwargs.setdefault("timeout", 30.0)
        headers = {**self.headers(), **kwargs.pop("headers", {})}
        return httpx.get(self.url_for(route), headers=headers, **kwargs)

    def metrics(self) -> dict[str, float]:
        response = self.get("metrics")
        assert response.status_code == 200, response.text
        return parse_metrics(response.text)

    def metric(self, name: str) -> float:
        """One metric of /metrics, summed over its label sets."""
        return sum(v for k, v in self.metrics().items() if k == name or k.startswith(name + "{"))

    def count_tokens(self, prompt: str | None = None, messages: list[dict[str, Any]] | None = None) -> int:
        body = {"prompt": prompt} if messages is None else {"messages": messages}
        response = self.post("tokenize", body)
        assert response.status_code == 200, response.text
        return response.json()["count"]


# ---- metrics --------------------------------------------------------------------------------


def parse_metrics(text: str) -> dict[str, float]:
    """Every sample of a Prometheus text exposition, keyed `name{label="v",...}` (labels sorted,
    `model_name` left out), e.g. `vllm:request_success_total{finished_reason="length"}`."""
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k != "model_name"}
            key = sample.name
            if labels:
                key += "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
            samples[key] = sample.value
    return samples


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
DRAIN_TIMEOUT_S = 20.0


def wait_until_idle(server: RemoteServer, refresh: bool = False,
                    timeout: float = DRAIN_TIMEOUT_S) -> tuple[bool, dict[str, float]]:
    """Poll /metrics until no request runs or waits and no KV block is held (cached-free ones
    count as free). With `refresh`, a one-token request goes first each time, so the engine
    reports fresh scheduler stats (an abort that empties the engine may publish none)."""
    metrics: dict[str, float] = {}

    def check() -> bool:
        refreshed = True
        if refresh:
            try:
                server.post("v1/completions", {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 1}, timeout=5.0)
            except httpx.TimeoutException:
                refreshed = False
        metrics.update(server.metrics())
        if not refreshed:
            return False
        return metrics[RUNNING] == 0 and metrics[WAITING] == 0 and metrics[KV_USAGE] == 0.0

    return wait_for(check, timeout, interval=0.2), metrics


# ---- errors ---------------------------------------------------------------------------------


def assert_openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    """The response has `status` and an OpenAI error body with all four keys; returns `error`."""
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] in (status, str(status)), error
    return error


# ---- in process: the app over a fake engine ------------------------------------------------


class FakeTokenizer:
    eos_token_id = 2

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 100 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, conversation: list[dict[str, Any]], chat_template: str | None = None,
                            tokenize: bool = True, **kwargs: Any) -> str:
        return "".join(m["content"] for m in conversation)


def fake_engine() -> SimpleNamespace:
    """What build_app asks of AsyncLLM before any request reaches the engine."""
    model_config = SimpleNamespace(model="fake", max_model_len=64, hf_config=SimpleNamespace(vocab_size=100))
    return SimpleNamespace(vllm_config=SimpleNamespace(model_config=model_config),
                           get_tokenizer=FakeTokenizer, check_health=lambda: None, shutdown=lambda: None)


# ---- processes ------------------------------------------------------------------------------


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces and parentheses, so split after the last ')'
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid:
            children.append(int(entry.name))
    return children


def cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def is_alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped counts as gone)."""
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def engine_core_pids(server_pid: int) -> list[int]:
    return [p for p in child_pids(server_pid) if "minivllm.engine.launch" in cmdline(p)]
