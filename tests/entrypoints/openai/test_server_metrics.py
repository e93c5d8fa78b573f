"""GET /metrics (Prometheus text) moves by exactly what a request did, and a client that goes
away (dropped stream, timed-out request) has its request aborted: the engine stops generating
for it and frees its KV cache, which /metrics shows by returning to zero."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_utils import (
    DRAIN_TIMEOUT_S,
    KV_USAGE,
    MODEL_NAME,
    RUNNING,
    TINY_SERVER_ARGS,
    WAITING,
    RemoteServer,
    wait_until_idle,
)

PROMPT_TOKENS = "vllm:prompt_tokens_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
TTFT = "vllm:time_to_first_token_seconds"
TPOT = "vllm:time_per_output_token_seconds"
E2E = "vllm:e2e_request_latency_seconds"
HISTOGRAMS = (TTFT, TPOT, E2E)
LONG = 900  # tokens (+ the prompt <= max_model_len): seconds of generation on a CPU


def success(reason: str) -> str:
    return f'vllm:request_success_total{{finished_reason="{reason}"}}'


def delta(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after[key] - before.get(key, 0.0)


def test_metrics_parse_with_prometheus_client(server):
    response = server.get("metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    expected = {
        RUNNING: "gauge", WAITING: "gauge", KV_USAGE: "gauge", "vllm:gpu_prefix_cache_hit_rate": "gauge",
        "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
        "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
        "vllm:request_success": "counter", TTFT: "histogram", TPOT: "histogram", E2E: "histogram",
    }
    for name, kind in expected.items():
        assert name in families, sorted(families)
        assert families[name].type == kind, (name, families[name].type)
        assert families[name].samples, name
    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples}
    assert {"stop", "length"} <= reasons
    # Every sample is labelled with the served model name, as vLLM does.
    for family in families.values():
        for sample in family.samples:
            assert sample.labels.get("model_name") == MODEL_NAME, sample


def _check_histogram(metrics: dict[str, float], name: str) -> None:
    buckets = sorted(
        ((float(key.split('le="')[1].rstrip('"}')), value) for key, value in metrics.items()
         if key.startswith(f"{name}_bucket{{")),
    )
    assert buckets and buckets[-1][0] == float("inf")
    counts = [v for _, v in buckets]
    assert counts == sorted(counts), f"{name} buckets are not cumulative: {buckets}"
    assert buckets[-1][1] == metrics[f"{name}_count"]
    assert metrics[f"{name}_sum"] >= 0.0


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_metrics_count_one_known_request(server, client, endpoint):
    max_tokens = 9
    messages = [{"role": "user", "content": f"Count the tokens of this {endpoint} request."}]
    prompt = f"Count the tokens of this {endpoint} prompt, please"
    prompt_len = server.count_tokens(messages=messages) if endpoint == "chat" else server.count_tokens(prompt)
    before = server.metrics()
    if endpoint == "chat":
        response = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=max_tokens,
                                                  extra_body={"ignore_eos": True})
    else:
        response = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens,
                                             extra_body={"ignore_eos": True})
    assert response.usage.prompt_tokens == prompt_len
    assert response.usage.completion_tokens == max_tokens
    after = server.metrics()
    assert delta(before, after, PROMPT_TOKENS) == prompt_len
    assert delta(before, after, GENERATION_TOKENS) == max_tokens
    assert delta(before, after, success("length")) == 1
    assert delta(before, after, success("stop")) == 0
    for name in HISTOGRAMS:  # TPOT too: more than one output token
        assert delta(before, after, f"{name}_count") == 1, name
        assert delta(before, after, f"{name}_sum") > 0.0, name
        _check_histogram(after, name)
    assert after[RUNNING] == 0 and after[WAITING] == 0
    assert after[KV_USAGE] == 0.0


def test_metrics_count_streamed_and_stopped_requests(server, client):
    prompt = "A streamed request that is counted like any other"
    prompt_len = server.count_tokens(prompt)
    before = server.metrics()
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert chunks
    after = server.metrics()
    assert delta(before, after, PROMPT_TOKENS) == prompt_len
    assert delta(before, after, GENERATION_TOKENS) == 6
    assert delta(before, after, success("length")) == 1
    assert delta(before, after, f"{TTFT}_count") == 1

    # A request that ends on a stop token is counted under finished_reason="stop".
    stop_id = server.post("tokenize", {"prompt": "Hello"}).json()["tokens"][0]
    before = server.metrics()
    completion = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=30, temperature=0,
        logit_bias={str(stop_id): 100}, extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]},
    )
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage.completion_tokens == 1
    after = server.metrics()
    assert delta(before, after, success("stop")) == 1
    assert delta(before, after, success("length")) == 0
    assert delta(before, after, GENERATION_TOKENS) == 1
    assert delta(before, after, f"{E2E}_count") == 1


def test_prefix_cache_metrics(server, client):
    # A prompt nobody sent before (time-stamped), longer than a few 16-token blocks.
    prompt = f"{time.time_ns()} " + " ".join(f"word{i}" for i in range(40))
    prompt_len = server.count_tokens(prompt)
    assert prompt_len > 48
    first = server.metrics()
    client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2)
    second = server.metrics()
    assert delta(first, second, "vllm:prefix_cache_queries_total") == prompt_len
    client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2)
    third = server.metrics()
    assert delta(second, third, "vllm:prefix_cache_queries_total") == prompt_len
    hits = delta(second, third, "vllm:prefix_cache_hits_total")
    # Every full block of the prompt but the one holding its last token is reused.
    assert hits == (prompt_len - 1) // 16 * 16
    assert third["vllm:gpu_prefix_cache_hit_rate"] == pytest.approx(
        third["vllm:prefix_cache_hits_total"] / third["vllm:prefix_cache_queries_total"])


# ---- client disconnects -----------------------------------------------------------------------


def _assert_aborted(server: RemoteServer, before: dict[str, float]) -> None:
    """The request was cut short: its generation stopped early and the engine is idle again."""
    idle, metrics = wait_until_idle(server)
    generated = delta(before, metrics, GENERATION_TOKENS)
    assert generated < LONG, f"the request ran to completion ({generated} tokens): not aborted"
    assert delta(before, metrics, success("length")) == 0
    # No more tokens are generated for it.
    time.sleep(0.5)
    assert server.metrics()[GENERATION_TOKENS] == metrics[GENERATION_TOKENS]
    assert idle, (
        f"/metrics still shows {metrics[RUNNING]:g} running, {metrics[WAITING]:g} waiting requests and "
        f"KV cache usage {metrics[KV_USAGE]} {DRAIN_TIMEOUT_S:g} s after the client went away"
    )


def _assert_still_serving(server: RemoteServer) -> None:
    response = server.post("v1/completions", {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 3,
                                              "ignore_eos": True})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("route", ["v1/completions", "v1/chat/completions"])
def test_dropped_stream_is_aborted(server, route):
    body = {"model": MODEL_NAME, "max_tokens": LONG, "ignore_eos": True, "stream": True}
    if route == "v1/completions":
        body["prompt"] = "Tell me a very long story"
    else:
        body["messages"] = [{"role": "user", "content": "Tell me a very long story"}]
    before = server.metrics()
    events = 0
    with httpx.Client(timeout=60.0) as http, http.stream("POST", server.url_for(route), json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events += 1
                if events >= 4:
                    break  # leaving both `with` blocks closes the connection mid-stream
    assert events == 4
    _assert_aborted(server, before)
    _assert_still_serving(server)


def test_timed_out_request_is_aborted(server):
    body = {"model": MODEL_NAME, "prompt": "Tell me a very long story", "max_tokens": LONG,
            "ignore_eos": True}
    before = server.metrics()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url_for("v1/completions"), json=body, timeout=httpx.Timeout(30.0, read=0.5))
    _assert_aborted(server, before)
    _assert_still_serving(server)


@pytest.fixture(scope="module")
def scratch_server(tiny_llama_dir):
    """A server of its own, for a test that may leave it busy for minutes if it fails."""
    with RemoteServer(tiny_llama_dir, [*TINY_SERVER_ARGS, "--served-model-name", MODEL_NAME]) as remote:
        yield remote


def test_disconnect_while_adding_many_samples_aborts_them_all(scratch_server):
    """A client that times out while the server is still adding its 400 prompts x n=128 samples
    (the most n allowed) to the engine (seconds of work): the samples added so far must be aborted
    too, not left generating for nobody."""
    server = scratch_server
    _assert_still_serving(server)  # warm: the big request's time goes into adding its samples
    body = {"model": MODEL_NAME, "prompt": ["Hi"] * 400, "n": 128, "max_tokens": 200, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url_for("v1/completions"), json=body, timeout=httpx.Timeout(30.0, read=0.3))
    # Small requests in between make the engine report fresh stats (whether or not an abort
    # that empties the engine publishes them).
    idle, metrics = wait_until_idle(server, refresh=True)
    assert idle, (
        f"{metrics[RUNNING]:g} running and {metrics[WAITING]:g} waiting requests "
        f"{DRAIN_TIMEOUT_S:g} s after the only client that asked for them went away"
    )
