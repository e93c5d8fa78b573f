"""Helpers for the pure-Python tests of minivllm.core: builders, a fake worker, invariants.

Nothing here imports torch: the fake worker mimics what minivllm/worker/model_runner.py does
with a SchedulerOutput (apply the diff, compute the scheduled tokens, sample one token for
every request whose computed tokens reach its known tokens) without a model.

Sampled tokens are deterministic: by default the k-th output token (0-based) of any request
is ``FIRST_SAMPLED_TOKEN_ID + k``, which is never EOS_TOKEN_ID. Tests that need EOS or stop
tokens pass a ``token_fn(req_id, output_index) -> token_id``.

The fake worker also simulates the KV cache contents: every slot it "computes" holds a key of
the token's whole prefix (position and all tokens up to it), and every scheduled request must
read back the right keys for all its tokens. So a prefix cache hit on a block with other
content, a block handed out while still in use, or a wrong block table is caught by content,
not only by bookkeeping.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from minivllm.config import CacheConfig, SchedulerConfig
from minivllm.core.kv_cache_manager import cdiv
from minivllm.core.outputs import EngineCoreOutput, ModelRunnerOutput
from minivllm.core.request import FinishReason, Request, RequestStatus
from minivllm.core.sched.output import SchedulerOutput
from minivllm.core.sched.scheduler import Scheduler
from minivllm.sampling_params import SamplingParams

EOS_TOKEN_ID = 2
FIRST_SAMPLED_TOKEN_ID = 1000

TokenFn = Callable[[str, int], int]


def default_token_fn(req_id: str, output_index: int) -> int:
    return FIRST_SAMPLED_TOKEN_ID + output_index


# ---- builders ---------------------------------------------------------------------------------


def create_scheduler(
    num_blocks: int | None = None,
    block_size: int = 16,
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 16,
    max_model_len: int = 128,
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = False,
    prefix_caching_hash_algo: str = "sha256",
) -> Scheduler:
    """A Scheduler over `num_blocks` KV blocks (block 0 included: the null block).

    By default the cache holds max_num_seqs requests of max_model_len tokens (no preemption).
    Prefix caching is off by default (unlike CacheConfig): the scenario tests assume no hits.
    """
    if num_blocks is None:
        num_blocks = max_num_seqs * cdiv(max_model_len, block_size) + 1
    scheduler_config = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        enable_chunked_prefill=enable_chunked_prefill,
    )
    cache_config = CacheConfig(
        block_size=block_size,
        num_gpu_blocks=num_blocks,
        enable_prefix_caching=enable_prefix_caching,
        prefix_caching_hash_algo=prefix_caching_hash_algo,
    )
    return Scheduler(scheduler_config, cache_config)


def create_requests(
    num_requests: int,
    prompt_len: int | Sequence[int] = 16,
    max_tokens: int | None | Sequence[int | None] = 16,
    *,
    ignore_eos: bool = False,
    stop_token_ids: list[int] | None = None,
    logprobs: int | None = None,
    eos_token_id: int | None = EOS_TOKEN_ID,
    id_prefix: str = "",
    start_index: int = 0,
    prompts: Sequence[Sequence[int]] | None = None,
    prompt_logprobs: int | None = None,
    cache_salt: str | None = None,
) -> list[Request]:
    """`num_requests` requests with ids f"{id_prefix}{i}"; per-request lengths may be lists.

    `prompts` gives the prompt token ids explicitly (prompt_len is then ignored); by default
    the prompts of different indices differ from their first token on (no shared prefix).
    """
    if prompts is not None:
        assert len(prompts) == num_requests
        prompt_len = [len(p) for p in prompts]
    lengths = [prompt_len] * num_requests if isinstance(prompt_len, int) else list(prompt_len)
    if max_tokens is None or isinstance(max_tokens, int):
        max_tokens_list: list[int | None] = [max_tokens] * num_requests
    else:
        max_tokens_list = list(max_tokens)
    assert len(lengths) == num_requests and len(max_tokens_list) == num_requests
    requests = []
    for i, (length, n_out) in enumerate(zip(lengths, max_tokens_list, strict=True)):
        index = start_index + i
        params = SamplingParams(
            temperature=0.0,
            max_tokens=n_out,
            ignore_eos=ignore_eos,
            stop_token_ids=list(stop_token_ids) if stop_token_ids else None,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )
        # Prompt tokens are never EOS or stop tokens (they could not matter, but keep it clean).
        if prompts is not None:
            prompt = list(prompts[i])
        else:
            prompt = [100 + (index * 31 + j) % 800 for j in range(length)]
        requests.append(
            Request(
                request_id=f"{id_prefix}{index}",
                prompt_token_ids=prompt,
                sampling_params=params,
                eos_token_id=eos_token_id,
                arrival_time=float(index),
                cache_salt=cache_salt,
            )
        )
    return requests


# ---- fake model runner --------------------------------------------------------------------------


def fake_model_runner_output(
    scheduler_output: SchedulerOutput, scheduler: Scheduler, token_fn: TokenFn | None = None
) -> ModelRunnerOutput:
    """Stateless fake worker: call it right after scheduler.schedule().

    schedule() has already advanced num_computed_tokens, so a request samples one token when
    num_computed_tokens >= num_tokens (its last known token was computed), else gets [].
    """
    token_fn = token_fn or default_token_fn
    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled: list[list[int]] = []
    for req_id in req_ids:
        request = scheduler.requests.get(req_id)
        if request is None:  # aborted after schedule(): the real worker still ran it
            sampled.append([token_fn(req_id, 0)])
        elif request.num_computed_tokens >= request.num_tokens:
            sampled.append([token_fn(req_id, request.num_output_tokens)])
        else:
            sampled.append([])
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


@dataclass
class _WorkerReqState:
    num_prompt_tokens: int
    num_tokens: int
    num_computed_tokens: int
    block_ids: list[int]
    # The request's tokens as the worker knows them (prompt + what it sampled), and for each
    # position the key of the KV a real model would compute there (it depends on the prefix).
    token_ids: list[int] = field(default_factory=list)
    prefix_keys: list[int] = field(default_factory=list)

    def extend_keys(self) -> None:
        keys, tokens = self.prefix_keys, self.token_ids
        for pos in range(len(keys), len(tokens)):
            keys.append(hash((keys[-1] if keys else None, pos, tokens[pos])))


class FakeWorker:
    """Stateful fake worker: applies each SchedulerOutput diff like GPUModelRunner does and
    asserts that the diff is consistent with its own bookkeeping and with the scheduler's.

    It tracks its own token counts (prompt length from NewRequestData plus the tokens it
    sampled), so a scheduler that forgets tokens, sends a wrong num_computed_tokens or a wrong
    block table after a preemption is caught here.

    It also keeps the simulated KV contents of every block (`self.kv`): each step it first
    writes the scheduled tokens of all requests (like the attention layers, which write the
    whole batch's KV before any attention reads it), then checks that every scheduled request
    finds the right KV for all its tokens [0, num_computed_tokens + scheduled) in its block
    table. With prefix caching off a new or resumed request must start at token 0; with it on,
    at a block boundary before its last known token, with exactly its cached blocks in front.
    """

    def __init__(self, token_fn: TokenFn | None = None) -> None:
        self.token_fn = token_fn or default_token_fn
        self.states: dict[str, _WorkerReqState] = {}
        self.kv: dict[int, list[int | None]] = {}
        self.num_cache_hit_tokens = 0  # tokens skipped thanks to prefix cache hits (new + resumed)

    def _check_start(
        self, req_id: str, num_computed: int, num_known: int, scheduler: Scheduler
    ) -> None:
        """What a new or resumed request may start at (before this step's tokens)."""
        kv = scheduler.kv_cache_manager
        if not kv.enable_caching:
            assert num_computed == 0, f"{req_id}: no prefix caching, must start at 0"
            return
        bs = kv.block_size
        request = scheduler.requests[req_id]
        assert num_computed % bs == 0, (req_id, num_computed)
        assert 0 <= num_computed < num_known, (req_id, num_computed, num_known)
        num_hit_blocks = num_computed // bs
        if request.sampling_params.prompt_logprobs is not None:
            assert num_computed == 0, f"{req_id} wants prompt logprobs: no cache hit allowed"
        pool = kv.block_pool
        blocks = kv.req_to_blocks[req_id]
        hashes = request.block_hashes
        assert len(blocks) >= num_hit_blocks and len(hashes) >= num_hit_blocks
        for i in range(num_hit_blocks):
            # The skipped blocks are cached blocks holding exactly this request's prefix.
            assert blocks[i].block_hash == hashes[i], (req_id, i, blocks[i])
            assert pool.get_cached_block(hashes[i]) is blocks[i], (req_id, i)
        # The hit is the longest one: the next block of the prefix was not cached elsewhere
        # (it may be cached now, as this request's own freshly allocated block).
        max_hit_blocks = (num_known - 1) // bs
        if request.sampling_params.prompt_logprobs is None and num_hit_blocks < max_hit_blocks:
            if len(hashes) > num_hit_blocks:
                cached = pool.get_cached_block(hashes[num_hit_blocks])
                assert cached is None or cached is blocks[num_hit_blocks], (
                    f"{req_id}: started at {num_computed} although block {num_hit_blocks} "
                    f"was cached as {cached}"
                )
        self.num_cache_hit_tokens += num_computed

    def execute_model(self, so: SchedulerOutput, scheduler: Scheduler) -> ModelRunnerOutput:
        kv = scheduler.kv_cache_manager
        block_size = kv.block_size
        scheduled = so.num_scheduled_tokens

        assert so.total_num_scheduled_tokens == sum(scheduled.values())
        assert all(n > 0 for n in scheduled.values()), scheduled
        for req_id in so.finished_req_ids:
            assert req_id not in scheduled, f"{req_id} both finished and scheduled"
            assert req_id not in scheduler.requests, f"finished {req_id} still in the scheduler"
            self.states.pop(req_id, None)
        for req_id in so.preempted_req_ids:
            assert req_id not in scheduled, f"{req_id} both preempted and scheduled"
            assert req_id in self.states, f"preempted {req_id} was never sent to the worker"

        new_ids = [r.req_id for r in so.scheduled_new_reqs]
        cached = so.scheduled_cached_reqs
        assert (
            len(cached.req_ids)
            == len(cached.resumed_from_preemption)
            == len(cached.new_block_ids)
            == len(cached.num_computed_tokens)
        )
        all_ids = new_ids + list(cached.req_ids)
        assert len(all_ids) == len(set(all_ids)), f"request sent twice: {all_ids}"
        assert set(all_ids) == set(scheduled), (all_ids, scheduled)

        for new_req in so.scheduled_new_reqs:
            assert new_req.req_id not in self.states, f"{new_req.req_id} sent as new twice"
            num_prompt = len(new_req.prompt_token_ids)
            self._check_start(new_req.req_id, new_req.num_computed_tokens, num_prompt, scheduler)
            self.states[new_req.req_id] = _WorkerReqState(
                num_prompt_tokens=num_prompt,
                num_tokens=num_prompt,
                num_computed_tokens=new_req.num_computed_tokens,
                block_ids=list(new_req.block_ids),
                token_ids=list(new_req.prompt_token_ids),
            )
        for req_id, resumed, new_block_ids, num_computed in zip(
            cached.req_ids,
            cached.resumed_from_preemption,
            cached.new_block_ids,
            cached.num_computed_tokens,
            strict=True,
        ):
            assert req_id in self.states, f"cached {req_id} unknown to the worker"
            state = self.states[req_id]
            if resumed:
                # Preemption is by recompute: the KV is gone except what the prefix cache kept.
                self._check_start(req_id, num_computed, state.num_tokens, scheduler)
                state.block_ids = list(new_block_ids)
            else:
                assert num_computed == state.num_computed_tokens, (
                    req_id,
                    num_computed,
                    state.num_computed_tokens,
                )
                state.block_ids.extend(new_block_ids)
            state.num_computed_tokens = num_computed

        req_ids = list(scheduled)
        # Pass 1: bookkeeping checks, then write this step's KV of the whole batch.
        for req_id in req_ids:
            state = self.states[req_id]
            request = scheduler.requests[req_id]
            assert state.num_tokens == request.num_tokens, (req_id, state, request.num_tokens)
            assert state.token_ids == request.all_token_ids, req_id
            assert state.block_ids == kv.get_block_ids(req_id), (
                req_id,
                state.block_ids,
                kv.get_block_ids(req_id),
            )
            assert 0 not in state.block_ids, f"{req_id} holds the null block"
            end = state.num_computed_tokens + scheduled[req_id]
            assert end <= state.num_tokens, f"{req_id} scheduled past its known tokens"
            assert end == request.num_computed_tokens
            assert len(state.block_ids) * block_size >= end, "no slot for a scheduled token"
            state.extend_keys()
            for pos in range(state.num_computed_tokens, end):
                block_id = state.block_ids[pos // block_size]
                slots = self.kv.setdefault(block_id, [None] * block_size)
                slots[pos % block_size] = state.prefix_keys[pos]
        # Pass 2: attention reads the KV of every token of each scheduled request.
        for req_id in req_ids:
            state = self.states[req_id]
            end = state.num_computed_tokens + scheduled[req_id]
            for i, block_id in enumerate(state.block_ids[: -(-end // block_size)]):
                start = i * block_size
                n = min(block_size, end - start)
                got = self.kv.get(block_id, [None] * block_size)[:n]
                assert got == state.prefix_keys[start : start + n], (
                    f"{req_id}: block {block_id} (tokens {start}..{start + n - 1}) holds the "
                    "KV of other tokens"
                )
        # Pass 3: sample one token for every request whose known tokens are all computed.
        sampled: list[list[int]] = []
        for req_id in req_ids:
            state = self.states[req_id]
            end = state.num_computed_tokens + scheduled[req_id]
            state.num_computed_tokens = end
            if end == state.num_tokens:
                token = self.token_fn(req_id, state.num_tokens - state.num_prompt_tokens)
                state.num_tokens += 1
                state.token_ids.append(token)
                sampled.append([token])
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


# ---- invariants -------------------------------------------------------------------------------


def check_block_invariants(scheduler: Scheduler) -> None:
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    null_block = pool.null_block
    assert null_block.block_id == 0 and null_block.ref_cnt == 1
    assert null_block.block_hash is None
    free_ids = pool.free_block_queue.block_ids()
    assert len(free_ids) == pool.get_num_free_blocks() == len(set(free_ids))
    held_count: dict[int, int] = {}
    for blocks in kv.req_to_blocks.values():
        assert len({b.block_id for b in blocks}) == len(blocks), "a block twice in one table"
        for block in blocks:
            held_count[block.block_id] = held_count.get(block.block_id, 0) + 1
    free_set = set(free_ids)
    assert 0 not in free_set and 0 not in held_count, "null block handed out"
    assert not free_set & held_count.keys(), f"free and held: {free_set & held_count.keys()}"
    assert len(free_set) + len(held_count) + 1 == pool.num_blocks, "blocks leaked"
    for block in pool.blocks:
        assert block.ref_cnt >= 0, block
        if block.block_id in free_set:
            assert block.ref_cnt == 0, block
        elif block.block_id in held_count:
            # Shared prefix blocks: one reference per request holding them.
            assert block.ref_cnt == held_count[block.block_id], (block, held_count[block.block_id])
            if not kv.enable_caching:
                assert block.ref_cnt == 1, block
    assert pool.get_usage() == 1.0 - len(free_ids) / (pool.num_blocks - 1)
    # The prefix cache map and the blocks' hashes agree, both ways.
    cache = pool.cached_block_hash_to_block
    for block_hash, block in cache.items():
        assert block.block_hash == block_hash, (block, block_hash)
    hashed = [b for b in pool.blocks if b.block_hash is not None]
    assert len(hashed) == len(cache), "a block has a hash but is not in the cache map"
    for block in hashed:
        assert cache.get(block.block_hash) is block, block
    if not kv.enable_caching:
        assert not cache, "blocks cached although prefix caching is off"


def check_request_invariants(scheduler: Scheduler) -> None:
    kv = scheduler.kv_cache_manager
    running_ids = [r.request_id for r in scheduler.running]
    waiting_ids = [r.request_id for r in scheduler.waiting]
    assert len(running_ids) <= scheduler.max_num_running_reqs
    assert len(set(running_ids + waiting_ids)) == len(running_ids) + len(waiting_ids)
    assert set(running_ids + waiting_ids) == set(scheduler.requests)
    assert set(kv.req_to_blocks) <= set(scheduler.requests), "blocks of a gone request"
    for request in scheduler.running:
        assert request.status == RequestStatus.RUNNING, request.request_id
    for request in scheduler.waiting:
        assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert request.num_computed_tokens == 0
        assert not kv.req_to_blocks.get(request.request_id)
    for req_id, request in scheduler.requests.items():
        assert request.request_id == req_id and not request.is_finished()
        assert 0 <= request.num_computed_tokens <= request.num_tokens
        assert request.num_tokens <= scheduler.max_model_len
        num_blocks = len(kv.req_to_blocks.get(req_id, ()))
        # Blocks are allocated exactly for the computed tokens (schedule() advances both).
        assert num_blocks == cdiv(request.num_computed_tokens, kv.block_size), (
            req_id,
            num_blocks,
            request.num_computed_tokens,
        )
        if kv.enable_caching and request.status == RequestStatus.RUNNING:
            # Only full blocks are cached, and only under their own hash.
            for i, block in enumerate(kv.req_to_blocks.get(req_id, ())):
                if block.block_hash is not None:
                    assert (i + 1) * kv.block_size <= request.num_computed_tokens, (req_id, i)
                    assert block.block_hash == request.block_hashes[i], (req_id, i)


def check_output_invariants(scheduler: Scheduler, so: SchedulerOutput) -> None:
    assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
    assert so.total_num_scheduled_tokens <= scheduler.max_num_scheduled_tokens
    assert len(so.num_scheduled_tokens) <= scheduler.max_num_running_reqs
    if not scheduler.enable_chunked_prefill:
        starts = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        starts.update(
            zip(
                so.scheduled_cached_reqs.req_ids,
                so.scheduled_cached_reqs.num_computed_tokens,
                strict=True,
            )
        )
        for req_id, n in so.num_scheduled_tokens.items():
            request = scheduler.requests[req_id]
            assert request.num_computed_tokens == request.num_tokens, "prompt was chunked"
            # A decode, or everything not computed yet (from 0, or from a prefix cache hit).
            assert n == 1 or n == request.num_tokens - starts[req_id], (req_id, n)
            if not scheduler.kv_cache_manager.enable_caching:
                assert n == 1 or n == request.num_tokens, (req_id, n)


def check_invariants(scheduler: Scheduler, so: SchedulerOutput | None = None) -> None:
    check_block_invariants(scheduler)
    check_request_invariants(scheduler)
    if so is not None:
        check_output_invariants(scheduler, so)


# ---- driving the loop ---------------------------------------------------------------------------


@dataclass
class RunResult:
    outputs: dict[str, list[int]] = field(default_factory=dict)
    finish_reasons: dict[str, FinishReason] = field(default_factory=dict)
    stop_reasons: dict[str, int | str | None] = field(default_factory=dict)
    scheduler_outputs: list[SchedulerOutput] = field(default_factory=list)
    # Every id announced in SchedulerOutput.finished_req_ids (the final flush included).
    finished_ids_sent: list[str] = field(default_factory=list)
    num_steps: int = 0


def step(
    scheduler: Scheduler, worker: FakeWorker, result: RunResult | None = None
) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    """One engine step with every invariant checked: schedule -> worker -> update."""
    so = scheduler.schedule()
    check_invariants(scheduler, so)
    if scheduler.has_unfinished_requests():
        assert so.total_num_scheduled_tokens > 0, "no progress although requests are unfinished"
    mro = worker.execute_model(so, scheduler)
    outs = scheduler.update_from_output(so, mro)
    check_invariants(scheduler)
    if result is not None:
        result.scheduler_outputs.append(so)
        result.finished_ids_sent.extend(so.finished_req_ids)
        result.num_steps += 1
        for out in outs:
            assert out.request_id not in result.finish_reasons, "output after finishing"
            assert out.new_token_ids
            result.outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                assert out.request_id not in scheduler.requests
                result.finish_reasons[out.request_id] = out.finish_reason
                result.stop_reasons[out.request_id] = out.stop_reason
            else:
                assert out.request_id in scheduler.requests
                assert out.stop_reason is None
    return so, outs


def run_to_completion(
    scheduler: Scheduler,
    max_steps: int = 10_000,
    token_fn: TokenFn | None = None,
    before_step: Callable[[int, Scheduler], None] | None = None,
    min_steps: int = 0,
    worker: FakeWorker | None = None,
) -> RunResult:
    """Step until no request is left (and at least `min_steps` steps were offered to
    `before_step`, which may add or abort requests), checking invariants after every step.

    Ends with one more schedule() that flushes the last finished ids to the worker, and checks
    that the engine is empty: no request, every block free, nothing left in the worker.
    """
    worker = worker or FakeWorker(token_fn)
    result = RunResult()
    for i in range(max_steps):
        if before_step is not None:
            before_step(i, scheduler)
        if not scheduler.has_unfinished_requests() and i >= min_steps:
            break
        step(scheduler, worker, result)
    else:
        raise AssertionError(f"not finished after {max_steps} steps")
    final = scheduler.schedule()
    check_invariants(scheduler, final)
    assert final.total_num_scheduled_tokens == 0
    worker.execute_model(final, scheduler)
    result.finished_ids_sent.extend(final.finished_req_ids)
    assert len(result.finished_ids_sent) == len(set(result.finished_ids_sent)), "finished twice"
    assert not worker.states, f"worker kept finished requests: {sorted(worker.states)}"
    assert_engine_empty(scheduler)
    return result


def assert_engine_empty(scheduler: Scheduler) -> None:
    kv = scheduler.kv_cache_manager
    assert not scheduler.requests and not scheduler.running and not scheduler.waiting
    assert not kv.req_to_blocks
    assert kv.get_num_free_blocks() == kv.block_pool.num_blocks - 1
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks[1:])
    assert kv.usage == 0.0
