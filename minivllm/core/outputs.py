"""What crosses the engine-core boundaries each step, as plain data.

ModelRunnerOutput goes from the worker to Scheduler.update_from_output; EngineCoreOutput goes
from the scheduler to the front end (and, later, over IPC). Neither holds tensors: the worker
converts its results to Python lists once per step, in one device-to-host copy.
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec

from minivllm.core.request import FinishReason


class LogprobsLists(NamedTuple):
    """Logprobs of sampled tokens, one row per sampled token.

    Row layout: index 0 is the chosen token (sampled, or the actual prompt token), 1..N the top-N
    tokens of the raw model distribution, where N is the largest number asked for.
    """

    logprob_token_ids: list[list[int]]
    logprobs: list[list[float]]
    token_ranks: list[int]  # 1-based rank of the chosen token (sampled, or the prompt token)


class ModelRunnerOutput(msgspec.Struct, array_like=True, gc=False):
    """One step's results from the worker, rows in `req_ids` order."""

    req_ids: list[str]
    # One list per request: [] when the step did not reach a sampling position
    # (a prefill chunk that ends before the prompt does).
    sampled_token_ids: list[list[int]]
    # Rows follow sampled_token_ids flattened; None when no request in the step asked for them.
    logprobs: LogprobsLists | None = None
    # req_id -> logprobs of the prompt tokens this step's chunk predicted (one row per token).
    prompt_logprobs: dict[str, LogprobsLists] = msgspec.field(default_factory=dict)


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """New tokens (and finish state) of one request after one step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, gc=False):
    """The scheduler's state after a step: gauges, and counters that only grow (so a reader may
    skip snapshots without losing counts)."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    num_computed_tokens: int = 0  # tokens run through the model (prefill chunks and decodes)
    prefix_cache_requests: int = 0
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # tokens found there


class EngineCoreOutputs(msgspec.Struct, array_like=True, gc=False):
    """Everything one engine-core step produced."""

    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
