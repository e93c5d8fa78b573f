"""SchedulerOutput: the scheduler's whole decision for one step, as a diff.

A request's full data (prompt, sampling params, blocks) is sent once, in NewRequestData, when it
is first scheduled; afterwards CachedRequestData carries only what changed (new block ids, the
computed-token count). Block ids come per KV cache group (core/kv_cache_interface.py): a tuple
with one list per group, in the groups' order. The worker keeps the rest in its persistent
batch, so the per-step message stays small even when it has to cross a process boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from minivllm.core.request import Request
    from minivllm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    block_ids: tuple[list[int], ...]  # per KV cache group
    num_computed_tokens: int

    @classmethod
    def from_request(cls, request: Request, block_ids: tuple[list[int], ...]) -> NewRequestData:
        return cls(
            req_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            eos_token_id=request.eos_token_id,
            block_ids=block_ids,
            num_computed_tokens=request.num_computed_tokens,
        )


@dataclass
class CachedRequestData:
    """Requests the worker already knows, as parallel lists."""

    req_ids: list[str] = field(default_factory=list)
    # A resumed request had all its blocks freed: new_block_ids replaces its block table
    # instead of extending it, and the worker recomputes its KV from num_computed_tokens.
    resumed_from_preemption: list[bool] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...]] = field(default_factory=list)  # per KV cache group
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> number of tokens to compute this step (prefill chunk, or 1 decode token plus the
    # request's speculative tokens).
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests finished or aborted since the last step: the worker drops their state.
    finished_req_ids: set[str]
    # Requests preempted in this step (freed blocks; back in the waiting queue).
    preempted_req_ids: set[str] = field(default_factory=set)
    # req_id -> the draft tokens to verify after its last known token (speculative decoding);
    # they are the last len(...) of the request's num_scheduled_tokens. Only requests that have
    # draft tokens appear.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Structured output: req_id -> its row of grammar_bitmask (numpy int32 [rows, ceil(vocab /
    # 32)], bit t % 32 of word t // 32 set when token t is allowed), for the structured-output
    # requests that sample in this step; the worker masks their logits with it.
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)
    grammar_bitmask: Any = None
