"""`minivllm bench throughput` and `minivllm bench latency` end to end on a tiny random Llama (the
real SmolLM2 tokenizer), plus the workload builders they share (random, ShareGPT, multi-turn)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import minivllm
from minivllm.bench.datasets import build_dataset
from minivllm.engine.tracing import load_trace, summarize
from minivllm.entrypoints.cli import main, make_parser

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert len(data) > 1000  # a real figure, not just a header


def assert_environment(result: dict) -> None:
    env = result["environment"]
    for key in ("minivllm", "python", "torch", "platform", "cpu", "num_cpus"):
        assert env.get(key), f"environment.{key} missing: {env}"
    assert env["minivllm"] == minivllm.__version__
    assert env["torch"] == torch.__version__


@pytest.fixture(scope="module")
def model(make_tiny_model) -> str:
    return str(make_tiny_model("llama"))


@pytest.fixture(scope="module")
def tokenizer(model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


THROUGHPUT_KEYS = ("elapsed_time", "num_requests", "total_num_tokens", "requests_per_second",
                   "tokens_per_second", "total_output_tokens", "output_tokens_per_second", "startup_time")


def check_figures(r: dict, num_requests: int, num_output: int) -> None:
    for key in THROUGHPUT_KEYS:
        assert key in r, key
    assert r["num_requests"] == num_requests
    assert r["total_output_tokens"] == num_output
    assert r["elapsed_time"] > 0 and r["startup_time"] > 0
    assert r["requests_per_second"] == pytest.approx(num_requests / r["elapsed_time"])
    assert r["tokens_per_second"] == pytest.approx(r["total_num_tokens"] / r["elapsed_time"])
    assert r["output_tokens_per_second"] == pytest.approx(num_output / r["elapsed_time"])


# ---- bench throughput ------------------------------------------------------------------------


def test_throughput_random_with_hf_compare(model, tmp_path, capsys):
    out, png = tmp_path / "throughput.json", tmp_path / "throughput.png"
    main(["bench", "throughput", "--model", model, "--dtype", "float32", "--num-prompts", "6",
          "--min-input-len", "10", "--max-input-len", "40", "--output-len", "7", "--hf-compare",
          "--output-json", str(out), "--plot", str(png)])
    printed = capsys.readouterr().out
    assert "minivllm / transformers output throughput" in printed
    result = json.loads(out.read_text())
    # The top level is minivllm's run, with vLLM's keys.
    check_figures(result, 6, 6 * 7)
    prompt_tokens = result["total_num_tokens"] - 6 * 7
    assert 6 * 10 <= prompt_tokens <= 6 * 40
    assert result["mean_ttft_ms"] > 0
    assert result["num_cached_prompt_tokens"] == 0  # random prompts share nothing
    assert set(result["results"]) == {"minivllm", "transformers"}
    # ignore_eos: every request produces exactly its 7 tokens, in both engines; same prompts.
    for name in ("minivllm", "transformers"):
        r = result["results"][name]
        check_figures(r, 6, 6 * 7)
        assert r["total_num_tokens"] - 6 * 7 == prompt_tokens
    assert result["config"]["num_prompts"] == 6 and result["config"]["output_len"] == 7
    assert result["config"]["model"] == model
    assert_environment(result)
    assert_png(png)


def write_sharegpt(path: Path) -> tuple[list[tuple[str, str]], int]:
    """A ShareGPT-format file: 4 usable conversations and 5 that vLLM's filter drops."""
    good = [
        ("Tell me a short story about a river and a bridge.", "Once upon a time a river met a bridge and they talked."),
        ("What is the capital of France? Answer in one sentence.", "The capital of France is Paris, a large city."),
        ("Explain what a key value cache does in a transformer model.",
         "It stores keys and values of past tokens so that they are not computed again."),
        ("List three colors of the rainbow please.", "Red, orange and yellow are three of the colors."),
    ]
    bad = [
        {"conversations": [{"from": "human", "value": "Hi"},  # prompt under 4 tokens
                           {"from": "gpt", "value": "Hello there, how can I help you today my friend?"}]},
        {"conversations": [{"from": "human", "value": "Please write a long answer about gardens."},
                           {"from": "gpt", "value": "Ok"}]},  # reply under 4 tokens
        {"conversations": [{"from": "human", "value": "A conversation with a single turn only."}]},
        {"id": "no-conversations"},
        {"conversations": [{"from": "human", "value": "word " * 1100},  # prompt over 1024 tokens
                           {"from": "gpt", "value": "That is a lot of words, indeed it is."}]},
    ]
    data = [{"id": f"good-{i}", "conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": r}]}
            for i, (p, r) in enumerate(good)]
    data = [data[0], bad[0], data[1], bad[1], bad[2], data[2], bad[3], bad[4], data[3]]
    path.write_text(json.dumps(data))
    return good, len(bad)


def test_throughput_sharegpt(model, tokenizer, tmp_path):
    dataset, out = tmp_path / "sharegpt.json", tmp_path / "result.json"
    good, _ = write_sharegpt(dataset)
    main(["bench", "throughput", "--model", model, "--dtype", "float32", "--dataset-name", "sharegpt",
          "--dataset-path", str(dataset), "--num-prompts", "20", "--output-json", str(out)])
    result = json.loads(out.read_text())
    # Only the 4 usable conversations; each reply's length is its request's output length.
    num_prompt = sum(len(tokenizer.encode(p)) for p, _ in good)
    num_output = sum(len(tokenizer.encode(r, add_special_tokens=False)) for _, r in good)
    check_figures(result, len(good), num_output)
    assert result["total_num_tokens"] == num_prompt + num_output


def test_sharegpt_dataset_filter_and_cap(model, tokenizer, tmp_path):
    dataset = tmp_path / "sharegpt.json"
    good, _ = write_sharegpt(dataset)
    base = ["bench", "throughput", "--model", model, "--dataset-name", "sharegpt", "--dataset-path", str(dataset)]
    requests = build_dataset(make_parser().parse_args([*base, "--num-prompts", "50"]), tokenizer, len(tokenizer))
    assert sorted(r.prompt for r in requests) == sorted(p for p, _ in good)
    for r in requests:
        reply = dict(good)[r.prompt]
        assert r.prompt_token_ids == tokenizer.encode(r.prompt)
        assert r.expected_output_len == len(tokenizer.encode(reply, add_special_tokens=False))
        assert r.messages == [{"role": "user", "content": r.prompt}]
    capped = build_dataset(make_parser().parse_args([*base, "--num-prompts", "2"]), tokenizer, len(tokenizer))
    assert len(capped) == 2
    # A fixed --output-len replaces every reply's length.
    fixed = build_dataset(make_parser().parse_args([*base, "--output-len", "9"]), tokenizer, len(tokenizer))
    assert {r.expected_output_len for r in fixed} == {9}
    with pytest.raises(SystemExit, match="dataset-path"):
        main(["bench", "throughput", "--model", model, "--dataset-name", "sharegpt"])


def test_multiturn_dataset_turns_share_prefix(model, tokenizer):
    args = make_parser().parse_args(["bench", "throughput", "--model", model, "--dataset-name", "multiturn",
                                     "--num-prompts", "7", "--num-turns", "3", "--output-len", "5"])
    requests = build_dataset(args, tokenizer, len(tokenizer))
    assert len(requests) == 7
    assert {r.expected_output_len for r in requests} == {5}
    # Conversations of 3 turns: requests 0-2, 3-5, and the first turn of a third (6).
    for first in (0, 3, 6):
        turn0 = requests[first]
        assert [m["role"] for m in turn0.messages] == ["system", "user"]
        for k in range(first + 1, min(first + 3, len(requests))):
            prev, cur = requests[k - 1], requests[k]
            assert cur.prompt_len > prev.prompt_len
            assert cur.prompt_token_ids[: prev.prompt_len] == prev.prompt_token_ids, f"turn {k}"
            assert cur.messages[: len(prev.messages)] == prev.messages
            assert [m["role"] for m in cur.messages[len(prev.messages):]] == ["assistant", "user"]
    # A new conversation does not continue the previous one.
    assert requests[3].prompt_token_ids[: requests[2].prompt_len] != requests[2].prompt_token_ids
    # The tokens are the chat template's rendering of the messages.
    for r in requests:
        text = tokenizer.apply_chat_template(r.messages, add_generation_prompt=True, tokenize=False)
        assert r.prompt == text
        assert r.prompt_token_ids == tokenizer.encode(text, add_special_tokens=False)


def test_throughput_multiturn(model, tmp_path):
    out = tmp_path / "result.json"
    main(["bench", "throughput", "--model", model, "--dtype", "float32", "--dataset-name", "multiturn",
          "--num-prompts", "4", "--num-turns", "2", "--output-len", "3", "--output-json", str(out)])
    result = json.loads(out.read_text())
    check_figures(result, 4, 4 * 3)


def test_throughput_compare_prefix_caching(model, tmp_path, capsys):
    out, png = tmp_path / "result.json", tmp_path / "prefix.png"
    main(["bench", "throughput", "--model", model, "--dtype", "float32", "--num-prompts", "6",
          "--input-len", "16", "--prefix-len", "64", "--output-len", "4", "--compare-prefix-caching",
          "--output-json", str(out), "--plot", str(png)])
    assert "prompt tokens from the prefix cache" in capsys.readouterr().out
    result = json.loads(out.read_text())
    off, on = result["results"]["minivllm[no prefix caching]"], result["results"]["minivllm[prefix caching]"]
    assert list(result["results"]) == ["minivllm[no prefix caching]", "minivllm[prefix caching]"]
    for r in (off, on):
        check_figures(r, 6, 6 * 4)
        assert r["total_num_tokens"] == 6 * (64 + 16) + 6 * 4
    assert off["num_cached_prompt_tokens"] == 0
    # The 64-token shared prefix: full blocks of it come from the cache for the later prompts.
    assert 0 < on["num_cached_prompt_tokens"] <= 5 * 64
    # The top level is the last variant run.
    assert result["num_cached_prompt_tokens"] == on["num_cached_prompt_tokens"]
    assert_png(png)


def test_throughput_compare_tracing(model, tmp_path):
    out, traces = tmp_path / "result.json", tmp_path / "traces"
    main(["bench", "throughput", "--model", model, "--dtype", "float32", "--num-prompts", "4",
          "--input-len", "24", "--output-len", "5", "--compare-tracing", "--trace-dir", str(traces),
          "--output-json", str(out)])
    result = json.loads(out.read_text())
    assert list(result["results"]) == ["minivllm[tracing off]", "minivllm[tracing on]"]
    for r in result["results"].values():
        check_figures(r, 4, 4 * 5)
    (trace,) = traces.glob("*.json")  # the second run's only
    rows = {name: count for name, count, _, _ in summarize(load_trace(str(trace)))}
    assert rows["finished"] == 4 + 1  # and the warm-up request


# ---- bench latency ---------------------------------------------------------------------------


def test_latency(model, tmp_path, capsys):
    out, png = tmp_path / "latency.json", tmp_path / "latency.png"
    main(["bench", "latency", "--model", model, "--dtype", "float32", "--batch-size", "3", "--input-len", "16",
          "--output-len", "6", "--num-iters", "3", "--num-iters-warmup", "1", "--output-json", str(out),
          "--plot", str(png)])
    assert "Avg latency" in capsys.readouterr().out
    result = json.loads(out.read_text())
    check_latency(result, 3)
    assert result["config"]["batch_size"] == 3
    assert_environment(result)
    assert_png(png)


def test_latency_hf_compare(model, tmp_path, capsys):
    """transformers' run of the same batch is timed the same way and reported beside ours."""
    out = tmp_path / "latency.json"
    main(["bench", "latency", "--model", model, "--dtype", "float32", "--batch-size", "2", "--input-len", "16",
          "--output-len", "6", "--num-iters", "2", "--num-iters-warmup", "1", "--hf-compare",
          "--output-json", str(out)])
    printed = capsys.readouterr().out
    assert "Avg latency (minivllm)" in printed and "Avg latency (transformers)" in printed
    result = json.loads(out.read_text())
    check_latency(result, 2)
    check_latency(result["transformers"], 2)


def check_latency(result: dict, num_iters: int) -> None:
    """vLLM's latency keys, percentiles ordered, TTFT and TPOT consistent with the batch latency."""
    latencies = result["latencies"]
    assert len(latencies) == num_iters and all(x > 0 for x in latencies)
    assert result["avg_latency"] == pytest.approx(sum(latencies) / num_iters)
    percentiles = result["percentiles"]
    assert list(percentiles) == ["10", "25", "50", "75", "90", "99"]
    values = list(percentiles.values())
    assert values == sorted(values)
    assert percentiles["10"] <= percentiles["50"] <= percentiles["99"]
    assert min(latencies) <= percentiles["10"] and percentiles["99"] <= max(latencies)
    for name in ("e2el", "ttft", "tpot"):
        assert result[f"mean_{name}_ms"] > 0
        assert result[f"p50_{name}_ms"] <= result[f"p90_{name}_ms"] <= result[f"p99_{name}_ms"]
    assert result["mean_e2el_ms"] == pytest.approx(1000 * result["avg_latency"])
    # Every request's first token comes before its batch finishes.
    assert result["mean_ttft_ms"] <= result["mean_e2el_ms"]
    assert result["p99_ttft_ms"] <= 1000 * max(latencies)
    # 5 decode steps after the first token cannot take longer than the whole batch.
    assert result["p99_tpot_ms"] * 5 <= 1000 * max(latencies)
    assert result["startup_time"] > 0
