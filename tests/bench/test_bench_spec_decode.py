"""Speculative decoding figures of the bench commands: the one helper on hand-made counter
snapshots, the /metrics adapter on the server's real exposition, and `bench latency`,
`throughput` and `serve` end to end on a tiny random Llama, with n-gram drafts and with the model
drafting for itself (greedy then accepts every draft, so the counts are known exactly)."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
from server_utils import RemoteServer

from minivllm.bench.serve import parse_metrics, spec_decoding_counters
from minivllm.bench.utils import spec_decode_report, spec_decode_rows
from minivllm.config import CacheConfig
from minivllm.core.outputs import SchedulerStats, SpecDecodingStats
from minivllm.entrypoints.cli import main
from minivllm.metrics.prometheus import render
from minivllm.metrics.reader import get_metrics_snapshot
from minivllm.metrics.stats import EngineStats

LABELS = ("Spec decode drafts", "Spec decode draft tokens", "Spec decode accepted tokens",
          "Spec decode acceptance rate (%)", "Spec decode mean acceptance length",
          "Spec decode per-position acceptance (%)")
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1})
# A request of 1 + 2 * (k + 1) tokens with every draft accepted: the prefill samples the first
# token, then two steps each verify k drafts and add k + 1 tokens. So 2 drafts, 2k draft tokens.
K = 3
OUTPUT_LEN = 1 + 2 * (K + 1)


@pytest.fixture(scope="module")
def model(make_tiny_model) -> str:
    return str(make_tiny_model("llama"))


def self_draft(model: str) -> str:
    return json.dumps({"method": "draft_model", "model": model, "num_speculative_tokens": K})


# ---- the helper ------------------------------------------------------------------------------

BEFORE = SpecDecodingStats(3, num_drafts=10, num_draft_tokens=28, num_accepted_tokens=15,
                           num_accepted_tokens_per_pos=[8, 5, 2])
AFTER = SpecDecodingStats(3, num_drafts=30, num_draft_tokens=88, num_accepted_tokens=57,
                          num_accepted_tokens_per_pos=[26, 19, 12])


def test_spec_decode_report_by_hand():
    # The run: 20 drafts, 60 draft tokens, 42 accepted; per position 18, 14, 10 (summing to 42).
    report = spec_decode_report(BEFORE, AFTER)
    assert report == {
        "spec_decode_num_drafts": 20, "spec_decode_num_draft_tokens": 60, "spec_decode_num_accepted_tokens": 42,
        "spec_decode_num_accepted_tokens_per_pos": [18, 14, 10],
        "spec_decode_acceptance_rate": pytest.approx(0.7),  # 42 / 60
        "spec_decode_acceptance_length": pytest.approx(3.1),  # 1 + 42 / 20
        "spec_decode_per_position_acceptance_rates": pytest.approx([0.9, 0.7, 0.5]),  # 18, 14, 10 / 20
    }
    # Any object with the four counters will do.
    like = [SimpleNamespace(num_drafts=s.num_drafts, num_draft_tokens=s.num_draft_tokens,
                            num_accepted_tokens=s.num_accepted_tokens,
                            num_accepted_tokens_per_pos=s.num_accepted_tokens_per_pos) for s in (BEFORE, AFTER)]
    assert spec_decode_report(*like) == report
    assert spec_decode_rows(report) == [
        ("Spec decode drafts", "20"), ("Spec decode draft tokens", "60"), ("Spec decode accepted tokens", "42"),
        ("Spec decode acceptance rate (%)", "70.0"), ("Spec decode mean acceptance length", "3.10"),
        ("Spec decode per-position acceptance (%)", "90.0 70.0 50.0"),
    ]


def test_spec_decode_report_edge_cases():
    assert spec_decode_report(BEFORE, None) == {} and spec_decode_report(None, None) == {}
    assert spec_decode_rows({}) == [] and spec_decode_rows({"completed": 3}) == []
    # No snapshot before: the counters since the engine started.
    fresh = spec_decode_report(None, BEFORE)
    assert (fresh["spec_decode_num_drafts"], fresh["spec_decode_acceptance_length"]) == (10, 2.5)
    assert fresh["spec_decode_acceptance_rate"] == pytest.approx(15 / 28)
    # Nothing drafted during the run: zero rates, one token per step.
    idle = spec_decode_report(AFTER, AFTER.copy())
    assert idle["spec_decode_num_drafts"] == idle["spec_decode_num_accepted_tokens"] == 0
    assert idle["spec_decode_acceptance_rate"] == 0.0 and idle["spec_decode_acceptance_length"] == 1.0
    assert idle["spec_decode_per_position_acceptance_rates"] == [0.0, 0.0, 0.0]


def test_spec_decoding_counters_from_the_servers_exposition():
    """The adapter reads back what the server's /metrics renders, per-position labels included."""

    def scrape(spec: SpecDecodingStats | None) -> dict:
        stats = EngineStats(scheduler=SchedulerStats(spec_decoding=spec))
        return parse_metrics(render(lambda: get_metrics_snapshot(stats, "tiny", CacheConfig())).decode())

    after = spec_decoding_counters(scrape(AFTER))
    assert after == AFTER
    assert spec_decode_report(spec_decoding_counters(scrape(BEFORE)), after) == spec_decode_report(BEFORE, AFTER)
    assert spec_decoding_counters(scrape(None)) is None  # an engine that does not speculate


# ---- the commands ----------------------------------------------------------------------------


def check_figures(result: dict, num_spec_tokens: int) -> None:
    drafts, tokens = result["spec_decode_num_drafts"], result["spec_decode_num_draft_tokens"]
    accepted, per_pos = result["spec_decode_num_accepted_tokens"], result["spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_pos) == num_spec_tokens and sum(per_pos) == accepted <= tokens <= num_spec_tokens * drafts
    assert result["spec_decode_acceptance_rate"] == pytest.approx(accepted / tokens if tokens else 0.0)
    assert result["spec_decode_acceptance_length"] == pytest.approx(1 + accepted / drafts if drafts else 1.0)


def test_latency_grounded_ngram_prints_the_figures(model, tmp_path, capsys):
    out = tmp_path / "latency.json"
    main(["bench", "latency", "--model", model, "--dtype", "float32", "--dataset-name", "grounded",
          "--batch-size", "2", "--input-len", "96", "--output-len", "6", "--num-iters", "2",
          "--num-iters-warmup", "1", "--speculative-config", NGRAM, "--output-json", str(out)])
    printed = capsys.readouterr().out
    assert "Avg latency (minivllm)" in printed
    assert all(label in printed for label in LABELS), printed
    result = json.loads(out.read_text())
    check_figures(result, 3)
    assert result["config"]["dataset_name"] == "grounded"


def test_latency_self_draft_counts_only_the_measured_iterations(model, tmp_path, capsys):
    out = tmp_path / "latency.json"
    main(["bench", "latency", "--model", model, "--dtype", "float32", "--batch-size", "2", "--input-len", "16",
          "--output-len", str(OUTPUT_LEN), "--num-iters", "2", "--num-iters-warmup", "1",
          "--speculative-config", self_draft(model), "--output-json", str(out)])
    assert re.search(r"Spec decode mean acceptance length +4\.00\n", capsys.readouterr().out)
    result = json.loads(out.read_text())
    check_figures(result, K)
    # 2 iterations of 2 requests, 2 drafts each (the warm-up iteration's 4 are not counted).
    assert result["spec_decode_num_drafts"] == 2 * 2 * 2
    assert result["spec_decode_num_draft_tokens"] == result["spec_decode_num_accepted_tokens"] == 2 * 2 * 2 * K
    assert result["spec_decode_num_accepted_tokens_per_pos"] == [8] * K
    assert result["spec_decode_acceptance_rate"] == 1.0 and result["spec_decode_acceptance_length"] == 1 + K
    assert result["spec_decode_per_position_acceptance_rates"] == [1.0] * K


def test_throughput_self_draft(model, tmp_path, capsys):
    out = tmp_path / "throughput.json"
    main(["bench", "throughput", "--model", model, "--dtype", "float32", "--dataset-name", "grounded",
          "--num-prompts", "3", "--input-len", "80", "--output-len", str(OUTPUT_LEN), "--temperature", "0",
          "--speculative-config", self_draft(model), "--output-json", str(out)])
    printed = capsys.readouterr().out
    assert all(label in printed for label in LABELS), printed
    result = json.loads(out.read_text())
    check_figures(result, K)
    assert result["total_output_tokens"] == 3 * OUTPUT_LEN
    # The warm-up request's draft is not counted.
    assert (result["spec_decode_num_drafts"], result["spec_decode_num_accepted_tokens"]) == (3 * 2, 3 * 2 * K)
    assert result["results"]["minivllm"]["spec_decode_acceptance_rate"] == 1.0


def test_throughput_without_speculation_has_no_figures(model, tmp_path, capsys):
    out = tmp_path / "throughput.json"
    main(["bench", "throughput", "--model", model, "--dtype", "float32", "--num-prompts", "2",
          "--input-len", "8", "--output-len", "3", "--output-json", str(out)])
    assert "Spec decode" not in capsys.readouterr().out
    assert not any(key.startswith("spec_decode") for key in json.loads(out.read_text()))


def test_serve_grounded_self_draft_figures_from_metrics(model, tmp_path, capsys):
    out = tmp_path / "serve.json"
    args = ["--dtype", "float32", "--max-model-len", "512", "--speculative-config", self_draft(model)]
    with RemoteServer(model, args) as server:
        main(["bench", "serve", "--port", str(server.port), "--disable-tqdm", "--dataset-name", "grounded",
              "--num-prompts", "2", "--random-input-len", "80", "--random-output-len", str(OUTPUT_LEN),
              "--output-json", str(out)])
    printed = capsys.readouterr().out
    assert all(label in printed for label in LABELS), printed
    result = json.loads(out.read_text())
    check_figures(result, K)
    assert result["completed"] == 2 and result["total_output_tokens"] == 2 * OUTPUT_LEN
    assert result["spec_decode_num_drafts"] == 2 * 2 and result["spec_decode_acceptance_rate"] == 1.0
