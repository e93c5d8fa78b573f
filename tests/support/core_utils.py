"""Helpers for the pure-Python tests of minivllm.core: builders, a fake worker, invariants.

Nothing here imports torch: the fake worker mimics what minivllm/worker/model_runner.py does
with a SchedulerOutput (apply the diff, compute the scheduled tokens, sample one token for
every request whose computed tokens reach its known tokens) without a model.

Sampled tokens are deterministic: by default the k-th output token (0-based) of any request
is ``FIRST_SAMPLED_TOKEN_ID + k``, which is never EOS_TOKEN_ID. Tests that need EOS or stop
tokens pass a ``token_fn(req_id, output_index) -> token_id``. With a ``draft_fn`` the fake
worker also proposes draft tokens after each sample and verifies them the next step like a
greedy rejection sampler: drafts are accepted while they equal the tokens token_fn would give,
then one more token comes, so the output never depends on the drafts.

The fake worker also simulates the KV cache contents: every slot it "computes" holds a key of
the token's whole prefix (position and all tokens up to it) and of its KV cache group, and
every scheduled request must read back the right keys for all its tokens (in a sliding-window
group: for the tokens its window reaches). All groups write into one memory indexed by block id.
So a prefix cache hit on a block with other content (or another group's), a block handed out
while still in use, or a wrong block table is caught by content, not only by bookkeeping.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from minivllm.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from minivllm.core.block_pool import KVCacheBlock
from minivllm.core.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.outputs import EngineCoreOutput, ModelRunnerOutput
from minivllm.core.request import FinishReason, Request, RequestStatus
from minivllm.core.sched.output import SchedulerOutput
from minivllm.core.sched.scheduler import Scheduler
from minivllm.core.sched.step_cost import StepShape
from minivllm.sampling_params import SamplingParams
from minivllm.utils import cdiv

EOS_TOKEN_ID = 2
FIRST_SAMPLED_TOKEN_ID = 1000

TokenFn = Callable[[str, int], int]
# (req_id, number of output tokens so far) -> the draft tokens to verify next.
DraftFn = Callable[[str, int], list[int]]


def default_token_fn(req_id: str, output_index: int) -> int:
    return FIRST_SAMPLED_TOKEN_ID + output_index


# ---- builders ---------------------------------------------------------------------------------


def make_kv_cache_config(
    num_blocks: int, block_size: int = 16, num_groups: int = 1,
    windows: Sequence[int | None] | None = None,
) -> KVCacheConfig:
    """A KVCacheConfig of KV cache groups of one layer each: `num_groups` full attention ones,
    or one per entry of `windows` (a sliding window, or None for full attention).

    Groups of one kind are built here by hand (get_kv_cache_config would put such layers into
    one group), to run the KV manager's multi-group paths in every combination of kinds.
    """
    windows = [None] * num_groups if windows is None else list(windows)
    specs: list[KVCacheSpec] = [
        FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype="float32") if window is None
        else SlidingWindowSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype="float32",
                               sliding_window=window)
        for window in windows
    ]
    layer_names = [f"model.layers.{i}.self_attn" for i in range(len(windows))]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=(KVCacheTensor(size=num_blocks * specs[0].page_size_bytes, shared_by=tuple(layer_names)),),
        kv_cache_groups=tuple(KVCacheGroupSpec((name,), spec) for name, spec in zip(layer_names, specs, strict=True)),
    )


def group_windows(kv: KVCacheManager) -> list[int | None]:
    """Each KV cache group's sliding window (None: full attention)."""
    return [getattr(m.kv_cache_spec, "sliding_window", None) for m in kv.coordinator.single_type_managers]


def first_in_window(num_computed: int, window: int | None, block_size: int) -> int:
    """The first block the token at `num_computed` reads (0 without a window)."""
    return 0 if window is None else max(0, num_computed - window + 1) // block_size


def create_kv_cache_manager(
    num_blocks: int,
    block_size: int = 16,
    max_model_len: int = 1024,
    num_groups: int = 1,
    enable_caching: bool = False,
    hash_algo: str = "sha256",
    windows: Sequence[int | None] | None = None,
) -> KVCacheManager:
    return KVCacheManager(
        make_kv_cache_config(num_blocks, block_size, num_groups, windows),
        max_model_len,
        enable_caching=enable_caching,
        hash_algo=hash_algo,
    )


def create_scheduler(
    num_blocks: int | None = None,
    block_size: int = 16,
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 16,
    max_model_len: int = 128,
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = False,
    prefix_caching_hash_algo: str = "sha256",
    num_kv_cache_groups: int = 1,
    scheduling_policy: str = "fcfs",
    long_prefill_token_threshold: int = 0,
    max_num_partial_prefills: int = 1,
    max_step_ms: float | None = None,
    speculative_config: SpeculativeConfig | None = None,
    kv_cache_windows: Sequence[int | None] | None = None,
) -> Scheduler:
    """A Scheduler over `num_blocks` KV blocks (block 0 included: the null block), shared by
    `num_kv_cache_groups` KV cache groups (or one per entry of `kv_cache_windows`, see
    make_kv_cache_config).

    By default the cache holds max_num_seqs requests of max_model_len tokens (no preemption).
    Prefix caching is off by default (unlike CacheConfig): the scenario tests assume no hits.
    """
    if kv_cache_windows is not None:
        num_kv_cache_groups = len(kv_cache_windows)
    if num_blocks is None:
        num_blocks = num_kv_cache_groups * max_num_seqs * cdiv(max_model_len, block_size) + 1
    scheduler_config = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        enable_chunked_prefill=enable_chunked_prefill,
        policy=scheduling_policy,
        long_prefill_token_threshold=long_prefill_token_threshold,
        max_num_partial_prefills=max_num_partial_prefills,
        max_step_ms=max_step_ms,
    )
    cache_config = CacheConfig(
        block_size=block_size,
        num_gpu_blocks=num_blocks,
        enable_prefix_caching=enable_prefix_caching,
        prefix_caching_hash_algo=prefix_caching_hash_algo,
    )
    kv_cache_config = make_kv_cache_config(num_blocks, block_size, num_kv_cache_groups, kv_cache_windows)
    return Scheduler(scheduler_config, cache_config, kv_cache_config, speculative_config=speculative_config)


def create_requests(
    num_requests: int,
    prompt_len: int | Sequence[int] = 16,
    max_tokens: int | None | Sequence[int | None] = 16,
    *,
    ignore_eos: bool = False,
    stop_token_ids: list[int] | None = None,
    min_tokens: int = 0,
    logprobs: int | None = None,
    eos_token_id: int | None = EOS_TOKEN_ID,
    id_prefix: str = "",
    start_index: int = 0,
    prompts: Sequence[Sequence[int]] | None = None,
    prompt_logprobs: int | None = None,
    cache_salt: str | None = None,
    priority: int | Sequence[int] = 0,
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
    priorities = [priority] * num_requests if isinstance(priority, int) else list(priority)
    assert len(lengths) == num_requests and len(max_tokens_list) == num_requests == len(priorities)
    requests = []
    for i, (length, n_out) in enumerate(zip(lengths, max_tokens_list, strict=True)):
        index = start_index + i
        params = SamplingParams(
            temperature=0.0,
            max_tokens=n_out,
            ignore_eos=ignore_eos,
            stop_token_ids=list(stop_token_ids) if stop_token_ids else None,
            min_tokens=min_tokens,
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
                priority=priorities[i],
            )
        )
    return requests


# ---- fake model runner --------------------------------------------------------------------------


@dataclass
class _WorkerReqState:
    num_prompt_tokens: int
    num_tokens: int
    num_computed_tokens: int
    block_ids: list[list[int]]  # per KV cache group
    # The request's tokens as the worker knows them (prompt + what it sampled), and for each
    # group and position the key of the KV a real model would compute there.
    token_ids: list[int] = field(default_factory=list)
    prefix_keys: list[list[KVKey]] = field(default_factory=list)
    # Tokens with a slot since the block table was (re)built: the computed ones and the
    # rejected drafts after them, whose blocks stay.
    num_slots_used: int = 0

    def keys_with(self, group_id: int, drafts: list[int]) -> list[KVKey]:
        """The keys of the known tokens and then of `drafts`, in one group."""
        keys = self.prefix_keys[group_id]
        keys.extend(_chain_keys(keys, self.token_ids[len(keys) :], group_id))
        return keys + _chain_keys(keys, drafts, group_id) if drafts else keys


KVKey = tuple[int, int]


def _chain_keys(prefix: list[KVKey], token_ids: list[int], group_id: int) -> list[KVKey]:
    """The KV keys of `token_ids` after `prefix`'s: each depends on its group, its position
    and every token up to it."""
    keys: list[KVKey] = []
    prev = prefix[-1] if prefix else None
    for pos, token_id in enumerate(token_ids, start=len(prefix)):
        prev = (group_id, hash((prev, pos, token_id)))
        keys.append(prev)
    return keys


class FakeWorker:
    """Stateful fake worker: applies each SchedulerOutput diff like GPUModelRunner does and
    asserts that the diff is consistent with its own bookkeeping and with the scheduler's.

    It tracks its own token counts (prompt length from NewRequestData plus the tokens it
    sampled, minus the drafts it rejected), so a scheduler that forgets tokens, sends a wrong
    num_computed_tokens or a wrong block table after a preemption is caught here.

    It also keeps the simulated KV contents of every block (`self.kv`): each step it first
    writes the scheduled tokens of all requests in every group (like the attention layers,
    which write the whole batch's KV before any attention reads it), then checks that every
    scheduled request finds the right KV for all its tokens [0, num_computed_tokens + scheduled)
    in each group's block table. With prefix caching off a new or resumed request must start at
    token 0; with it on, at a block boundary before its last known token, with exactly its
    cached blocks in front.
    """

    def __init__(self, token_fn: TokenFn | None = None, draft_fn: DraftFn | None = None) -> None:
        self.token_fn = token_fn or default_token_fn
        self.draft_fn = draft_fn
        self.states: dict[str, _WorkerReqState] = {}
        self.kv: dict[int, list[KVKey | None]] = {}
        self.num_cache_hit_tokens = 0  # tokens skipped thanks to prefix cache hits (new + resumed)
        # Drafts proposed in the last step, for the engine loop to hand to the scheduler.
        self.draft_token_ids: dict[str, list[int]] = {}
        self.num_draft_tokens = 0  # drafts verified, and accepted, over the run
        self.num_accepted_tokens = 0
        self.max_num_draft_tokens = 0  # the most drafts proposed at once

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
        hashes = request.block_hashes
        assert len(hashes) >= num_hit_blocks
        next_block_cached_elsewhere = []
        for group_id, (blocks, window) in enumerate(zip(held_blocks(kv, req_id), group_windows(kv), strict=True)):
            assert len(blocks) >= num_hit_blocks
            first = first_in_window(num_computed, window, bs)
            # Before the window the hit may leave the null block (nothing to read there).
            assert all(b is pool.null_block or b.block_hash == (hashes[i], group_id) for i, b in enumerate(blocks[:first]))
            for i in range(first, num_hit_blocks):
                # The skipped blocks are cached blocks holding exactly this request's prefix.
                assert blocks[i].block_hash == (hashes[i], group_id), (req_id, i, blocks[i])
                assert pool.get_cached_block(hashes[i], group_id) is blocks[i], (req_id, i)
            if len(hashes) > num_hit_blocks:
                cached = pool.get_cached_block(hashes[num_hit_blocks], group_id)
                next_block_cached_elsewhere.append(
                    cached is not None and cached is not blocks[num_hit_blocks]
                )
        # The hit is the longest one: the next block of the prefix was not cached elsewhere in
        # every group (it may be cached now, as this request's own freshly allocated block).
        max_hit_blocks = (num_known - 1) // bs
        if request.sampling_params.prompt_logprobs is None and num_hit_blocks < max_hit_blocks:
            assert not (next_block_cached_elsewhere and all(next_block_cached_elsewhere)), (
                f"{req_id}: started at {num_computed} although block {num_hit_blocks} was "
                "cached in every group"
            )
        self.num_cache_hit_tokens += num_computed

    def _apply_diff(self, so: SchedulerOutput, scheduler: Scheduler) -> None:
        """Drop finished requests, add new ones, update cached ones, as the runner does."""
        scheduled = so.num_scheduled_tokens
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
                block_ids=[list(ids) for ids in new_req.block_ids],
                token_ids=list(new_req.prompt_token_ids),
                prefix_keys=[[] for _ in new_req.block_ids],
                num_slots_used=new_req.num_computed_tokens,
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
            assert len(new_block_ids) == len(state.block_ids), "one block list per group"
            if resumed:
                # Preemption is by recompute: the KV is gone except what the prefix cache kept.
                self._check_start(req_id, num_computed, state.num_tokens, scheduler)
                state.block_ids = [list(ids) for ids in new_block_ids]
                state.num_slots_used = num_computed
            else:
                assert num_computed == state.num_computed_tokens, (
                    req_id,
                    num_computed,
                    state.num_computed_tokens,
                )
                for ids, new_ids_of_group in zip(state.block_ids, new_block_ids, strict=True):
                    ids.extend(new_ids_of_group)
            state.num_computed_tokens = num_computed

    def execute_model(self, so: SchedulerOutput, scheduler: Scheduler) -> ModelRunnerOutput:
        kv = scheduler.kv_cache_manager
        block_size = kv.block_size
        scheduled = so.num_scheduled_tokens
        assert so.total_num_scheduled_tokens == sum(scheduled.values())
        assert all(n > 0 for n in scheduled.values()), scheduled
        self._apply_diff(so, scheduler)

        req_ids = list(scheduled)
        # Pass 1: bookkeeping checks, then write this step's KV of the whole batch.
        keys: dict[str, list[list[KVKey]]] = {}  # per group: known tokens + this step's drafts
        for req_id in req_ids:
            state = self.states[req_id]
            request = scheduler.requests[req_id]
            assert state.num_tokens == request.num_tokens, (req_id, state, request.num_tokens)
            assert state.token_ids == request.all_token_ids, req_id
            block_ids = [list(ids) for ids in kv.get_block_ids(req_id)]
            assert len(block_ids) == len(kv.coordinator.single_type_managers)
            for ids, kv_ids, window in zip(state.block_ids, block_ids, group_windows(kv), strict=True):
                # The worker's table keeps the ids of blocks a window gave back (never read
                # again): it must agree from the first block the step reads.
                first = first_in_window(state.num_computed_tokens, window, block_size)
                assert len(ids) == len(kv_ids) and ids[first:] == kv_ids[first:], (req_id, ids, kv_ids)
                assert 0 not in ids[first:], f"{req_id} reads the null block"
                assert all(b in (0, i) for b, i in zip(kv_ids[:first], ids, strict=False)), (req_id, ids, kv_ids)
            drafts = so.scheduled_spec_decode_tokens.get(req_id, [])
            keys[req_id] = [state.keys_with(g, drafts) for g in range(len(state.block_ids))]
            end = state.num_computed_tokens + scheduled[req_id]
            if drafts:
                assert end == state.num_tokens + len(drafts), (req_id, end, drafts)
            else:
                assert end <= state.num_tokens, f"{req_id} scheduled past its known tokens"
            assert end == request.num_computed_tokens
            state.num_slots_used = max(state.num_slots_used, end)
            for ids in state.block_ids:
                # Blocks are allocated exactly for the tokens given a slot.
                assert len(ids) == cdiv(state.num_slots_used, block_size), (req_id, ids)
            for ids, group_keys in zip(state.block_ids, keys[req_id], strict=True):
                for pos in range(state.num_computed_tokens, end):
                    slots = self.kv.setdefault(ids[pos // block_size], [None] * block_size)
                    slots[pos % block_size] = group_keys[pos]
        # Pass 2: attention reads the KV of every token of each scheduled request (a window's
        # from the first token its first scheduled token reads).
        for req_id in req_ids:
            state = self.states[req_id]
            end = state.num_computed_tokens + scheduled[req_id]
            for group_id, (ids, window) in enumerate(zip(state.block_ids, group_windows(kv), strict=True)):
                group_keys = keys[req_id][group_id]
                first_token = 0 if window is None else max(0, state.num_computed_tokens - window + 1)
                for i in range(first_token // block_size, cdiv(end, block_size)):
                    block_id = ids[i]
                    start = max(i * block_size, first_token)
                    n = min((i + 1) * block_size, end) - start
                    got = self.kv.get(block_id, [None] * block_size)[start % block_size :][:n]
                    assert got == group_keys[start : start + n], (
                        f"{req_id}: block {block_id} (group {group_id}, tokens {start}.."
                        f"{start + n - 1}) holds the KV of other tokens"
                    )
        # Pass 3: sample for every request whose known tokens are all computed: verify its
        # drafts, then one more token.
        sampled = [self._sample(req_id, so) for req_id in req_ids]
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)

    def _sample(self, req_id: str, so: SchedulerOutput) -> list[int]:
        state = self.states[req_id]
        drafts = so.scheduled_spec_decode_tokens.get(req_id, [])
        end = state.num_computed_tokens + so.num_scheduled_tokens[req_id]
        state.num_computed_tokens = end
        if end < state.num_tokens:
            return []
        num_output = state.num_tokens - state.num_prompt_tokens
        tokens = []
        for draft in [*drafts, None]:
            token = self.token_fn(req_id, num_output + len(tokens))
            tokens.append(token)
            if token != draft:
                break
        # The KV of the rejected drafts is not part of the sequence.
        state.num_computed_tokens -= len(drafts) + 1 - len(tokens)
        state.num_tokens += len(tokens)
        state.token_ids.extend(tokens)
        self.num_draft_tokens += len(drafts)
        self.num_accepted_tokens += len(tokens) - 1
        if self.draft_fn is not None:
            new_drafts = self.draft_fn(req_id, num_output + len(tokens))
            self.draft_token_ids[req_id] = new_drafts
            self.max_num_draft_tokens = max(self.max_num_draft_tokens, len(new_drafts))
        return tokens


def cached_requests(so: SchedulerOutput) -> dict[str, tuple[bool, tuple[list[int], ...], int]]:
    """The step's cached requests: id -> (resumed from preemption, new block ids per group,
    num_computed_tokens)."""
    c = so.scheduled_cached_reqs
    return {
        req_id: (resumed, block_ids, num_computed)
        for req_id, resumed, block_ids, num_computed in zip(
            c.req_ids, c.resumed_from_preemption, c.new_block_ids, c.num_computed_tokens, strict=True
        )
    }


def held_blocks(kv: KVCacheManager, req_id: str) -> list[list[KVCacheBlock]]:
    """The request's blocks in each KV cache group."""
    return [m.req_to_blocks.get(req_id, []) for m in kv.coordinator.single_type_managers]


# ---- invariants -------------------------------------------------------------------------------


def check_block_invariants(kv: KVCacheManager) -> None:
    pool = kv.block_pool
    null_block = pool.null_block
    assert null_block.block_id == 0 and null_block.ref_cnt == 1
    assert null_block.block_hash is None
    free_ids = pool.free_block_queue.block_ids()
    assert len(free_ids) == pool.get_num_free_blocks() == len(set(free_ids))
    held_count: Counter[int] = Counter()
    held_by_group: list[set[int]] = []  # the ids each group's requests hold
    for manager, window in zip(kv.coordinator.single_type_managers, group_windows(kv), strict=True):
        assert set(manager.num_cached_blocks) <= set(manager.req_to_blocks)
        group_held: set[int] = set()
        for blocks in manager.req_to_blocks.values():
            # A sliding window's table starts with null blocks where it gave blocks back.
            ids = [b.block_id for b in blocks if b is not null_block]
            num_null = len(blocks) - len(ids)
            assert num_null == 0 or (window is not None and all(b is null_block for b in blocks[:num_null])), (
                "a null block in a table, other than before a sliding window")
            assert len(set(ids)) == len(ids), "a block twice in one table"
            held_count.update(ids)
            group_held.update(ids)
        for other in held_by_group:
            assert not group_held & other, f"blocks held by two groups: {group_held & other}"
        held_by_group.append(group_held)
    free_set = set(free_ids)
    assert 0 not in free_set and 0 not in held_count, "null block handed out"
    assert not free_set & held_count.keys(), f"free and held: {free_set & held_count.keys()}"
    assert len(free_set) + len(held_count) + 1 == pool.num_blocks, "blocks leaked"
    ref_cnts = [block.ref_cnt for block in pool.blocks]
    assert min(ref_cnts) >= 0, ref_cnts
    in_use = [i for i in free_set if ref_cnts[i]]
    assert not in_use, f"free blocks in use: {in_use}"
    # Shared prefix blocks: one reference per request holding them.
    miscounted = {i: n for i, n in held_count.items() if ref_cnts[i] != n}
    assert not miscounted, f"ref counts != holders: {miscounted}"
    if not kv.enable_caching:
        assert set(held_count.values()) <= {1}, "a block shared although prefix caching is off"
    assert pool.get_usage() == 1.0 - len(free_ids) / (pool.num_blocks - 1)
    # The prefix cache map and the blocks' hashes agree, both ways.
    cache = pool.cached_block_hash_to_block
    for key, block in cache.items():
        assert block.block_hash == key, (block, key)
        # A cached block in use is used by the group it was cached for.
        assert block.ref_cnt == 0 or block.block_id in held_by_group[key[1]], (block, key)
    hashed = [b for b in pool.blocks if b.block_hash is not None]
    assert len(hashed) == len(cache), "a block has a hash but is not in the cache map"
    for block in hashed:
        assert cache.get(block.block_hash) is block, block
    if not kv.enable_caching:
        assert not cache, "blocks cached although prefix caching is off"


def check_request_invariants(scheduler: Scheduler, max_num_spec_tokens: int = 0) -> None:
    """`max_num_spec_tokens`: the most drafts a request gets per step; the slots of rejected
    drafts stay with a request, so it may hold up to that many slots past its computed tokens.
    """
    kv = scheduler.kv_cache_manager
    running_ids = [r.request_id for r in scheduler.running]
    waiting_ids = [r.request_id for r in scheduler.waiting]
    assert len(running_ids) <= scheduler.max_num_running_reqs
    assert len(set(running_ids + waiting_ids)) == len(running_ids) + len(waiting_ids)
    assert set(running_ids + waiting_ids) == set(scheduler.requests)
    for manager in kv.coordinator.single_type_managers:
        assert set(manager.req_to_blocks) <= set(scheduler.requests), "blocks of a gone request"
    for request in scheduler.running:
        assert request.status == RequestStatus.RUNNING, request.request_id
    for request in scheduler.waiting:
        assert request.status in (RequestStatus.WAITING, RequestStatus.WAITING_FOR_FSM, RequestStatus.PREEMPTED)
        assert request.num_computed_tokens == 0
        assert not any(held_blocks(kv, request.request_id))
    for req_id, request in scheduler.requests.items():
        assert request.request_id == req_id and not request.is_finished()
        # Computed tokens may run ahead of the known ones by the drafts handed to the worker.
        assert 0 <= request.num_computed_tokens <= request.num_tokens + max_num_spec_tokens
        assert request.num_tokens <= scheduler.max_model_len
        for group_id, (blocks, window) in enumerate(zip(held_blocks(kv, req_id), group_windows(kv), strict=True)):
            # Blocks are allocated exactly for the computed tokens (schedule() advances both),
            # plus the slots of rejected drafts.
            num_computed = request.num_computed_tokens
            assert (
                cdiv(num_computed, kv.block_size)
                <= len(blocks)
                <= cdiv(num_computed + max_num_spec_tokens, kv.block_size)
            ), (req_id, group_id, len(blocks), num_computed)
            # Every block the next token's window reads is still held.
            first = first_in_window(num_computed, window, kv.block_size)
            assert kv.block_pool.null_block not in blocks[first:], (req_id, group_id, first)
            if kv.enable_caching and request.status == RequestStatus.RUNNING:
                # Only full blocks are cached, and only under their own hash.
                for i, block in enumerate(blocks):
                    if block.block_hash is not None:
                        assert (i + 1) * kv.block_size <= request.num_computed_tokens, (req_id, i)
                        assert block.block_hash == (request.block_hashes[i], group_id), (req_id, i)


def check_output_invariants(scheduler: Scheduler, so: SchedulerOutput) -> None:
    assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
    assert so.total_num_scheduled_tokens <= scheduler.max_num_scheduled_tokens
    assert len(so.num_scheduled_tokens) <= scheduler.max_num_running_reqs
    assert so.scheduled_spec_decode_tokens.keys() <= so.num_scheduled_tokens.keys()
    if scheduler.long_prefill_token_threshold:
        assert max(so.num_scheduled_tokens.values(), default=0) <= scheduler.long_prefill_token_threshold
    for req_id in so.num_scheduled_tokens:
        # Drafts are the last tokens of the request's scheduled ones, after its known tokens.
        request = scheduler.requests[req_id]
        drafts = so.scheduled_spec_decode_tokens.get(req_id)
        if drafts is None:
            assert request.num_computed_tokens <= request.num_tokens, req_id
            continue
        assert drafts and len(drafts) < so.num_scheduled_tokens[req_id], (req_id, drafts)
        assert request.num_computed_tokens == request.num_tokens + len(drafts), req_id
        assert request.num_computed_tokens <= scheduler.max_model_len, req_id
        assert not request.spec_token_ids, f"{req_id} kept drafts it handed to the worker"
    if not scheduler.enable_chunked_prefill:
        starts = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        starts.update(
            zip(
                so.scheduled_cached_reqs.req_ids,
                so.scheduled_cached_reqs.num_computed_tokens,
                strict=True,
            )
        )
        for req_id, num_scheduled in so.num_scheduled_tokens.items():
            request = scheduler.requests[req_id]
            num_drafts = len(so.scheduled_spec_decode_tokens.get(req_id, ()))
            n = num_scheduled - num_drafts
            assert request.num_computed_tokens - num_drafts == request.num_tokens, (
                "prompt was chunked"
            )
            # A decode, or everything not computed yet (from 0, or from a prefix cache hit).
            assert n == 1 or n == request.num_tokens - starts[req_id], (req_id, n)
            if not scheduler.kv_cache_manager.enable_caching:
                assert n == 1 or n == request.num_tokens, (req_id, n)


def check_invariants(
    scheduler: Scheduler, so: SchedulerOutput | None = None, max_num_spec_tokens: int = 0
) -> None:
    check_block_invariants(scheduler.kv_cache_manager)
    check_request_invariants(scheduler, max_num_spec_tokens)
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


def fake_step_seconds(shape: StepShape) -> float:
    """A fake clock for the step cost model: 1 ms a step, 0.1 ms a token, 1 ns an attention pair."""
    return 1e-3 + 1e-4 * shape.num_tokens + 1e-9 * shape.num_attention_pairs


def step(
    scheduler: Scheduler, worker: FakeWorker, result: RunResult | None = None,
    step_seconds: Callable[[StepShape], float] = fake_step_seconds,
) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    """One engine step with every invariant checked: schedule -> worker -> update (the step
    timed by `step_seconds`), then the worker's drafts go to the requests still running (what
    EngineCore will do)."""
    decoding = [r.request_id for r in scheduler.running if r.num_tokens - r.num_computed_tokens <= 1]
    so = scheduler.schedule()
    check_invariants(scheduler, so, worker.max_num_draft_tokens)
    # Decodes go first: no prefill chunk of a running request while a decode waits.
    prefill_chunks = [i for i in so.scheduled_cached_reqs.req_ids if i not in decoding]
    if prefill_chunks:
        assert all(i in so.num_scheduled_tokens or i in so.preempted_req_ids for i in decoding), (decoding, so)
    if scheduler.has_unfinished_requests():
        assert so.total_num_scheduled_tokens > 0, "no progress although requests are unfinished"
    mro = worker.execute_model(so, scheduler)
    outs = scheduler.update_from_output(so, mro)
    scheduler.observe_step_time(step_seconds(scheduler.last_step_shape))
    for req_id, drafts in worker.draft_token_ids.items():
        request = scheduler.requests.get(req_id)
        if request is not None and request.status == RequestStatus.RUNNING:
            request.spec_token_ids = drafts
    worker.draft_token_ids = {}
    check_invariants(scheduler, max_num_spec_tokens=worker.max_num_draft_tokens)
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
    check_invariants(scheduler, final, worker.max_num_draft_tokens)
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
    for manager in kv.coordinator.single_type_managers:
        assert not manager.req_to_blocks and not manager.num_cached_blocks
    assert kv.get_num_free_blocks() == kv.block_pool.num_blocks - 1
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks[1:])
    assert kv.usage == 0.0
