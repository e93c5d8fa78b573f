"""What crosses the engine-core boundaries each step, as plain data.

ModelRunnerOutput goes from the worker to Scheduler.update_from_output; EngineCoreOutput goes
from the scheduler to the front end, over IPC when the engine runs in its own process. Neither
holds tensors: token ids are Python lists, logprobs numpy arrays (the serializer ships them as
raw buffers; this module itself imports nothing but msgspec).
"""

from __future__ import annotations

import bisect
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
    # Speculative decoding: the proposer's drafts for the next step, one list per request
    # (empty when none); [] when the engine does not speculate.
    draft_token_ids: list[list[int]] = msgspec.field(default_factory=list)
    # req_id -> why sampling failed for that request alone (it gets no tokens; see
    # ModelRunner._sample_isolating_failures). The step's other requests went on.
    failed: dict[str, str] = msgspec.field(default_factory=dict)
    # Tracing only (trace_dir): perf_counter_ns at the step's start, after preparing its inputs,
    # after the forward and after sampling.
    phase_ns: list[int] | None = None


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


class Histogram(msgspec.Struct, gc=False):
    """Observations counted per bucket (upper bounds; the last bucket is +Inf), Prometheus
    style: cheap to keep in the engine core and small enough to send with every step's stats."""

    buckets: tuple[float, ...]
    counts: list[int] = []
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def copy(self) -> Histogram:
        return Histogram(self.buckets, list(self.counts), self.total, self.count)

    def cumulative(self) -> list[tuple[str, int]]:
        """(upper bound, observations <= it) pairs, ending with +Inf."""
        pairs, running = [], 0
        for bound, n in zip((*map(str, self.buckets), "+Inf"), self.counts, strict=True):
            running += n
            pairs.append((bound, running))
        return pairs


# Upper bounds: step times in seconds, and the cost model's |measured / predicted - 1|.
STEP_SECONDS_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75,
                        1.0, 2.5, 5.0, 10.0)
STEP_COST_ERROR_BUCKETS = (0.02, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.5, 1.0)


class SpecDecodingStats(msgspec.Struct, gc=False):
    """Counters of draft verification (vLLM's spec_decode metrics): drafts verified (requests
    that had drafts in a step), their tokens, the tokens accepted, and accepted per position
    (position j counts drafts whose first j + 1 tokens were all accepted)."""

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = []

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for pos in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[pos] += 1

    def copy(self) -> SpecDecodingStats:
        return SpecDecodingStats(self.num_spec_tokens, self.num_drafts, self.num_draft_tokens,
                                 self.num_accepted_tokens, list(self.num_accepted_tokens_per_pos))


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
    step_seconds: Histogram = msgspec.field(default_factory=lambda: Histogram(STEP_SECONDS_BUCKETS))
    # Steps the cost model predicted (it is ready after its first steps): how far off it was.
    step_cost_error: Histogram = msgspec.field(default_factory=lambda: Histogram(STEP_COST_ERROR_BUCKETS))
    num_steps_over_budget: int = 0  # steps that took longer than max_step_ms (when set)
    spec_decoding: SpecDecodingStats | None = None  # when the engine speculates
