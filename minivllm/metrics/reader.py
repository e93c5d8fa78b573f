"""A snapshot of the engine's metrics under vLLM's names: what `LLM.get_metrics()` returns and
what the server's /metrics exports (metrics/prometheus.py), so the two always agree."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from minivllm.core.outputs import Histogram as HistogramStats
from minivllm.core.outputs import SpecDecodingStats
from minivllm.metrics.stats import EngineStats

if TYPE_CHECKING:
    from minivllm.config import CacheConfig


@dataclass
class Metric:
    name: str
    labels: dict[str, str] = field(default_factory=dict)
    help: str = ""


@dataclass
class Counter(Metric):
    value: int = 0


@dataclass
class Gauge(Metric):
    value: float = 0.0


@dataclass
class Histogram(Metric):
    count: int = 0
    sum: float = 0.0
    buckets: dict[str, int] = field(default_factory=dict)  # upper bound -> cumulative count


FINISH_REASONS = ("stop", "length", "abort")


def get_metrics_snapshot(stats: EngineStats, model_name: str, cache_config: CacheConfig) -> list[Metric]:
    labels = {"model_name": model_name}
    s = stats.scheduler
    hit_rate = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0

    def histogram(name: str, help_: str, h: HistogramStats) -> Histogram:
        return Histogram(name, labels, help_, h.count, h.total, dict(h.cumulative()))

    metrics: list[Metric] = [
        Gauge("vllm:num_requests_running", labels, "Requests in the running batch.", s.num_running_reqs),
        Gauge("vllm:num_requests_waiting", labels, "Requests waiting to be scheduled.", s.num_waiting_reqs),
        Gauge("vllm:kv_cache_usage_perc", labels, "KV cache usage, 1 = full.", s.kv_cache_usage),
        Gauge("vllm:gpu_prefix_cache_hit_rate", labels, "Prefix cache hits / queries, in tokens.", hit_rate),
        Gauge("vllm:cache_config_info", labels | _cache_config_labels(cache_config),
              "The KV cache's configuration, as labels (value 1): a tool can tell how many tokens it holds.", 1),
        Gauge("minivllm:engine_startup_seconds", labels, "Engine start-up time to ready.", stats.startup_seconds),
        Counter("vllm:num_preemptions", labels, "Requests preempted.", s.num_preemptions),
        Counter("vllm:prefix_cache_queries", labels, "Prompt tokens looked up in the prefix cache.",
                s.prefix_cache_queries),
        Counter("vllm:prefix_cache_hits", labels, "Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
        Counter("vllm:prompt_tokens", labels, "Prompt tokens of requests that started generating.",
                stats.prompt_tokens),
        Counter("vllm:generation_tokens", labels, "Generated tokens.", stats.generation_tokens),
        Counter("minivllm:computed_tokens", labels, "Tokens run through the model.", s.num_computed_tokens),
        histogram("vllm:time_to_first_token_seconds", "Time to first token.", stats.time_to_first_token),
        histogram("vllm:time_per_output_token_seconds", "Time per output token after the first.",
                  stats.time_per_output_token),
        histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.", stats.e2e_request_latency),
        histogram("minivllm:engine_step_seconds", "Engine step time (schedule, forward, sample, update): "
                  "what every running stream waits for.", s.step_seconds),
        histogram("minivllm:step_cost_relative_error", "|measured / predicted - 1| of the step cost model, "
                  "per step it predicted.", s.step_cost_error),
        Counter("minivllm:steps_over_budget", labels, "Steps longer than max_step_ms.", s.num_steps_over_budget),
    ]
    metrics += [
        Counter("vllm:request_success", {**labels, "finished_reason": reason}, "Finished requests.",
                stats.finished_requests[reason])
        for reason in FINISH_REASONS
    ]
    if s.spec_decoding is not None:
        metrics += _spec_decoding_metrics(s.spec_decoding, labels)
    return metrics


def _cache_config_labels(cache_config: CacheConfig) -> dict[str, str]:
    """vLLM's label set for the gauge: the configuration's fields as strings."""
    return {
        "block_size": str(cache_config.block_size),
        "num_gpu_blocks": str(cache_config.num_gpu_blocks),
        "enable_prefix_caching": str(cache_config.enable_prefix_caching),
    }


def _spec_decoding_metrics(spec: SpecDecodingStats, labels: dict[str, str]) -> list[Metric]:
    """vLLM's: acceptance rate = accepted / draft tokens; mean acceptance length (tokens per
    verifying step, the bonus token included) = 1 + accepted / drafts."""
    return [
        Counter("vllm:spec_decode_num_drafts", labels, "Draft verifications (a request's drafts in a step).",
                spec.num_drafts),
        Counter("vllm:spec_decode_num_draft_tokens", labels, "Draft tokens verified.", spec.num_draft_tokens),
        Counter("vllm:spec_decode_num_accepted_tokens", labels, "Draft tokens accepted.", spec.num_accepted_tokens),
    ] + [
        Counter("vllm:spec_decode_num_accepted_tokens_per_pos", {**labels, "position": str(pos)},
                "Draft tokens accepted at each position.", count)
        for pos, count in enumerate(spec.num_accepted_tokens_per_pos)
    ]
