"""Engine statistics as the front end sees them: the scheduler's latest snapshot plus counters
and latency histograms kept while processing outputs. One place, read by LLM.get_metrics and
the server's /metrics."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from minivllm.core.outputs import Histogram, SchedulerStats
from minivllm.outputs import RequestMetrics

# Upper bounds in seconds (vLLM's buckets for the same histograms).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass
class EngineStats:
    scheduler: SchedulerStats = field(default_factory=SchedulerStats)
    startup_seconds: float = 0.0  # engine construction to ready (model loaded, KV cache sized)
    prompt_tokens: int = 0  # prompt lengths of requests that produced their first token
    generation_tokens: int = 0
    finished_requests: Counter[str] = field(default_factory=Counter)  # by finish reason
    time_to_first_token: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    time_per_output_token: Histogram = field(default_factory=lambda: Histogram(TPOT_BUCKETS))
    e2e_request_latency: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))

    def record_scheduler_stats(self, stats: SchedulerStats | None) -> None:
        if stats is not None:
            self.scheduler = stats

    def record_first_token(self, prompt_len: int, metrics: RequestMetrics) -> None:
        self.prompt_tokens += prompt_len
        if metrics.time_to_first_token is not None:
            self.time_to_first_token.observe(metrics.time_to_first_token)

    def record_new_tokens(self, num_tokens: int) -> None:
        self.generation_tokens += num_tokens

    def record_finished(self, finish_reason: str, metrics: RequestMetrics, num_output_tokens: int) -> None:
        self.finished_requests[finish_reason] += 1
        if metrics.finished_time is None:
            return
        e2e = metrics.finished_time - metrics.arrival_time
        self.e2e_request_latency.observe(e2e)
        ttft = metrics.time_to_first_token
        if ttft is not None and num_output_tokens > 1:
            self.time_per_output_token.observe((e2e - ttft) / (num_output_tokens - 1))
