"""Serving-benchmark metric definitions (minivllm.bench.metrics) on hand-made request traces.

Every expectation is computed here from the raw timestamps (numpy for the statistics), never
from the module under test: TTFT = first chunk - start, E2EL = last chunk - start,
TPOT = (E2EL - TTFT) / (n - 1), ITL = gaps between chunks, goodput = requests meeting every SLO.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from minivllm.bench.metrics import (
    RequestTrace,
    meets_slos,
    parse_goodput,
    peak_output_throughput,
    summarize,
)


def make_trace(
    start: float,
    chunk_times: list[float],
    *,
    prompt_len: int = 10,
    chunk_tokens: list[int] | None = None,
    output_tokens: int | None = None,
    success: bool = True,
) -> RequestTrace:
    """A trace as the client would record it, from absolute chunk arrival times."""
    tokens = chunk_tokens if chunk_tokens is not None else [1] * len(chunk_times)
    return RequestTrace(
        prompt_len=prompt_len,
        start_time=start,
        success=success,
        output_tokens=output_tokens if output_tokens is not None else sum(tokens),
        ttft=chunk_times[0] - start if chunk_times else 0.0,
        latency=chunk_times[-1] - start if chunk_times else 0.0,
        itl=[b - a for a, b in zip(chunk_times, chunk_times[1:], strict=False)],
        chunk_times=list(chunk_times),
        chunk_tokens=list(tokens),
        error="" if success else "boom",
    )


# Three successful requests with different shapes, one failed request whose (absurd) numbers must
# not leak into any latency statistic, and one successful single-token request (no TPOT).
A = dict(start=0.0, chunk_times=[0.2, 0.3, 0.45, 0.5, 0.7], prompt_len=12)
B = dict(start=0.1, chunk_times=[0.9, 1.0, 1.3], prompt_len=7)
C = dict(start=0.4, chunk_times=[0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 1.95], prompt_len=30)
SINGLE = dict(start=1.0, chunk_times=[1.25], prompt_len=5)
FAILED = dict(start=0.2, chunk_times=[50.0, 99.0], prompt_len=1000, success=False)


def traces() -> list[RequestTrace]:
    return [make_trace(**spec) for spec in (A, B, C, SINGLE, FAILED)]


def test_tpot_definition():
    a = make_trace(**A)
    assert a.ttft == pytest.approx(0.2)
    assert a.latency == pytest.approx(0.7)
    assert a.tpot == pytest.approx((0.7 - 0.2) / (5 - 1))
    # TPOT uses the token count, not the chunk count: 2 chunks carrying 6 tokens.
    multi = make_trace(0.0, [1.0, 2.0], chunk_tokens=[3, 3])
    assert multi.tpot == pytest.approx((2.0 - 1.0) / (6 - 1))
    assert make_trace(**SINGLE).tpot is None
    assert RequestTrace(prompt_len=1, start_time=0.0, success=True, output_tokens=0).tpot is None


def _ms(values: list[float]) -> np.ndarray:
    return np.array(values) * 1000


def test_summarize_latency_statistics_match_numpy():
    result = summarize(traces(), duration=2.0)
    ok = [make_trace(**spec) for spec in (A, B, C, SINGLE)]
    raw = {
        "ttft": [t.chunk_times[0] - t.start_time for t in ok],
        "e2el": [t.chunk_times[-1] - t.start_time for t in ok],
        "tpot": [(t.chunk_times[-1] - t.chunk_times[0]) / (len(t.chunk_times) - 1)
                 for t in ok if len(t.chunk_times) > 1],
        "itl": [b - a for t in ok for a, b in zip(t.chunk_times, t.chunk_times[1:], strict=False)],
    }
    # Hand-checked sizes: the single-token request has no TPOT and no ITL.
    assert len(raw["tpot"]) == 3 and len(raw["itl"]) == 4 + 2 + 6
    for name, values in raw.items():
        ms = _ms(values)
        assert result[f"mean_{name}_ms"] == pytest.approx(ms.mean()), name
        assert result[f"median_{name}_ms"] == pytest.approx(np.median(ms)), name
        assert result[f"std_{name}_ms"] == pytest.approx(ms.std()), name
        for p in (50, 90, 99):
            assert result[f"p{p}_{name}_ms"] == pytest.approx(np.percentile(ms, p)), (name, p)
        assert result[f"p50_{name}_ms"] == pytest.approx(result[f"median_{name}_ms"])
        assert result[f"p50_{name}_ms"] <= result[f"p90_{name}_ms"] <= result[f"p99_{name}_ms"]
    # The failed request's 50 s TTFT / 99 s E2EL would dominate every maximum if counted.
    assert result["p99_e2el_ms"] < 2000 and result["p99_ttft_ms"] < 1000


def test_summarize_counts_and_throughputs():
    duration = 2.5
    result = summarize(traces(), duration=duration)
    assert result["completed"] == 4
    assert result["failed"] == 1
    assert result["errors"] == ["boom"]
    out_tokens = 5 + 3 + 7 + 1
    in_tokens = 12 + 7 + 30 + 5  # the failed request's 1000 prompt tokens are not counted
    assert result["total_output_tokens"] == out_tokens
    assert result["total_input_tokens"] == in_tokens
    assert result["duration"] == duration
    assert result["request_throughput"] == pytest.approx(4 / duration)
    assert result["output_throughput"] == pytest.approx(out_tokens / duration)
    assert result["total_token_throughput"] == pytest.approx((in_tokens + out_tokens) / duration)
    assert "request_goodput" not in result  # no SLOs, no goodput


def test_summarize_custom_percentiles():
    result = summarize(traces(), duration=1.0, percentiles=(25, 75))
    ttfts_ms = _ms([0.2, 0.8, 0.1, 0.25])
    assert result["p25_ttft_ms"] == pytest.approx(np.percentile(ttfts_ms, 25))
    assert result["p75_ttft_ms"] == pytest.approx(np.percentile(ttfts_ms, 75))
    assert "p99_ttft_ms" not in result


def test_all_failed_requests():
    failed = [make_trace(**FAILED), make_trace(0.0, [1.0], success=False)]
    result = summarize(failed, duration=3.0, slos={"ttft": 10_000.0})
    assert result["completed"] == 0 and result["failed"] == 2
    assert result["total_output_tokens"] == 0 and result["request_throughput"] == 0
    assert result["request_goodput"] == 0
    assert result["max_output_tokens_per_s"] == 0
    stats = {k: v for k, v in result.items() if k.endswith("_ms") and k != "goodput_slos_ms"}
    assert len(stats) == 4 * 6 and all(math.isfinite(v) for v in stats.values())


# ---- goodput ---------------------------------------------------------------------------------

# TTFT / TPOT / E2EL in ms of each request (hand-computed from its chunk times):
#   GOOD:      100 / 50  / 300   -> meets ttft:200 tpot:100 e2el:1000
#   SLOW_TPOT: 100 / 300 / 1000  -> meets ttft but not tpot
#   SLOW_TTFT: 500 / 50  / 700   -> meets tpot but not ttft
#   FAILED_OK: would meet all, but failed
GOOD = make_trace(0.0, [0.1, 0.15, 0.2, 0.25, 0.3])
SLOW_TPOT = make_trace(1.0, [1.1, 1.4, 1.7, 2.0])
SLOW_TTFT = make_trace(2.0, [2.5, 2.55, 2.6, 2.65, 2.7])
FAILED_OK = make_trace(0.5, [0.6, 0.65, 0.7], success=False)


def test_meets_slos_requires_every_slo():
    slos = {"ttft": 200.0, "tpot": 100.0}
    assert meets_slos(GOOD, slos)
    assert not meets_slos(SLOW_TPOT, slos)
    assert not meets_slos(SLOW_TTFT, slos)
    assert not meets_slos(FAILED_OK, slos)
    # Each of the two slow requests does meet the SLO it is not slow on.
    assert meets_slos(SLOW_TPOT, {"ttft": 200.0}) and meets_slos(SLOW_TTFT, {"tpot": 100.0})
    # e2el: 300 and 700 ms pass 800, 1000 ms does not; limits are inclusive.
    assert meets_slos(GOOD, {"e2el": 800.0}) and meets_slos(SLOW_TTFT, {"e2el": 800.0})
    assert not meets_slos(SLOW_TPOT, {"e2el": 800.0})
    assert meets_slos(SLOW_TPOT, {"e2el": 1000.0 + 1e-6})
    assert meets_slos(GOOD, {})  # no SLO: every successful request is good


def test_goodput_counts_only_requests_meeting_every_slo():
    all_traces = [GOOD, SLOW_TPOT, SLOW_TTFT, FAILED_OK]
    duration = 4.0
    result = summarize(all_traces, duration, {"ttft": 200.0, "tpot": 100.0})
    assert result["request_goodput"] == pytest.approx(1 / duration)
    assert result["goodput_slos_ms"] == {"ttft": 200.0, "tpot": 100.0}
    # Loosening TTFT admits SLOW_TTFT too; adding e2el:800 then removes nothing more.
    assert summarize(all_traces, duration, {"ttft": 600.0, "tpot": 100.0})["request_goodput"] == pytest.approx(2 / duration)
    assert summarize(all_traces, duration, {"ttft": 600.0, "tpot": 100.0, "e2el": 800.0})[
        "request_goodput"] == pytest.approx(2 / duration)
    # Generous SLOs: every successful request, never the failed one.
    assert summarize(all_traces, duration, {"ttft": 1e6, "tpot": 1e6, "e2el": 1e6})[
        "request_goodput"] == pytest.approx(3 / duration)


def test_parse_goodput():
    assert parse_goodput(None) == {}
    assert parse_goodput([]) == {}
    assert parse_goodput(["ttft:500", "tpot:50", "e2el:3000"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 3000.0}
    assert parse_goodput(["ttft:12.5"]) == {"ttft": 12.5}


@pytest.mark.parametrize("spec", [
    "ttft", "ttft:", ":500", "itl:50", "TTFT:500", "latency:10", "ttft:abc", "ttft:5:6", "ttft=500",
    "ttft:-1", "e2el:-0.5",
])
def test_parse_goodput_rejects_bad_specs(spec):
    with pytest.raises(ValueError):
        parse_goodput([spec])


@pytest.mark.parametrize("bad", ["itl:5", "ttft:-5"])
def test_bench_serve_rejects_bad_goodput_before_connecting(bad):
    from minivllm.entrypoints.cli import main

    # Port 9 (discard) has no server: the error must come from the flag check, not a connection.
    with pytest.raises(SystemExit, match="goodput"):
        main(["bench", "serve", "--port", "9", "--goodput", "tpot:50", bad])


# ---- peak output throughput ------------------------------------------------------------------


def test_peak_output_throughput_one_second_buckets():
    # Buckets are seconds since the earliest request start (t = 10.0):
    #   [0, 1): 1 + 1 + 2 = 4 tokens; [1, 2): 2 + 1 + 3 + 1 + 3 = 10 tokens; [2, 3): 4 tokens.
    t1 = make_trace(10.0, [10.2, 10.6, 11.1, 11.2], chunk_tokens=[1, 1, 2, 1])
    t2 = make_trace(10.5, [10.9, 11.3, 11.95, 12.1], chunk_tokens=[2, 3, 1, 4])
    t3 = make_trace(10.7, [11.5], chunk_tokens=[3])
    # A failed request's chunks never count, even in a bucket where they would be the peak.
    failed = make_trace(10.1, [12.2, 12.3], chunk_tokens=[50, 50], success=False)
    expected = {0: 4, 1: 10, 2: 4}
    assert peak_output_throughput([t1, t2, t3, failed]) == max(expected.values()) == 10
    assert summarize([t1, t2, t3, failed], 3.0)["max_output_tokens_per_s"] == 10
    # A lone request: every token in one bucket.
    assert peak_output_throughput([make_trace(0.0, [0.1, 0.2, 0.3])]) == 3
    assert peak_output_throughput([]) == 0.0
