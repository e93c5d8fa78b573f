"""Property tests of the Scheduler: random request mixes run to completion under small KV
caches (preemption), small budgets (chunked prefill), random max_num_seqs, EOS at random
steps, late arrivals and random aborts; with one or two KV cache groups, and with or without
draft tokens (the fake worker proposes some right and some wrong ones each step, verifies them
and takes the rejected ones back through update_from_output).

utils.run_to_completion checks after EVERY step: the token budget, the max_num_seqs cap, the
block accounting (free + held + null == total, nothing both free and held, ref counts equal
the number of holders and never negative, blocks held == cdiv(num_computed_tokens,
block_size), plus the slots of rejected drafts), the request state machine and the
consistency of the SchedulerOutput diff with a stateful fake worker, in every KV cache group.
At the end every request must be finished (or aborted) with exactly the expected tokens
(whatever the drafts were), and every block must be back in the free queue.

The same scenarios also run with prefix caching on, with prompts drawn to share prefixes (a
few random prefixes of 0-64 tokens plus random suffixes; some prompts identical; some
requests with a cache salt or prompt logprobs). Then the checks also cover shared blocks (ref
count == number of holders), the hash -> block map (consistent both ways), new and resumed
requests starting at their cache hit, and, through the fake worker's simulated KV contents,
that every hit block holds exactly the KV of the request's own prefix.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from core_utils import (
    EOS_TOKEN_ID,
    FIRST_SAMPLED_TOKEN_ID,
    FakeWorker,
    create_requests,
    create_scheduler,
    run_to_completion,
)
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from minivllm.core.request import FinishReason, RequestStatus
from minivllm.core.sched.scheduler import Scheduler
from minivllm.utils import cdiv

WRONG_DRAFT_TOKEN_ID = 7  # never sampled: neither EOS nor FIRST_SAMPLED_TOKEN_ID + k


@dataclass
class ReqSpec:
    prompt_len: int
    max_tokens: int
    eos_at: int | None  # output index at which the fake worker samples EOS
    ignore_eos: bool
    arrival_step: int
    # Prefix caching scenarios only: explicit prompt tokens, salt and prompt logprobs.
    prompt: list[int] | None = None
    cache_salt: str | None = None
    prompt_logprobs: int | None = None


@dataclass
class Scenario:
    block_size: int
    max_model_len: int
    num_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    enable_chunked_prefill: bool
    requests: list[ReqSpec]
    aborts: list[tuple[int, int]]  # (step, request index)
    enable_prefix_caching: bool = False
    hash_algo: str = "sha256"
    num_kv_cache_groups: int = 1
    num_spec_tokens: int = 0  # drafts the fake worker proposes per step (0: none)
    scheduling_policy: str = "fcfs"
    priorities: list[int] | None = None  # per request, under the priority policy
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int = 1
    max_step_ms: float | None = None
    # Each group's sliding window, None for full attention (len: num_kv_cache_groups).
    kv_cache_windows: tuple[int | None, ...] | None = None


def _token_run(seed: int, length: int) -> list[int]:
    """`length` pseudo-random prompt tokens (never EOS) determined by `seed`."""
    rng = random.Random(seed)
    return [rng.randrange(100, 900) for _ in range(length)]


def build_scenario(
    ints: Callable[[int, int], int], *, crowded: bool = False, prefix_caching: bool = False
) -> Scenario:
    """A random scenario from `ints(lo, hi)` (hypothesis draws or a random.Random).

    crowded: the smallest legal cache, at least 6 requests and 4 seats (preemption likely).
    prefix_caching: caching on, and prompts made of a few shared prefixes + random suffixes.
    """
    block_size = (2, 4, 8, 16, 32)[ints(0, 4)]
    max_model_len = ints(16, 256)
    blocks_per_req = cdiv(max_model_len, block_size)
    # A cache for 1-3 requests of max_model_len tokens, often the minimum: preemption is common.
    extra = 0 if crowded or ints(0, 1) else ints(0, 2 * blocks_per_req)
    enable_chunked_prefill = ints(0, 3) > 0
    if enable_chunked_prefill:
        budget = ints(8, 48) if ints(0, 1) else ints(49, 512)
    else:
        budget = ints(max_model_len, 2 * max_model_len)
    max_num_seqs = ints(4, 8) if crowded else ints(1, 8)
    num_requests = ints(6, 12) if crowded else ints(1, 12)
    late = ints(0, 1)
    prefixes: list[list[int]] = []
    hash_algo = "sha256"
    if prefix_caching:
        hash_algo = ("sha256", "builtin")[ints(0, 1)]
        prefixes = [_token_run(ints(0, 1 << 16), ints(0, 64)) for _ in range(ints(1, 3))]
    requests = []
    for _ in range(num_requests):
        prompt = cache_salt = prompt_logprobs = None
        if prefix_caching:
            if requests and ints(0, 3) == 0:  # the same prompt as an earlier request
                prompt = list(requests[ints(0, len(requests) - 1)].prompt)
            else:
                prefix = prefixes[ints(0, len(prefixes) - 1)]
                prompt = prefix + _token_run(ints(0, 1 << 16), ints(0, 48))
                prompt = prompt[:max_model_len] or [7]
            cache_salt = "salt" if ints(0, 7) == 0 else None
            prompt_logprobs = 1 if ints(0, 7) == 0 else None
            prompt_len = len(prompt)
        else:
            prompt_len = min(ints(1, 200), max_model_len)
        max_tokens = ints(1, 50)
        eos_at = ints(0, 60) if ints(0, 2) == 0 else None
        requests.append(
            ReqSpec(
                prompt_len=prompt_len,
                max_tokens=max_tokens,
                eos_at=eos_at,
                ignore_eos=ints(0, 3) == 0,
                arrival_step=ints(0, 20) if late else 0,
                prompt=prompt,
                cache_salt=cache_salt,
                prompt_logprobs=prompt_logprobs,
            )
        )
    aborts = [(ints(0, 40), ints(0, num_requests - 1)) for _ in range(ints(0, 2))]
    # Drawn last, so that the rest of a scenario does not depend on them.
    num_groups = ints(1, 2)
    scenario = Scenario(
        block_size,
        max_model_len,
        num_groups * (blocks_per_req + extra) + 1,
        budget,
        max_num_seqs,
        enable_chunked_prefill,
        requests,
        aborts,
        prefix_caching,
        hash_algo,
        num_groups,
        num_spec_tokens=ints(0, 4) if ints(0, 1) else 0,
        scheduling_policy=("fcfs", "priority")[ints(0, 1)],
        priorities=[ints(-2, 2) for _ in range(num_requests)],
        long_prefill_token_threshold=ints(1, 64) if enable_chunked_prefill and ints(0, 1) else 0,
        max_num_partial_prefills=ints(1, 3),
        max_step_ms=ints(1, 30) if enable_chunked_prefill and ints(0, 1) else None,
    )
    # Sliding windows from one token to a few blocks, or full attention, per group; the cache
    # then as crowded as before, counted in the blocks a request can hold in each group.
    windows = tuple(ints(1, 3 * block_size) if ints(0, 1) else None for _ in range(num_groups))
    scenario.kv_cache_windows = windows
    scenario.num_blocks = 1 + sum(
        min(blocks_per_req, cdiv(w - 1 + budget, block_size) + 1) if w else blocks_per_req for w in windows
    ) + num_groups * extra
    return scenario


def expected_num_tokens(spec: ReqSpec, max_model_len: int) -> tuple[int, set[FinishReason]]:
    """Exact output length, and the acceptable finish reasons."""
    length_cap = min(spec.max_tokens, max(1, max_model_len - spec.prompt_len))
    if spec.eos_at is not None and not spec.ignore_eos and spec.eos_at + 1 <= length_cap:
        if spec.eos_at + 1 < length_cap:
            return spec.eos_at + 1, {FinishReason.STOP}
        # EOS on the last allowed token: either reason is defensible.
        return length_cap, {FinishReason.STOP, FinishReason.LENGTH}
    return length_cap, {FinishReason.LENGTH}


@dataclass
class ScenarioRun:
    scheduler: Scheduler
    worker: FakeWorker
    num_evictions: int  # cached hashes that disappeared from the map between two steps
    num_resumed_with_hit: int  # preempted requests resumed at a prefix cache hit


def run_scenario(sc: Scenario) -> ScenarioRun:
    scheduler = create_scheduler(
        num_blocks=sc.num_blocks,
        block_size=sc.block_size,
        max_num_batched_tokens=sc.max_num_batched_tokens,
        max_num_seqs=sc.max_num_seqs,
        max_model_len=sc.max_model_len,
        enable_chunked_prefill=sc.enable_chunked_prefill,
        enable_prefix_caching=sc.enable_prefix_caching,
        prefix_caching_hash_algo=sc.hash_algo,
        num_kv_cache_groups=sc.num_kv_cache_groups,
        kv_cache_windows=sc.kv_cache_windows,
        scheduling_policy=sc.scheduling_policy,
        long_prefill_token_threshold=sc.long_prefill_token_threshold,
        max_num_partial_prefills=sc.max_num_partial_prefills,
        max_step_ms=sc.max_step_ms,
    )
    specs = {str(i): spec for i, spec in enumerate(sc.requests)}
    requests = {}
    for i, spec in enumerate(sc.requests):
        (req,) = create_requests(
            1,
            prompt_len=spec.prompt_len,
            max_tokens=spec.max_tokens,
            ignore_eos=spec.ignore_eos,
            start_index=i,
            prompts=None if spec.prompt is None else [spec.prompt],
            cache_salt=spec.cache_salt,
            prompt_logprobs=spec.prompt_logprobs,
            priority=sc.priorities[i] if sc.scheduling_policy == "priority" else 0,
        )
        requests[req.request_id] = req

    def token_fn(req_id: str, index: int) -> int:
        return EOS_TOKEN_ID if index == specs[req_id].eos_at else FIRST_SAMPLED_TOKEN_ID + index

    def draft_fn(req_id: str, num_output_tokens: int) -> list[int]:
        """num_spec_tokens drafts, of which the first 0..num_spec_tokens are right."""
        num_right = (int(req_id) * 7 + num_output_tokens * 3) % (sc.num_spec_tokens + 1)
        right = [token_fn(req_id, num_output_tokens + i) for i in range(num_right)]
        return right + [WRONG_DRAFT_TOKEN_ID] * (sc.num_spec_tokens - num_right)

    aborted: set[str] = set()
    cache = scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block
    seen_hashes: set[bytes | int] = set()
    num_evictions = 0

    def before_step(i: int, sched: Scheduler) -> None:
        nonlocal seen_hashes, num_evictions
        num_evictions += len(seen_hashes - cache.keys())
        seen_hashes = set(cache)
        for req_id, spec in specs.items():
            if spec.arrival_step == i:
                sched.add_request(requests[req_id])
        for abort_step, index in sc.aborts:
            req_id = str(index)
            if abort_step == i and req_id in sched.requests:
                aborted.add(req_id)
                sched.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)

    last_event = max([s.arrival_step for s in sc.requests] + [s for s, _ in sc.aborts])
    worker = FakeWorker(token_fn, draft_fn if sc.num_spec_tokens else None)
    result = run_to_completion(
        scheduler,
        max_steps=20_000,
        before_step=before_step,
        min_steps=last_event + 1,
        worker=worker,
    )

    for req_id, req in requests.items():
        n, reasons = expected_num_tokens(specs[req_id], sc.max_model_len)
        expected_tokens = [token_fn(req_id, i) for i in range(n)]
        got = result.outputs.get(req_id, [])
        assert req.output_token_ids == got
        assert req.is_finished(), f"request {req_id} lost: {req.status!r}"
        if req_id in aborted:
            assert req.status == RequestStatus.FINISHED_ABORTED
            assert req_id not in result.finish_reasons
            assert got == expected_tokens[: len(got)] and len(got) < n
        else:
            assert got == expected_tokens, (req_id, specs[req_id], len(got), n)
            assert result.finish_reasons[req_id] in reasons
            assert req.get_finished_reason() == result.finish_reasons[req_id]
            assert result.stop_reasons[req_id] is None
    assert sum(r.num_preemptions for r in requests.values()) == scheduler.num_preemptions
    # Every request is announced to the worker as finished exactly once.
    assert sorted(result.finished_ids_sent) == sorted(requests)

    # Prefix cache accounting: one lookup per admission (new or resumed), and the hits are
    # exactly the tokens the worker was told were already computed.
    resumed_at = [
        n
        for so in result.scheduler_outputs
        for res, n in zip(
            so.scheduled_cached_reqs.resumed_from_preemption,
            so.scheduled_cached_reqs.num_computed_tokens,
            strict=True,
        )
        if res
    ]
    # A preempted request resumes exactly once, unless it is aborted while it waits.
    if aborted:
        assert len(resumed_at) <= scheduler.num_preemptions
    else:
        assert len(resumed_at) == scheduler.num_preemptions
    stats = scheduler.make_stats()
    if sc.enable_prefix_caching:
        # Requests that want prompt logprobs skip the lookup; whether they are counted is not
        # pinned here (see test_prefix_caching.py).
        admitted = [r.req_id for so in result.scheduler_outputs for r in so.scheduled_new_reqs]
        admitted += [
            req_id
            for so in result.scheduler_outputs
            for req_id, res in zip(
                so.scheduled_cached_reqs.req_ids,
                so.scheduled_cached_reqs.resumed_from_preemption,
                strict=True,
            )
            if res
        ]
        looked_up = [r for r in admitted if specs[r].prompt_logprobs is None]
        assert len(looked_up) <= stats.prefix_cache_requests <= len(admitted)
        assert stats.prefix_cache_hits == worker.num_cache_hit_tokens
        assert stats.prefix_cache_hits <= stats.prefix_cache_queries
        assert (
            sum(max(r.num_cached_tokens, 0) for r in requests.values()) <= stats.prefix_cache_hits
        )
        assert scheduler.reset_prefix_cache() is True
        assert not cache and all(
            b.block_hash is None for b in scheduler.kv_cache_manager.block_pool.blocks
        )
    else:
        assert (stats.prefix_cache_requests, stats.prefix_cache_hits) == (0, 0)
        assert worker.num_cache_hit_tokens == 0 and not cache
    return ScenarioRun(scheduler, worker, num_evictions, sum(n > 0 for n in resumed_at))


@st.composite
def scenarios(draw, prefix_caching: bool = False) -> Scenario:
    return build_scenario(lambda lo, hi: draw(st.integers(lo, hi)), prefix_caching=prefix_caching)


def _events(sc: Scenario, run: ScenarioRun) -> None:
    event("preempted" if run.scheduler.num_preemptions else "no preemption")
    if any(s.prompt_len > sc.max_num_batched_tokens for s in sc.requests):
        event("chunked prompt")
    if not sc.enable_chunked_prefill:
        event("chunked prefill disabled")
    if sc.aborts:
        event("abort planned")
    if any(
        s.eos_at is not None and not s.ignore_eos and s.eos_at < s.max_tokens for s in sc.requests
    ):
        event("EOS stop")
    event(f"{sc.num_kv_cache_groups} KV cache group(s)")
    if any(sc.kv_cache_windows or ()):
        event("sliding window group")
    if run.worker.num_draft_tokens:
        event("drafts accepted" if run.worker.num_accepted_tokens else "drafts all rejected")
    if sc.enable_prefix_caching:
        hits = run.scheduler.make_stats().prefix_cache_hits
        event("prefix cache hit" if hits else "no prefix cache hit")
        if run.num_evictions:
            event("cached block evicted")
        if run.num_resumed_with_hit:
            event("resumed at a cache hit")


_SETTINGS = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@_SETTINGS
@given(scenarios())
def test_random_mixes_run_to_completion(sc: Scenario):
    _events(sc, run_scenario(sc))


@_SETTINGS
@given(scenarios(prefix_caching=True))
def test_random_mixes_with_prefix_caching_run_to_completion(sc: Scenario):
    _events(sc, run_scenario(sc))


def test_preemption_is_exercised_by_the_scenarios():
    """The random scenarios do reach preemption (deterministic seeds, crowded caches), and
    run to completion with the same end-to-end checks."""
    preempted = 0
    num_runs = 30
    for seed in range(num_runs):
        sc = build_scenario(random.Random(seed).randint, crowded=True)
        preempted += run_scenario(sc).scheduler.num_preemptions > 0
    assert preempted >= num_runs // 3, preempted  # 18 of 30 at the time of writing


def test_prefix_caching_scenarios_hit_evict_and_preempt():
    """Deterministic companion of the prefix caching property test: crowded caches with shared
    prefixes do produce cache hits, evictions of cached blocks, preemptions and resumptions
    at a cache hit, also with two KV cache groups, and drafts accepted and rejected, also
    around preemptions (all checked step by step as above)."""
    counts = dict.fromkeys(
        [
            "hit",
            "evicted",
            "preempted",
            "resumed at hit",
            "2 groups: preempted",
            "2 groups: resumed at hit",
            "drafts accepted",
            "drafts rejected",
            "drafts: preempted",
        ],
        0,
    )
    num_runs = 30
    for seed in range(num_runs):
        sc = build_scenario(random.Random(seed).randint, crowded=True, prefix_caching=True)
        run = run_scenario(sc)
        preempted = run.scheduler.num_preemptions > 0
        two_groups = sc.num_kv_cache_groups == 2
        counts["hit"] += run.scheduler.make_stats().prefix_cache_hits > 0
        counts["evicted"] += run.num_evictions > 0
        counts["preempted"] += preempted
        counts["resumed at hit"] += run.num_resumed_with_hit > 0
        counts["2 groups: preempted"] += two_groups and preempted
        counts["2 groups: resumed at hit"] += two_groups and run.num_resumed_with_hit > 0
        counts["drafts accepted"] += run.worker.num_accepted_tokens > 0
        counts["drafts rejected"] += run.worker.num_draft_tokens > run.worker.num_accepted_tokens
        counts["drafts: preempted"] += run.worker.num_draft_tokens > 0 and preempted
    # 29, 29, 23, 19, then 10, 10, 13, 12 and 11 of 30 at the time of writing.
    assert counts["hit"] >= num_runs * 3 // 4, counts
    assert counts["evicted"] >= num_runs // 2, counts
    assert counts["preempted"] >= num_runs // 2, counts
    assert counts["resumed at hit"] >= num_runs // 3, counts
    assert min(list(counts.values())[4:]) >= num_runs // 6, counts
