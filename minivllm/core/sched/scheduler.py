"""Iteration-level scheduler: continuous batching with chunked prefill and preemption.

NOTE on the algorithm (vLLM V1's): there is no prefill phase and no decode phase. Each request
has `num_computed_tokens` and `num_tokens`; every step the scheduler hands out a budget of
`max_num_batched_tokens` so that computed tokens catch up with known tokens. A decode is a
request one token behind; a prefill chunk is a request many tokens behind, cut to the budget.
Running requests are served first, in admission order; waiting requests are admitted after,
in arrival order. When the KV cache runs out, the most recently admitted running request is
preempted: its blocks are freed and it goes back to the head of the queue, to be recomputed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from minivllm.core.kv_cache_manager import KVCacheManager, cdiv
from minivllm.core.outputs import EngineCoreOutput, LogprobsArrays, SchedulerStats
from minivllm.core.request import Request, RequestStatus
from minivllm.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

if TYPE_CHECKING:
    from minivllm.config import CacheConfig, SchedulerConfig
    from minivllm.core.outputs import ModelRunnerOutput


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig) -> None:
        num_blocks = cache_config.num_gpu_blocks
        if num_blocks is None:
            raise ValueError("cache_config.num_gpu_blocks must be set before building the Scheduler")
        self.max_num_running_reqs = scheduler_config.max_num_seqs
        self.max_num_scheduled_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        blocks_per_request = cdiv(self.max_model_len, cache_config.block_size)
        if blocks_per_request > num_blocks - 1:
            # NOTE: this guarantees progress: one request alone always fits, so preemption
            # can always make room for the oldest running request.
            raise ValueError(
                f"The KV cache ({num_blocks - 1} usable blocks of {cache_config.block_size} "
                f"tokens) cannot hold one request of max_model_len={self.max_model_len} tokens "
                f"({blocks_per_request} blocks). Increase the KV cache size or decrease max_model_len."
            )
        self.kv_cache_manager = KVCacheManager(
            num_blocks,
            cache_config.block_size,
            self.max_model_len,
            enable_caching=cache_config.enable_prefix_caching,
            hash_algo=cache_config.prefix_caching_hash_algo,
        )

        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Finished or aborted since the last schedule(): the worker must drop their state.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self.num_computed_tokens_total = 0

    # ---- request intake -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"Request id {request.request_id!r} is already in the engine.")
        self.waiting.append(request)
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
            self.waiting = deque(r for r in self.waiting if r.request_id not in waiting)

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
        )

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    # ---- schedule -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        token_budget = self.max_num_scheduled_tokens
        num_scheduled_tokens: dict[str, int] = {}
        new_block_ids: dict[str, list[int]] = {}
        scheduled_running, preempted = self._schedule_running(
            token_budget, num_scheduled_tokens, new_block_ids
        )
        token_budget -= sum(num_scheduled_tokens.values())
        scheduled_new: list[Request] = []
        scheduled_resumed: list[Request] = []
        if not preempted:
            # NOTE: after a preemption the cache is full; admitting more would only thrash.
            scheduled_new, scheduled_resumed = self._schedule_waiting(
                token_budget, num_scheduled_tokens, new_block_ids
            )
        output = self._make_output(
            scheduled_new, scheduled_resumed, scheduled_running, num_scheduled_tokens,
            new_block_ids, preempted,
        )
        for req_id, num_tokens in num_scheduled_tokens.items():
            self.requests[req_id].num_computed_tokens += num_tokens
        self.num_computed_tokens_total += output.total_num_scheduled_tokens
        return output

    def _schedule_running(
        self,
        token_budget: int,
        num_scheduled_tokens: dict[str, int],
        new_block_ids: dict[str, list[int]],
    ) -> tuple[list[Request], list[Request]]:
        """Give each running request its next chunk (or decode token), preempting on OOM."""
        scheduled: list[Request] = []
        preempted: list[Request] = []
        req_index = 0
        while req_index < len(self.running) and token_budget > 0:
            request = self.running[req_index]
            num_new_tokens = min(request.num_tokens - request.num_computed_tokens, token_budget)
            while (blocks := self.kv_cache_manager.allocate_slots(request, num_new_tokens)) is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if blocks is None:
                break
            scheduled.append(request)
            new_block_ids[request.request_id] = blocks
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            req_index += 1
        return scheduled, preempted

    def _schedule_waiting(
        self,
        token_budget: int,
        num_scheduled_tokens: dict[str, int],
        new_block_ids: dict[str, list[int]],
    ) -> tuple[list[Request], list[Request]]:
        """Admit waiting requests in arrival order while budget, seats and blocks allow."""
        scheduled_new: list[Request] = []
        scheduled_resumed: list[Request] = []
        while self.waiting and token_budget > 0 and len(self.running) < self.max_num_running_reqs:
            request = self.waiting[0]
            # Prefix cache: new and preempted requests start from what is already computed.
            computed_blocks, num_computed = self.kv_cache_manager.get_computed_blocks(request)
            num_new_tokens = request.num_tokens - num_computed
            if not self.enable_chunked_prefill and num_new_tokens > token_budget:
                break
            num_new_tokens = min(num_new_tokens, token_budget)
            blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens, computed_blocks)
            if blocks is None:
                break
            self.waiting.popleft()
            self.running.append(request)
            if request.status == RequestStatus.PREEMPTED:
                scheduled_resumed.append(request)
            else:
                scheduled_new.append(request)
                request.num_cached_tokens = num_computed
            self.kv_cache_manager.record_admission(request, num_computed)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            new_block_ids[request.request_id] = blocks
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
        return scheduled_new, scheduled_resumed

    def _preempt(self, request: Request) -> None:
        """Preempt by recompute: drop the KV, restart from token 0 when readmitted."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _make_output(
        self,
        scheduled_new: list[Request],
        scheduled_resumed: list[Request],
        scheduled_running: list[Request],
        num_scheduled_tokens: dict[str, int],
        new_block_ids: dict[str, list[int]],
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
        )
        self.finished_req_ids = set()
        return output

    # ---- update ---------------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop conditions, free finished requests."""
        outputs: list[EngineCoreOutput] = []
        stopped: dict[str, None] = {}  # NOTE: ordered, so blocks are freed in batch order
        logprobs = model_runner_output.logprobs
        prompt_logprobs = model_runner_output.prompt_logprobs
        row = 0
        for req_id, new_token_ids in zip(
            model_runner_output.req_ids, model_runner_output.sampled_token_ids, strict=True
        ):
            first_row, row = row, row + len(new_token_ids)
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            new_prompt_logprobs = prompt_logprobs.get(req_id)
            if not new_token_ids and new_prompt_logprobs is None:
                continue
            if new_token_ids:
                request.append_output_token_ids(new_token_ids)
                if self._check_stop(request):
                    stopped[req_id] = None
            outputs.append(
                EngineCoreOutput(
                    request_id=req_id,
                    new_token_ids=new_token_ids,
                    new_logprobs=self._slice_logprobs(request, logprobs, first_row, row),
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

    def _check_stop(self, request: Request) -> bool:
        if request.num_tokens >= self.max_model_len or request.num_output_tokens >= request.max_tokens:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        params = request.sampling_params
        if request.num_output_tokens < params.min_tokens:
            return False
        last_token_id = request.output_token_ids[-1]
        if not params.ignore_eos and last_token_id == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if params.stop_token_ids and last_token_id in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last_token_id
            return True
        return False

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
