"""Property tests of the Scheduler: random request mixes run to completion under small KV
caches (preemption), small budgets (chunked prefill), random max_num_seqs, EOS at random
steps, late arrivals and random aborts.

utils.run_to_completion checks after EVERY step: the token budget, the max_num_seqs cap, the
block accounting (free + held + null == total, nothing both free and held, ref counts equal
the number of holders and never negative, blocks held == cdiv(num_computed_tokens,
block_size)), the request state machine and the consistency of the SchedulerOutput diff with a
stateful fake worker. At the end every request must be finished (or aborted) with exactly the
expected tokens, and every block must be back in the free queue.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from core_utils import (
    EOS_TOKEN_ID,
    FIRST_SAMPLED_TOKEN_ID,
    create_requests,
    create_scheduler,
    run_to_completion,
)
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from minivllm.core.kv_cache_manager import cdiv
from minivllm.core.request import FinishReason, RequestStatus
from minivllm.core.sched.scheduler import Scheduler


@dataclass
class ReqSpec:
    prompt_len: int
    max_tokens: int
    eos_at: int | None  # output index at which the fake worker samples EOS
    ignore_eos: bool
    arrival_step: int


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


def build_scenario(ints: Callable[[int, int], int], *, crowded: bool = False) -> Scenario:
    """A random scenario from `ints(lo, hi)` (hypothesis draws or a random.Random).

    crowded: the smallest legal cache, at least 6 requests and 4 seats (preemption likely).
    """
    block_size = (2, 4, 8, 16, 32)[ints(0, 4)]
    max_model_len = ints(16, 256)
    blocks_per_req = cdiv(max_model_len, block_size)
    # A cache for 1-3 requests of max_model_len tokens, often the minimum: preemption is common.
    extra = 0 if crowded or ints(0, 1) else ints(0, 2 * blocks_per_req)
    num_blocks = blocks_per_req + 1 + extra
    enable_chunked_prefill = ints(0, 3) > 0
    if enable_chunked_prefill:
        budget = ints(8, 48) if ints(0, 1) else ints(49, 512)
    else:
        budget = ints(max_model_len, 2 * max_model_len)
    max_num_seqs = ints(4, 8) if crowded else ints(1, 8)
    num_requests = ints(6, 12) if crowded else ints(1, 12)
    late = ints(0, 1)
    requests = []
    for _ in range(num_requests):
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
            )
        )
    aborts = [(ints(0, 40), ints(0, num_requests - 1)) for _ in range(ints(0, 2))]
    return Scenario(
        block_size,
        max_model_len,
        num_blocks,
        budget,
        max_num_seqs,
        enable_chunked_prefill,
        requests,
        aborts,
    )


def expected_num_tokens(spec: ReqSpec, max_model_len: int) -> tuple[int, set[FinishReason]]:
    """Exact output length, and the acceptable finish reasons."""
    length_cap = min(spec.max_tokens, max(1, max_model_len - spec.prompt_len))
    if spec.eos_at is not None and not spec.ignore_eos and spec.eos_at + 1 <= length_cap:
        if spec.eos_at + 1 < length_cap:
            return spec.eos_at + 1, {FinishReason.STOP}
        # EOS on the last allowed token: either reason is defensible.
        return length_cap, {FinishReason.STOP, FinishReason.LENGTH}
    return length_cap, {FinishReason.LENGTH}


def run_scenario(sc: Scenario) -> Scheduler:
    scheduler = create_scheduler(
        num_blocks=sc.num_blocks,
        block_size=sc.block_size,
        max_num_batched_tokens=sc.max_num_batched_tokens,
        max_num_seqs=sc.max_num_seqs,
        max_model_len=sc.max_model_len,
        enable_chunked_prefill=sc.enable_chunked_prefill,
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
        )
        requests[req.request_id] = req

    def token_fn(req_id: str, index: int) -> int:
        return EOS_TOKEN_ID if index == specs[req_id].eos_at else FIRST_SAMPLED_TOKEN_ID + index

    aborted: set[str] = set()

    def before_step(i: int, sched: Scheduler) -> None:
        for req_id, spec in specs.items():
            if spec.arrival_step == i:
                sched.add_request(requests[req_id])
        for abort_step, index in sc.aborts:
            req_id = str(index)
            if abort_step == i and req_id in sched.requests:
                aborted.add(req_id)
                sched.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)

    last_event = max([s.arrival_step for s in sc.requests] + [s for s, _ in sc.aborts])
    result = run_to_completion(
        scheduler,
        max_steps=20_000,
        token_fn=token_fn,
        before_step=before_step,
        min_steps=last_event + 1,
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
    return scheduler


@st.composite
def scenarios(draw) -> Scenario:
    return build_scenario(lambda lo, hi: draw(st.integers(lo, hi)))


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(scenarios())
def test_random_mixes_run_to_completion(sc: Scenario):
    scheduler = run_scenario(sc)
    event("preempted" if scheduler.num_preemptions else "no preemption")
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


def test_preemption_is_exercised_by_the_scenarios():
    """The random scenarios do reach preemption (deterministic seeds, crowded caches), and
    run to completion with the same end-to-end checks."""
    preempted = 0
    num_runs = 30
    for seed in range(num_runs):
        sc = build_scenario(random.Random(seed).randint, crowded=True)
        preempted += run_scenario(sc).num_preemptions > 0
    assert preempted >= num_runs // 3, preempted  # 18 of 30 at the time of writing
