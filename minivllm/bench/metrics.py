"""Serving benchmark metrics from per-request traces, with vLLM's definitions and key names.

A trace records when a request was sent, when each output chunk arrived and how many tokens it
carried. From those: TTFT (first chunk - start), E2EL (last chunk - start), TPOT ((E2EL - TTFT) /
(output tokens - 1)), ITL (gaps between consecutive chunks), throughputs, peak output tokens per
second, and goodput (requests per second meeting every SLO).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class RequestTrace:
    prompt_len: int
    start_time: float  # perf_counter seconds
    success: bool = False
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    latency: float = 0.0  # end-to-end, seconds
    itl: list[float] = field(default_factory=list)  # gaps between chunks, seconds
    chunk_times: list[float] = field(default_factory=list)  # absolute arrival times
    chunk_tokens: list[int] = field(default_factory=list)  # tokens carried by each chunk
    text: str = ""  # the output, for checking structured outputs
    error: str = ""
    done: bool = False  # the stream ended as the protocol says: [DONE] (after output or an error event)

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def parse_goodput(specs: list[str] | None) -> dict[str, float]:
    """`ttft:500 tpot:50 e2el:3000` (milliseconds) -> {"ttft": 500.0, ...}."""
    slos: dict[str, float] = {}
    for spec in specs or []:
        name, _, value = spec.partition(":")
        try:
            limit = float(value)
        except ValueError:
            limit = float("nan")
        if name not in ("ttft", "tpot", "e2el") or not limit >= 0:  # NOTE: also rejects NaN
            raise ValueError(f"Bad --goodput entry {spec!r}; use ttft:MS, tpot:MS or e2el:MS (MS >= 0).")
        slos[name] = limit
    return slos


def meets_slos(trace: RequestTrace, slos: dict[str, float]) -> bool:
    values_ms = {"ttft": trace.ttft * 1000, "e2el": trace.latency * 1000,
                 "tpot": (trace.tpot or 0.0) * 1000}
    return trace.success and all(values_ms[name] <= limit for name, limit in slos.items())


def peak_output_throughput(traces: list[RequestTrace]) -> float:
    """Most output tokens that arrived within any one-second window bucket of the run."""
    times = [t for trace in traces if trace.success for t in trace.chunk_times]
    tokens = [n for trace in traces if trace.success for n in trace.chunk_tokens]
    if not times:
        return 0.0
    start = min(trace.start_time for trace in traces)
    buckets = np.bincount(((np.array(times) - start) // 1.0).astype(int), weights=np.array(tokens, dtype=float))
    return float(buckets.max())


def _stats(name: str, values_s: list[float], percentiles: tuple[int, ...]) -> dict[str, float]:
    values = np.array(values_s or [0.0]) * 1000
    out = {f"mean_{name}_ms": float(values.mean()), f"median_{name}_ms": float(np.median(values)),
           f"std_{name}_ms": float(values.std())}
    out |= {f"p{p}_{name}_ms": float(np.percentile(values, p)) for p in percentiles}
    return out


def summarize(
    traces: list[RequestTrace], duration: float, slos: dict[str, float] | None = None,
    percentiles: tuple[int, ...] = (50, 90, 99),
) -> dict[str, Any]:
    ok = [t for t in traces if t.success]
    output_tokens = sum(t.output_tokens for t in ok)
    input_tokens = sum(t.prompt_len for t in ok)
    result: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(traces) - len(ok),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": output_tokens / duration if duration else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / duration if duration else 0.0,
        "max_output_tokens_per_s": peak_output_throughput(traces),
        "errors": [t.error for t in traces if not t.success][:20],
    }
    if slos:
        good = sum(meets_slos(t, slos) for t in traces)
        result["request_goodput"] = good / duration if duration else 0.0
        result["goodput_slos_ms"] = slos
    result |= _stats("ttft", [t.ttft for t in ok], percentiles)
    result |= _stats("tpot", [t.tpot for t in ok if t.tpot is not None], percentiles)
    result |= _stats("itl", [gap for t in ok for gap in t.itl], percentiles)
    result |= _stats("e2el", [t.latency for t in ok], percentiles)
    return result
