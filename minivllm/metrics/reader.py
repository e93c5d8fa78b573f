"""A snapshot of the engine's metrics under vLLM's names, as `LLM.get_metrics()` returns them."""

from __future__ import annotations

from dataclasses import dataclass, field

from minivllm.metrics.stats import EngineStats


@dataclass
class Metric:
    name: str
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class Counter(Metric):
    value: int = 0


@dataclass
class Gauge(Metric):
    value: float = 0.0


FINISH_REASONS = ("stop", "length", "abort")


def get_metrics_snapshot(stats: EngineStats, model_name: str) -> list[Metric]:
    labels = {"model_name": model_name}
    s = stats.scheduler
    metrics: list[Metric] = [
        Gauge("vllm:num_requests_running", labels, s.num_running_reqs),
        Gauge("vllm:num_requests_waiting", labels, s.num_waiting_reqs),
        Gauge("vllm:kv_cache_usage_perc", labels, s.kv_cache_usage),
        Counter("vllm:num_preemptions", labels, s.num_preemptions),
        Counter("vllm:prefix_cache_queries", labels, s.prefix_cache_queries),
        Counter("vllm:prefix_cache_hits", labels, s.prefix_cache_hits),
        Counter("vllm:prompt_tokens", labels, stats.prompt_tokens),
        Counter("vllm:generation_tokens", labels, stats.generation_tokens),
        Counter("minivllm:computed_tokens", labels, s.num_computed_tokens),
    ]
    metrics += [
        Counter("vllm:request_success", {**labels, "finished_reason": reason}, stats.finished_requests[reason])
        for reason in FINISH_REASONS
    ]
    return metrics
