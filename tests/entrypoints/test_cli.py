"""The `minivllm` command line: generate prints the model's text; bench throughput writes its JSON."""

from __future__ import annotations

import json

import pytest

from minivllm import SamplingParams
from minivllm.engine import core_client, llm_engine
from minivllm.entrypoints.cli import main


def test_generate_prints_greedy_text(make_tiny_model, make_llm, capsys):
    model = str(make_tiny_model("qwen2"))
    main(["generate", "--model", model, "--dtype", "float32", "--prompt", "Hello", "--prompt", "Bye",
          "--max-tokens", "5"])
    printed = capsys.readouterr().out
    expected = make_llm(model, dtype="float32").generate(
        ["Hello", "Bye"], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False
    )
    for out in expected:
        assert f"Output: {out.outputs[0].text!r}" in printed


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--temperature", "-1"], "temperature must be non-negative"),
        (["--top-p", "0"], r"top_p must be in \(0, 1\]"),
        (["--max-tokens", "0"], "max_tokens must be at least 1"),
        (["--block-size", "3"], "block_size must be a power of two"),
        (["--dtype", "int3"], "Unsupported dtype"),
        (["--gpu-memory-utilization", "2"], r"gpu_memory_utilization must be in \(0, 1\]"),
        (["--model", "/no/such/model"], "does not exist"),
    ],
)
def test_generate_refuses_bad_arguments_before_starting_an_engine(make_tiny_model, monkeypatch, args, message):
    """Sampling arguments and the engine settings that need no model are checked first: the error
    comes without an engine process ever being started (a bad sampling argument used to wait for
    the model to load)."""
    started = []
    for module in (core_client, llm_engine):
        monkeypatch.setattr(module, "start_engine_interpreter", lambda **kw: started.append(args))
    with pytest.raises(SystemExit, match=message):
        main(["generate", "--model", str(make_tiny_model("llama")), "--prompt", "x", *args])
    assert started == []


def test_generate_reports_settings_the_model_refuses(make_tiny_model):
    with pytest.raises(SystemExit, match="max_model_len=99999 is larger"):
        main(["generate", "--model", str(make_tiny_model("llama")), "--prompt", "x", "--max-model-len", "99999"])


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_help_documents_engine_args(capsys, command):
    """Every engine flag carries its field's description (serve's come from AsyncEngineArgs,
    which inherits them)."""
    with pytest.raises(SystemExit):
        main([command, "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--max-num-batched-tokens" in help_text and "Token budget of one engine step" in help_text
    assert "Reuse the KV cache blocks of prompt prefixes" in help_text
    assert "--enforce-eager" in help_text
    if command == "serve":
        assert "--api-key" in help_text and "--shutdown-timeout" in help_text


def test_bench_throughput_json(make_tiny_model, tmp_path):
    out = tmp_path / "result.json"
    main(["bench", "throughput", "--model", str(make_tiny_model("llama")), "--num-prompts", "6",
          "--min-input-len", "10", "--max-input-len", "40", "--output-len", "7", "--hf-compare",
          "--output-json", str(out)])
    result = json.loads(out.read_text())
    for key in ("elapsed_time", "num_requests", "total_num_tokens", "requests_per_second", "tokens_per_second"):
        assert key in result
    assert result["num_requests"] == 6
    # ignore_eos: every request produces exactly its 7 tokens, in both engines.
    assert result["results"]["minivllm"]["total_output_tokens"] == 6 * 7
    assert result["results"]["transformers"]["total_output_tokens"] == 6 * 7
    prompt_tokens = result["total_num_tokens"] - 6 * 7
    assert 6 * 10 <= prompt_tokens <= 6 * 40
