"""Iteration-level scheduler: continuous batching with chunked prefill and preemption.

NOTE on the algorithm (vLLM V1's): there is no prefill phase and no decode phase. Each request
has `num_computed_tokens` and `num_tokens_with_spec` (its known tokens plus the draft tokens to
verify); every step the scheduler hands out a budget of `max_num_batched_tokens` so that
computed tokens catch up. A decode is a request one token behind (plus its drafts); a prefill
chunk is a request many tokens behind, cut to the budget (and to long_prefill_token_threshold).
Running requests are served first, decodes before prefill chunks (a stream never waits behind a
prompt), each kind in admission order; waiting requests are admitted after, in the policy's order (request_queue.py:
arrival, or priority then arrival). When the KV cache runs out, a running request is preempted:
its blocks are freed and it goes back to the queue, to be recomputed. Under "fcfs" that is the
most recently admitted one (back to the head of the queue); under "priority", the one of the
lowest priority (the highest value), latest arrival among equals.

After the step, update_from_output appends each request's sampled tokens one at a time (a step
may give several: accepted drafts plus one), stops at the first stop condition, and takes back
the computed draft tokens that were rejected.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass, field
from itertools import accumulate
from typing import TYPE_CHECKING

from minivllm.config import SchedulingPolicy
from minivllm.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from minivllm.core.outputs import (
    STEP_SECONDS_BUCKETS,
    EngineCoreOutput,
    Histogram,
    LogprobsArrays,
    SchedulerStats,
    SpecDecodingStats,
)
from minivllm.core.request import Request, RequestStatus
from minivllm.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from minivllm.core.sched.request_queue import create_request_queue
from minivllm.core.sched.step_cost import StepBudget, StepCostModel, StepShape
from minivllm.logger import init_logger

if TYPE_CHECKING:
    from minivllm.config import CacheConfig, SchedulerConfig, SpeculativeConfig
    from minivllm.core.kv_cache_interface import KVCacheConfig
    from minivllm.core.outputs import ModelRunnerOutput
    from minivllm.structured_output import StructuredOutputManager


logger = init_logger(__name__)

# Prompt tokens a step takes even when the step-time budget has no room left for them.
MIN_PREFILL_CHUNK = 16


def _is_prefill(request: Request, num_computed: int) -> bool:
    """More than the last known token still to compute: a prompt (or, after a preemption, a
    recomputation) in progress, not a decode."""
    return request.num_tokens - num_computed > 1


def _leaves_prompt_unfinished(request: Request, num_computed: int, num_new_tokens: int) -> bool:
    return num_computed + num_new_tokens < request.num_tokens


@dataclass
class _StepPlan:
    """What one schedule() has handed out so far."""

    token_budget: int
    time_allowance_s: float | None  # what the step may be predicted to take (None: no time budget)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_block_ids: dict[str, tuple[list[int], ...]] = field(default_factory=dict)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    shape: StepShape = field(default_factory=StepShape)
    num_prefill_tokens: int = 0
    num_partial: int = 0  # prompts this step leaves unfinished

    def add(self, request: Request, num_computed: int, num_new_tokens: int, blocks: tuple[list[int], ...]) -> None:
        self.num_scheduled_tokens[request.request_id] = num_new_tokens
        self.new_block_ids[request.request_id] = blocks
        self._tally(request, num_computed, num_new_tokens, 1)

    def take_back(self, request: Request) -> None:
        """Undo add() for a request preempted later in the same step (its num_computed_tokens
        has not moved yet)."""
        num_new_tokens = self.num_scheduled_tokens.pop(request.request_id)
        del self.new_block_ids[request.request_id]
        self.scheduled_spec_decode_tokens.pop(request.request_id, None)
        self._tally(request, request.num_computed_tokens, num_new_tokens, -1)

    def _tally(self, request: Request, num_computed: int, num_new_tokens: int, sign: int) -> None:
        self.token_budget -= sign * num_new_tokens
        self.shape.add(num_computed, num_new_tokens, sign)
        if _leaves_prompt_unfinished(request, num_computed, num_new_tokens):
            self.num_partial += sign
        if _is_prefill(request, num_computed):
            self.num_prefill_tokens += sign * num_new_tokens


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        kv_cache_config: KVCacheConfig,
        structured_output_manager: StructuredOutputManager | None = None,
        speculative_config: SpeculativeConfig | None = None,
    ) -> None:
        """`kv_cache_config` comes from core/kv_cache_utils.py: get_kv_cache_config, which also
        checks that one request of max_model_len tokens fits (so preemption always makes
        progress)."""
        self.max_num_running_reqs = scheduler_config.max_num_seqs
        self.max_num_scheduled_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.policy = SchedulingPolicy.parse(scheduler_config.policy)
        self.long_prefill_token_threshold = scheduler_config.long_prefill_token_threshold
        self.max_num_partial_prefills = scheduler_config.max_num_partial_prefills
        self.step_cost = StepCostModel()
        max_step_ms = scheduler_config.max_step_ms
        self.step_budget = StepBudget(max_step_ms / 1000) if max_step_ms is not None else None
        self.step_seconds = Histogram(STEP_SECONDS_BUCKETS)
        self.num_steps_over_budget = 0
        self.last_step_shape = StepShape()  # of the step last scheduled, for its timing
        self.kv_cache_manager = KVCacheManager(
            kv_cache_config,
            self.max_model_len,
            enable_caching=cache_config.enable_prefix_caching,
            hash_algo=cache_config.prefix_caching_hash_algo,
        )

        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        # Finished or aborted since the last schedule(): the worker must drop their state.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self.num_computed_tokens_total = 0
        self.structured_output_manager = structured_output_manager
        # Requests that failed alone (a grammar that did not compile, sampling that raised):
        # their error goes out with the next outputs.
        self._failed: list[Request] = []
        # Speculative decoding: slots each sampling request gets past its scheduled tokens
        # (where a drafter writes its KV), and the verification counters.
        self.num_lookahead_tokens = speculative_config.num_lookahead_tokens if speculative_config else 0
        self.spec_decoding_stats = (
            SpecDecodingStats(speculative_config.num_speculative_tokens) if speculative_config else None)

    # ---- request intake -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"Request id {request.request_id!r} is already in the engine.")
        if request.structured_output_request is not None:
            if self.structured_output_manager is None:
                raise ValueError("This engine has no structured output manager.")
            self.structured_output_manager.grammar_init(request)
        self.waiting.add_request(request)
        self.requests[request.request_id] = request

    def finish_requests(self, request_ids: Iterable[str], finished_status: RequestStatus) -> None:
        """Finish requests from outside the step loop (abort); unknown ids are ignored."""
        assert RequestStatus.is_finished(finished_status)
        running, waiting = set(), set()
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            (running if request.status == RequestStatus.RUNNING else waiting).add(req_id)
            request.status = finished_status
            self._free_request(request)
        # One pass per queue, so aborting thousands of requests (a dropped n=10000) stays linear.
        if running:
            self.running = [r for r in self.running if r.request_id not in running]
        if waiting:
            self.waiting.remove_requests(waiting)

    def make_stats(self) -> SchedulerStats:
        prefix = self.kv_cache_manager.prefix_cache_stats
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            num_preemptions=self.num_preemptions,
            num_computed_tokens=self.num_computed_tokens_total,
            prefix_cache_requests=prefix.requests,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            # Copies: the output thread may still be encoding this snapshot during the next step.
            step_seconds=self.step_seconds.copy(),
            step_cost_error=self.step_cost.error.copy(),
            num_steps_over_budget=self.num_steps_over_budget,
            spec_decoding=self.spec_decoding_stats.copy() if self.spec_decoding_stats else None,
        )

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    # ---- schedule -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        plan = _StepPlan(self.max_num_scheduled_tokens,
                         self.step_budget.allowance() if self.step_budget and self.step_cost.ready else None)
        scheduled_running, preempted = self._schedule_running(plan)
        scheduled_new: list[Request] = []
        scheduled_resumed: list[Request] = []
        if not preempted:
            # NOTE: after a preemption the cache is full; admitting more would only thrash.
            scheduled_new, scheduled_resumed = self._schedule_waiting(plan)
        output = self._make_output(
            scheduled_new, scheduled_resumed, scheduled_running, plan.num_scheduled_tokens,
            plan.new_block_ids, plan.scheduled_spec_decode_tokens, preempted,
        )
        for req_id, num_tokens in plan.num_scheduled_tokens.items():
            self.requests[req_id].num_computed_tokens += num_tokens
        self._add_grammar_bitmask(output)
        self.num_computed_tokens_total += output.total_num_scheduled_tokens
        self.last_step_shape = plan.shape
        return output

    def _add_grammar_bitmask(self, output: SchedulerOutput) -> None:
        """The allowed next tokens of the structured-output requests that sample in this step
        (those whose known tokens are all computed: not mid-prompt)."""
        if self.structured_output_manager is None:
            return
        sampling = [
            request for req_id in output.num_scheduled_tokens
            if (request := self.requests[req_id]).structured_output_request is not None
            and request.num_computed_tokens >= request.num_tokens
        ]
        if sampling:
            spec_tokens = output.scheduled_spec_decode_tokens
            # k + 1 rows for a request verifying k drafts.
            first_rows = accumulate((1 + len(spec_tokens.get(r.request_id, ())) for r in sampling[:-1]), initial=0)
            output.structured_output_request_ids = {
                r.request_id: row for r, row in zip(sampling, first_rows, strict=True)}
            output.grammar_bitmask = self.structured_output_manager.grammar_bitmask(sampling, spec_tokens)

    def wait_for_grammars(self, timeout: float) -> None:
        """Block until a waiting request's grammar is compiled, at most `timeout` seconds (none
        compiling: return at once). For a step that scheduled nothing, which is one where every
        unfinished request waits for its grammar: an engine that steps again at once starves the
        compile threads of the GIL."""
        futures = [so_request.future for request in self.waiting
                   if request.status == RequestStatus.WAITING_FOR_FSM
                   and (so_request := request.structured_output_request) is not None
                   and so_request.future is not None]
        if futures:
            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def observe_step_time(self, seconds: float) -> None:
        """The measured time of the step last scheduled: the cost model and the budget learn
        from it. A step that ran nothing (its time spent waiting for grammars) held up no stream
        and is not a step time."""
        if self.last_step_shape.num_tokens == 0:
            return
        predicted = self.step_cost.observe(self.last_step_shape, seconds)
        self.step_seconds.observe(seconds)
        if self.step_budget is not None:
            self.step_budget.observe(seconds, predicted)
            if seconds > self.step_budget.max_step_s:
                self.num_steps_over_budget += 1

    def _schedule_running(self, plan: _StepPlan) -> tuple[list[Request], list[Request]]:
        """Give each running request its next chunk (or decode token and draft tokens),
        preempting on OOM. Decodes go first: a stream never waits a step behind a prompt that
        is still being prefilled; prefill chunks share what is left of the budget."""
        scheduled: list[Request] = []
        preempted: list[Request] = []
        # Stable: admission order within the decodes and within the prefills.
        for request in sorted(self.running, key=lambda r: _is_prefill(r, r.num_computed_tokens)):
            if plan.token_budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            num_new_tokens = min(
                request.num_tokens_with_spec - request.num_computed_tokens,
                plan.token_budget,
                # NOTE: draft tokens never take a request past max_model_len (known tokens
                # never do), so one request never needs more blocks than the cache holds.
                self.max_model_len - request.num_computed_tokens,
            )
            num_new_tokens = self._cap_chunk(num_new_tokens)  # for a decode: fewer drafts
            if _is_prefill(request, request.num_computed_tokens):
                num_new_tokens = self._size_chunk(plan, request, request.num_computed_tokens, num_new_tokens)
                if num_new_tokens == 0:
                    continue
            while (blocks := self._allocate_slots(request, num_new_tokens)) is None:
                victim = self._choose_victim()
                self.running.remove(victim)
                if victim.request_id in plan.num_scheduled_tokens:  # scheduled earlier in this step
                    scheduled.remove(victim)
                    plan.take_back(victim)
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if blocks is None:
                # It preempted itself; the requests after it may fit in the blocks it left.
                continue
            scheduled.append(request)
            if request.spec_token_ids:
                self._schedule_spec_tokens(request, num_new_tokens, plan.scheduled_spec_decode_tokens)
            plan.add(request, request.num_computed_tokens, num_new_tokens, blocks)
        return scheduled, preempted

    def _allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: KVCacheBlocks | None = None,
                        num_computed: int | None = None) -> tuple[list[int], ...] | None:
        """Slots for the step's tokens, and, for a request that samples in this step, the
        drafter's lookahead slots (within max_model_len)."""
        num_computed = request.num_computed_tokens if num_computed is None else num_computed
        num_lookahead = 0
        if self.num_lookahead_tokens and num_computed + num_new_tokens >= request.num_tokens:
            num_lookahead = min(self.num_lookahead_tokens, self.max_model_len - num_computed - num_new_tokens)
        return self.kv_cache_manager.allocate_slots(request, num_new_tokens, computed_blocks, num_lookahead)

    def _size_chunk(self, plan: _StepPlan, request: Request, num_computed: int, num_new_tokens: int) -> int:
        """A prefill chunk's tokens (0: none this step), from at most `num_new_tokens` (already
        within the budget and long_prefill_token_threshold): what the step-time budget leaves room
        for, by the cost model (a step with no prefill yet still takes MIN_PREFILL_CHUNK tokens,
        so prompts advance even when decodes alone fill the budget); and a chunk that leaves its
        prompt unfinished only while fewer than max_num_partial_prefills have."""
        if plan.time_allowance_s is not None:
            fits = self._largest_chunk_within(plan.time_allowance_s, plan.shape, num_computed, num_new_tokens)
            floor = min(num_new_tokens, MIN_PREFILL_CHUNK) if plan.num_prefill_tokens == 0 else 0
            num_new_tokens = max(fits, floor)
        if (_leaves_prompt_unfinished(request, num_computed, num_new_tokens)
                and plan.num_partial >= self.max_num_partial_prefills):
            return 0
        return num_new_tokens

    def _cap_chunk(self, num_new_tokens: int) -> int:
        """vLLM's long_prefill_token_threshold: no request takes more tokens in a step (0: off)."""
        if 0 < self.long_prefill_token_threshold < num_new_tokens:
            return self.long_prefill_token_threshold
        return num_new_tokens

    def _largest_chunk_within(self, seconds: float, shape: StepShape, num_computed: int, num_new_tokens: int) -> int:
        """Binary search on the predicted step time, which grows with the chunk."""
        lo, hi = 0, num_new_tokens
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.step_cost.predict(shape.with_chunk(num_computed, mid)) <= seconds:
                lo = mid
            else:
                hi = mid - 1
        return lo

    @staticmethod
    def _schedule_spec_tokens(
        request: Request, num_new_tokens: int, scheduled_spec_decode_tokens: dict[str, list[int]]
    ) -> None:
        """Hand the worker the draft tokens that fit in this step's tokens (those after the
        request's known ones). The request keeps none: the proposer drafts anew after each step.
        """
        num_spec_tokens = request.num_computed_tokens + num_new_tokens - request.num_tokens
        spec_token_ids, request.spec_token_ids = request.spec_token_ids, []
        if num_spec_tokens > 0:
            scheduled_spec_decode_tokens[request.request_id] = spec_token_ids[:num_spec_tokens]

    def _schedule_waiting(self, plan: _StepPlan) -> tuple[list[Request], list[Request]]:
        """Admit waiting requests in the policy's order while budget, seats and blocks allow
        (each first chunk sized as a running prefill's)."""
        scheduled_new: list[Request] = []
        scheduled_resumed: list[Request] = []
        compiling: list[Request] = []  # grammars not ready: they keep their place in the queue
        while self.waiting and plan.token_budget > 0 and len(self.running) < self.max_num_running_reqs:
            request = self.waiting.peek_request()
            if request.status == RequestStatus.WAITING_FOR_FSM:
                so_request = request.structured_output_request
                assert so_request is not None
                if not so_request.check_ready():
                    compiling.append(self.waiting.pop_request())
                    continue
                if so_request.error is not None:
                    self.waiting.pop_request()
                    self._fail(request, f"Structured output grammar failed to compile: {so_request.error}")
                    continue
                request.status = RequestStatus.WAITING
            # Prefix cache: new and preempted requests start from what is already computed.
            computed_blocks, num_computed = self.kv_cache_manager.get_computed_blocks(request)
            num_new_tokens = request.num_tokens - num_computed
            if not self.enable_chunked_prefill and num_new_tokens > plan.token_budget:
                break
            num_new_tokens = self._size_chunk(plan, request, num_computed,
                                              self._cap_chunk(min(num_new_tokens, plan.token_budget)))
            if num_new_tokens == 0:
                break
            blocks = self._allocate_slots(request, num_new_tokens, computed_blocks, num_computed)
            if blocks is None:
                break
            self.waiting.pop_request()
            self.running.append(request)
            if request.status == RequestStatus.PREEMPTED:
                scheduled_resumed.append(request)
            else:
                scheduled_new.append(request)
                request.num_cached_tokens = num_computed
            self.kv_cache_manager.record_admission(request, num_computed)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            plan.add(request, num_computed, num_new_tokens, blocks)
        for request in reversed(compiling):
            self.waiting.prepend_request(request)
        return scheduled_new, scheduled_resumed

    def _fail(self, request: Request, error: str) -> None:
        """Finish one request with an error (the engine goes on): aborted, the error as its stop
        reason, reported with the next outputs."""
        logger.warning("Request %s: %s", request.request_id, error)
        request.status = RequestStatus.FINISHED_ABORTED
        request.stop_reason = error
        self._failed.append(request)
        self._free_request(request)

    def _choose_victim(self) -> Request:
        """The running request to preempt when blocks run out."""
        if self.policy == SchedulingPolicy.PRIORITY:
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        """Preempt by recompute: drop the KV (and the drafts), restart from token 0 (or its
        prefix cache hit) when readmitted."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend_request(request)

    def _make_output(
        self,
        scheduled_new: list[Request],
        scheduled_resumed: list[Request],
        scheduled_running: list[Request],
        num_scheduled_tokens: dict[str, int],
        new_block_ids: dict[str, tuple[list[int], ...]],
        scheduled_spec_decode_tokens: dict[str, list[int]],
        preempted: list[Request],
    ) -> SchedulerOutput:
        get_block_ids = self.kv_cache_manager.get_block_ids
        new_reqs = [
            NewRequestData.from_request(req, get_block_ids(req.request_id)) for req in scheduled_new
        ]
        cached = CachedRequestData()
        for req in scheduled_running:
            cached.req_ids.append(req.request_id)
            cached.resumed_from_preemption.append(False)
            cached.new_block_ids.append(new_block_ids[req.request_id])
            cached.num_computed_tokens.append(req.num_computed_tokens)
        for req in scheduled_resumed:
            cached.req_ids.append(req.request_id)
            cached.resumed_from_preemption.append(True)
            cached.new_block_ids.append(get_block_ids(req.request_id))
            cached.num_computed_tokens.append(req.num_computed_tokens)
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=sum(num_scheduled_tokens.values()),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={req.request_id for req in preempted},
            scheduled_spec_decode_tokens=scheduled_spec_decode_tokens,
        )
        self.finished_req_ids = set()
        return output

    # ---- update ---------------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop conditions, free finished requests."""
        if model_runner_output.failed:
            failed = [self.requests[r] for r in model_runner_output.failed if r in self.requests]
            self.running = [r for r in self.running if r.request_id not in model_runner_output.failed]
            for request in failed:
                self._fail(request, model_runner_output.failed[request.request_id])
        outputs = [
            EngineCoreOutput(request_id=r.request_id, new_token_ids=[], finish_reason=r.get_finished_reason(),
                             stop_reason=r.stop_reason)
            for r in self._failed
        ]
        self._failed = []
        stopped: dict[str, None] = {}  # NOTE: ordered, so blocks are freed in batch order
        logprobs = model_runner_output.logprobs
        prompt_logprobs = model_runner_output.prompt_logprobs
        spec_decode_tokens = scheduler_output.scheduled_spec_decode_tokens
        draft_token_ids = model_runner_output.draft_token_ids
        row = 0
        for i, (req_id, sampled_token_ids) in enumerate(zip(
            model_runner_output.req_ids, model_runner_output.sampled_token_ids, strict=True
        )):
            first_row, row = row, row + len(sampled_token_ids)
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue  # finished or aborted while the step ran
            if req_id in spec_decode_tokens:
                self._take_back_rejected_tokens(
                    request, len(spec_decode_tokens[req_id]), len(sampled_token_ids)
                )
            if self.spec_decoding_stats is not None and sampled_token_ids:
                # NOTE: the worker keeps the same rule (ModelRunner._update_states).
                self.kv_cache_manager.trim(request)
            new_prompt_logprobs = prompt_logprobs.get(req_id)
            if not sampled_token_ids and new_prompt_logprobs is None:
                continue
            new_token_ids = self._append_output_tokens(request, sampled_token_ids)
            if request.is_finished():
                stopped[req_id] = None
            elif draft_token_ids and draft_token_ids[i]:
                self._update_draft_token_ids(request, draft_token_ids[i])
            outputs.append(
                EngineCoreOutput(
                    request_id=req_id,
                    new_token_ids=new_token_ids,
                    new_logprobs=self._slice_logprobs(
                        request, logprobs, first_row, first_row + len(new_token_ids)
                    ),
                    new_prompt_logprobs=new_prompt_logprobs,
                    finish_reason=request.get_finished_reason(),
                    stop_reason=request.stop_reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                )
            )
        if stopped:
            self.running = [r for r in self.running if r.request_id not in stopped]
            for req_id in stopped:
                self._free_request(self.requests[req_id])
        return outputs

    def _take_back_rejected_tokens(
        self, request: Request, num_draft_tokens: int, num_sampled_tokens: int
    ) -> None:
        """A request that verified k draft tokens and got m tokens back accepted m - 1 of them:
        the k + 1 - m tokens computed after the last accepted one are not part of it. The next
        step writes the KV of the right tokens over their slots."""
        num_accepted = num_sampled_tokens - 1
        request.num_computed_tokens -= num_draft_tokens - num_accepted
        if self.spec_decoding_stats is not None:
            self.spec_decoding_stats.observe_draft(num_draft_tokens, num_accepted)

    def _update_draft_token_ids(self, request: Request, draft_token_ids: list[int]) -> None:
        """Keep the drafts the next step can use: no more than max_tokens and max_model_len
        leave room for (a step emits its accepted drafts and one more token), and for a
        structured-output request only those its grammar accepts."""
        room = min(request.max_tokens - request.num_output_tokens, self.max_model_len - request.num_tokens) - 1
        drafts = draft_token_ids[: max(room, 0)]
        so_request = request.structured_output_request
        if drafts and so_request is not None:
            drafts = so_request.grammar.validate_tokens(drafts)  # type: ignore[union-attr]
        request.spec_token_ids = drafts

    def _append_output_tokens(self, request: Request, token_ids: list[int]) -> list[int]:
        """Append the tokens one at a time until one stops the request; the tokens appended."""
        so_request = request.structured_output_request
        for i, token_id in enumerate(token_ids):
            request.append_output_token_ids([token_id])
            if so_request is not None and not so_request.grammar.accept_tokens([token_id]):  # type: ignore[union-attr]
                # The mask allowed only what the grammar accepts: this is a backend fault.
                logger.error("Request %s: the grammar rejected token %d it allowed.", request.request_id, token_id)
                request.status = RequestStatus.FINISHED_ABORTED
                request.stop_reason = "structured output grammar rejected a sampled token"
                return token_ids[: i + 1]
            if self._check_stop(request):
                return token_ids[: i + 1]
        return token_ids

    def _check_stop(self, request: Request) -> bool:
        """Whether the request's last token ends it (and with which status and stop reason). A
        structured-output request also ends when its grammar has accepted its stop token (with
        ignore_eos, or a stop token of the vocabulary that is not EOS), whatever min_tokens asks:
        nothing can follow."""
        if request.num_tokens >= self.max_model_len or request.num_output_tokens >= request.max_tokens:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        params = request.sampling_params
        so_request = request.structured_output_request
        complete = so_request is not None and so_request.grammar.is_terminated()  # type: ignore[union-attr]
        if request.num_output_tokens < params.min_tokens and not complete:
            return False
        last_token_id = request.output_token_ids[-1]
        is_stop_token = last_token_id in params.get_stop_token_ids(request.eos_token_id)
        if not (is_stop_token or complete):
            return False
        request.status = RequestStatus.FINISHED_STOPPED
        # NOTE: EOS is reported as no stop reason (vLLM's convention), a stop token as itself.
        is_eos = last_token_id == request.eos_token_id and not params.ignore_eos
        request.stop_reason = last_token_id if is_stop_token and not is_eos else None
        return True

    @staticmethod
    def _slice_logprobs(
        request: Request, logprobs: LogprobsArrays | None, start: int, end: int
    ) -> LogprobsArrays | None:
        num_logprobs = request.sampling_params.logprobs
        if logprobs is None or num_logprobs is None or start == end:
            return None
        return logprobs.slice_rows(start, end, num_logprobs + 1)

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
