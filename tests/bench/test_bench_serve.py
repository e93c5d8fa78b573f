"""`minivllm bench serve` against the project's own OpenAI-compatible server, started here on a
free loopback port with a tiny random Llama; and against a server killed in the middle of a run."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from server_utils import RemoteServer

import minivllm.bench.serve as bench_serve
from minivllm.entrypoints.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
METRICS = ("ttft", "tpot", "itl", "e2el")
REPO_ROOT = Path(__file__).resolve().parents[2]
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "512"]


@pytest.fixture(scope="module")
def model(make_tiny_model) -> str:
    return str(make_tiny_model("llama"))


@pytest.fixture(scope="module")
def server(model):
    with RemoteServer(model, SERVER_ARGS) as srv:
        yield srv


def bench(server: RemoteServer, out: Path, *flags: str) -> dict:
    main(["bench", "serve", "--port", str(server.port), "--disable-tqdm", "--output-json", str(out), *flags])
    return json.loads(out.read_text())


def check_stats(result: dict) -> None:
    for name in METRICS:
        for stat in ("mean", "median", "std", "p90", "p99"):
            value = result[f"{stat}_{name}_ms"]
            assert math.isfinite(value) and value >= 0, (stat, name)
        assert result[f"median_{name}_ms"] == result[f"p50_{name}_ms"]
        assert result[f"p50_{name}_ms"] <= result[f"p90_{name}_ms"] <= result[f"p99_{name}_ms"], name
        assert result[f"mean_{name}_ms"] > 0, name


def check_per_request(result: dict, n: int) -> None:
    ttfts, e2els = result["ttfts"], result["e2els"]
    assert len(ttfts) == len(e2els) == len(result["input_lens"]) == len(result["output_lens"]) == n
    for ttft, e2el in zip(ttfts, e2els, strict=True):
        assert 0 < ttft <= e2el


def test_serve_completions_at_fixed_rate(server, model, tmp_path):
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    # No --model: the name (and the tokenizer's path) come from the server's /v1/models.
    result = bench(server, out, "--num-prompts", "20", "--random-input-len", "32", "--random-output-len", "12",
                   "--request-rate", "20", "--goodput", "ttft:10000", "tpot:10000", "--plot", str(png))
    for key in ("completed", "failed", "request_throughput", "output_throughput", "total_token_throughput",
                "max_output_tokens_per_s", "request_goodput", "engine_startup_time", "duration",
                "total_input_tokens", "total_output_tokens", "ttfts", "e2els", "config", "environment"):
        assert key in result, key
    assert result["model"] == model
    assert result["endpoint"] == "/v1/completions"
    assert result["request_rate"] == 20 and result["num_prompts"] == 20
    assert result["completed"] == 20 and result["failed"] == 0, result["errors"]
    assert result["errors"] == []
    assert result["total_output_tokens"] == 20 * 12
    assert result["total_input_tokens"] == 20 * 32
    assert result["input_lens"] == [32] * 20 and result["output_lens"] == [12] * 20
    duration = result["duration"]
    assert result["request_throughput"] == pytest.approx(20 / duration)
    assert result["output_throughput"] == pytest.approx(20 * 12 / duration)
    assert result["total_token_throughput"] == pytest.approx(20 * (32 + 12) / duration)
    # Every request met the generous SLOs.
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    # Peak tokens in a 1 s bucket: at least the average over the buckets the run spans.
    assert 20 * 12 / (math.floor(duration) + 1) <= result["max_output_tokens_per_s"] <= 20 * 12
    check_stats(result)
    check_per_request(result, 20)
    assert result["engine_startup_time"] == pytest.approx(server.metric("minivllm:engine_startup_seconds"))
    assert result["engine_startup_time"] > 0
    assert result["environment"]["cpu"] and result["environment"]["minivllm"]
    data = png.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1000


def test_serve_chat_endpoint_multiturn(server, model, tmp_path):
    prompt_tokens_before = server.metric("vllm:prompt_tokens_total")
    result = bench(server, tmp_path / "chat.json", "--endpoint", "/v1/chat/completions", "--model", model,
                   "--dataset-name", "multiturn", "--num-prompts", "4", "--num-turns", "2",
                   "--random-output-len", "6")
    assert result["endpoint"] == "/v1/chat/completions"
    assert result["completed"] == 4 and result["failed"] == 0, result["errors"]
    assert result["total_output_tokens"] == 4 * 6
    check_stats(result)
    check_per_request(result, 4)
    # The conversations were sent as messages: the server's rendering of them has exactly the
    # dataset's prompt lengths (turn 2 longer than turn 1).
    lens = result["input_lens"]
    assert lens[1] > lens[0] and lens[3] > lens[2]
    assert server.metric("vllm:prompt_tokens_total") - prompt_tokens_before == sum(lens)


def test_serve_chat_endpoint_random(server, tmp_path):
    result = bench(server, tmp_path / "chat.json", "--endpoint", "/v1/chat/completions", "--num-prompts", "5",
                   "--random-input-len", "16", "--random-output-len", "8")
    assert result["completed"] == 5 and result["failed"] == 0, result["errors"]
    assert result["total_output_tokens"] == 5 * 8
    check_per_request(result, 5)


def test_serve_timings_agree_with_the_engine(server, tmp_path):
    """One request at a time on the chat route: the client's TTFT and end-to-end latency are the
    server's own (from its request's arrival in the front end, in /metrics) plus the HTTP and
    chat-template work before that arrival, which is small."""
    def engine_sums() -> tuple[float, float, float]:
        return (server.metric("vllm:time_to_first_token_seconds_sum"),
                server.metric("vllm:e2e_request_latency_seconds_sum"),
                server.metric("vllm:e2e_request_latency_seconds_count"))

    before = engine_sums()
    result = bench(server, tmp_path / "timings.json", "--endpoint", "/v1/chat/completions", "--num-prompts", "6",
                   "--random-input-len", "200", "--random-output-len", "16", "--max-concurrency", "1")
    ttft_sum, e2e_sum, count = (a - b for a, b in zip(engine_sums(), before, strict=True))
    assert result["completed"] == 6 and count == 6
    client_ttft, client_e2el = result["mean_ttft_ms"] / 1000, result["mean_e2el_ms"] / 1000
    assert ttft_sum / 6 <= client_ttft <= ttft_sum / 6 + 0.1
    assert e2e_sum / 6 <= client_e2el <= e2e_sum / 6 + 0.1
    # TPOT from the same chunks: what follows the first token, over the 15 tokens after it.
    assert result["mean_tpot_ms"] == pytest.approx((result["mean_e2el_ms"] - result["mean_ttft_ms"]) / 15)


def test_serve_watching_engine_events(server, tmp_path):
    """--watch-engine-events reads the event stream through the run: at least one message per
    engine step the run took (and the first, a snapshot)."""
    steps_before = server.metric("minivllm:engine_step_seconds_count")
    result = bench(server, tmp_path / "watch.json", "--num-prompts", "4", "--random-input-len", "16",
                   "--random-output-len", "6", "--watch-engine-events")
    steps = server.metric("minivllm:engine_step_seconds_count") - steps_before
    assert result["completed"] == 4 and steps > 0
    assert result["engine_event_messages"] >= steps and result["engine_event_bytes"] > 0


def test_serve_max_concurrency(server, tmp_path, monkeypatch):
    in_flight, peak = 0, 0
    real_send = bench_serve.send_request

    async def counting_send(*args, **kwargs):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            return await real_send(*args, **kwargs)
        finally:
            in_flight -= 1

    monkeypatch.setattr(bench_serve, "send_request", counting_send)
    result = bench(server, tmp_path / "conc.json", "--num-prompts", "8", "--random-input-len", "16",
                   "--random-output-len", "8", "--max-concurrency", "2")
    assert result["max_concurrency"] == 2
    assert result["completed"] == 8 and result["failed"] == 0, result["errors"]
    assert result["total_output_tokens"] == 8 * 8
    assert peak == 2  # never more than 2 at once, and (infinite rate) 2 reached
    check_per_request(result, 8)


def test_serve_burst_of_long_prompts_and_the_engine_steps(server, tmp_path, monkeypatch):
    """--burst-*: long prompts sent together after a delay, while the dataset's requests decode;
    the report counts the engine's steps during the run (the server's /metrics, before/after)."""
    sent: list[tuple[float, int]] = []
    real_send = bench_serve.send_request

    async def recording_send(session, url, endpoint, model, sample, *args, **kwargs):
        sent.append((time.perf_counter(), sample.prompt_len))
        return await real_send(session, url, endpoint, model, sample, *args, **kwargs)

    monkeypatch.setattr(bench_serve, "send_request", recording_send)
    steps_before = server.metric("minivllm:engine_step_seconds_count")
    over_before = server.metric("minivllm:steps_over_budget_total")
    result = bench(server, tmp_path / "burst.json", "--num-prompts", "3", "--random-input-len", "16",
                   "--random-output-len", "40", "--burst-num-prompts", "4", "--burst-input-len", "200",
                   "--burst-output-len", "4", "--burst-delay", "0.3")
    steps = server.metric("minivllm:engine_step_seconds_count") - steps_before
    over = server.metric("minivllm:steps_over_budget_total") - over_before
    assert result["completed"] == 7 and result["failed"] == 0, result["errors"]
    assert result["num_prompts"] == 7 and result["burst_num_prompts"] == 4
    assert result["input_lens"] == [16] * 3 + [200] * 4 and result["output_lens"] == [40] * 3 + [4] * 4
    first, burst = sent[0][0], [t for t, n in sent if n == 200]
    assert len(burst) == 4 and all(t - first >= 0.3 for t in burst) and max(burst) - min(burst) < 0.1
    # The streams decode 40 tokens: at least 39 steps after their prefill.
    assert result["engine_steps"] == steps >= 40
    assert result["steps_over_budget"] == over  # the server's default budget: 250 ms on CPU
    assert 0 < result["engine_busy_s"] <= result["duration"]
    assert result["engine_step_p50_ms_at_most"] <= result["engine_step_p99_ms_at_most"]
    assert 0 <= result["step_cost_within_10pct"] <= result["step_cost_within_25pct"] <= 1
    assert result["step_cost_error_mean"] >= 0


def test_serve_structured_output_against_free_requests(server, tmp_path):
    """--structured-output choice on every other request: those replies are one of the choices
    (checked here, not by the bench), the others run free to their length, and the report
    gives both groups' TPOT. Sampled with top-p and top-k: the server takes the bench's fields."""
    result = bench(server, tmp_path / "so.json", "--endpoint", "/v1/chat/completions", "--num-prompts", "6",
                   "--random-input-len", "16", "--random-output-len", "12", "--structured-output", "choice",
                   "--structured-output-ratio", "0.5", "--temperature", "1.0", "--top-p", "0.9", "--top-k", "20")
    assert result["completed"] == 6 and result["constrained_requests"] == result["free_requests"] == 3
    assert result["constrained_valid"] == 3
    assert result["output_lens"][0::2] == [12] * 3  # the free ones (requests 1, 3, 5 are constrained)
    assert all(n < 12 for n in result["output_lens"][1::2])  # a choice is a few tokens, then stop
    assert result["constrained_tpot_ms"]["median"] > 0 and result["free_tpot_ms"]["median"] > 0
    requests = [bench_serve.SampleRequest([1], 1) for _ in range(4)]
    assert bench_serve.constrain(requests, "regex", 0.25, FakeTokenizer()) == [False, False, False, True]
    assert all(r.prompt == requests[0].prompt and r.prompt_token_ids == [len(r.prompt)] for r in requests)
    assert [r.structured_outputs is not None for r in requests] == [False, False, False, True]


class FakeTokenizer:
    def encode(self, text: str) -> list[int]:
        return [len(text)]


def test_engine_step_report_by_hand():
    """Bucket deltas between two scrapes: 10 steps in the run, 6 within 50 ms, 9 within 250 ms."""
    step, error = "minivllm:engine_step_seconds", "minivllm:step_cost_relative_error"
    before = {(f"{step}_count", ""): 5.0, (f"{step}_bucket", "0.05"): 5.0, (f"{step}_bucket", "0.25"): 5.0,
              (f"{step}_bucket", "+Inf"): 5.0, (f"{step}_sum", ""): 0.5, ("minivllm:steps_over_budget_total", ""): 1.0}
    after = {(f"{step}_count", ""): 15.0, (f"{step}_bucket", "0.05"): 11.0, (f"{step}_bucket", "0.25"): 14.0,
             (f"{step}_bucket", "+Inf"): 15.0, (f"{step}_sum", ""): 2.0, ("minivllm:steps_over_budget_total", ""): 2.0,
             (f"{error}_count", ""): 8.0, (f"{error}_sum", ""): 0.8, (f"{error}_bucket", "0.1"): 6.0,
             (f"{error}_bucket", "0.25"): 7.0}
    report = bench_serve.engine_step_report(before, after)
    assert report == {
        "engine_steps": 10, "engine_busy_s": 1.5, "engine_step_p50_ms_at_most": 50.0, "engine_step_p99_ms_at_most": float("inf"),
        "steps_over_budget": 1, "step_cost_error_mean": pytest.approx(0.1),
        "step_cost_within_10pct": 0.75, "step_cost_within_25pct": 0.875,
    }
    assert bench_serve.engine_step_report({}, {}) == {}  # a server without minivllm's metrics


def test_serve_counts_failures_when_server_dies(model, tmp_path):
    """Kill the server mid-run: the client finishes normally and counts what failed."""
    srv = RemoteServer(model, SERVER_ARGS)
    out = tmp_path / "dying.json"
    client_log = tmp_path / "client.log"
    try:
        with open(client_log, "wb") as log:
            client = subprocess.Popen(
                [sys.executable, "-m", "minivllm.entrypoints.cli", "bench", "serve", "--port", str(srv.port),
                 "--num-prompts", "40", "--random-input-len", "32", "--random-output-len", "200",
                 "--request-rate", "5", "--disable-tqdm", "--output-json", str(out)],
                stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, HF_HUB_OFFLINE="1"), cwd=REPO_ROOT,
            )
        # Kill once the run is under way (some tokens generated), well before 40 requests at 5/s are sent.
        deadline = time.monotonic() + 60
        while srv.metric("vllm:generation_tokens_total") < 20:
            assert client.poll() is None, client_log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the benchmark never got going"
            time.sleep(0.1)
        srv.kill()
        try:
            rc = client.wait(timeout=60)
        except subprocess.TimeoutExpired:
            client.kill()
            client.wait()
            pytest.fail(f"bench serve hung after the server died:\n{client_log.read_text()[-3000:]}")
    finally:
        srv.stop()
    printed = client_log.read_text()
    assert rc == 0, printed[-3000:]
    assert "Traceback" not in printed
    assert "Failed requests" in printed
    assert "Errors of the first" in printed
    result = json.loads(out.read_text())
    assert result["failed"] > 0
    assert result["completed"] + result["failed"] == 40
    assert len(result["errors"]) == min(result["failed"], 20)
    assert all(result["errors"])
    assert f"x {result['errors'][0]}" in printed
    # Completed requests are whole: 200 tokens each.
    assert result["total_output_tokens"] == 200 * result["completed"]

