"""What crosses the engine-core boundaries each step, as plain data.

ModelRunnerOutput goes from the worker to Scheduler.update_from_output; EngineCoreOutput goes
from the scheduler to the front end, over IPC when the engine runs in its own process. Neither
holds tensors: token ids are Python lists, logprobs numpy arrays (the serializer ships them as
raw buffers; this module itself imports nothing but msgspec).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec

from minivllm.core.request import FinishReason


class LogprobsArrays(NamedTuple):
    """Logprobs of chosen tokens, one row per token, as numpy arrays.

    Row layout: index 0 is the chosen token (sampled, or the actual prompt token), 1..N the top-N
    tokens of the raw model distribution, where N is the largest number asked for.
    """

    logprob_token_ids: Any  # np.ndarray [rows, 1 + N] int64
    logprobs: Any  # np.ndarray [rows, 1 + N] float32
    token_ranks: Any  # np.ndarray [rows] int64, 1-based rank of the chosen token

    def slice_rows(self, start: int, end: int, width: int) -> LogprobsArrays:
        return LogprobsArrays(
            self.logprob_token_ids[start:end, :width], self.logprobs[start:end, :width], self.token_ranks[start:end]
        )


class ModelRunnerOutput(msgspec.Struct, array_like=True, gc=False):
    """One step's results from the worker, rows in `req_ids` order."""

    req_ids: list[str]
    # One list per request: [] when the step did not reach a sampling position
    # (a prefill chunk that ends before the prompt does).
    sampled_token_ids: list[list[int]]
    # Rows follow sampled_token_ids flattened; None when no request in the step asked for them.
    logprobs: LogprobsArrays | None = None
    # req_id -> logprobs of the prompt tokens this step's chunk predicted (one row per token).
    prompt_logprobs: dict[str, LogprobsArrays] = msgspec.field(default_factory=dict)


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """New tokens (and finish state) of one request after one step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsArrays | None = None
    new_prompt_logprobs: LogprobsArrays | None = None
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
