"""Scenario tests of the Scheduler (minivllm/core/sched/scheduler.py), hand-computed.

Every step goes through utils.step, which also checks the block/request invariants and the
consistency of the SchedulerOutput diff with a stateful fake worker. Block ids are
predictable: the free queue starts as [1, 2, ..., num_blocks - 1] and freed blocks join its
tail, tail block first.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from core_utils import (
    EOS_TOKEN_ID,
    FIRST_SAMPLED_TOKEN_ID,
    FakeWorker,
    cached_requests,
    check_invariants,
    create_requests,
    create_scheduler,
    run_to_completion,
    step,
)

from minivllm.core.outputs import LogprobsArrays, ModelRunnerOutput
from minivllm.core.request import FinishReason, RequestStatus
from minivllm.core.sched.scheduler import Scheduler

T0 = FIRST_SAMPLED_TOKEN_ID


def _add(scheduler: Scheduler, requests) -> None:
    for request in requests:
        scheduler.add_request(request)


def _free_ids(scheduler: Scheduler) -> list[int]:
    return scheduler.kv_cache_manager.block_pool.free_block_queue.block_ids()


# ---- basics -----------------------------------------------------------------------------------


def test_single_request_lifecycle():
    scheduler = create_scheduler(num_blocks=11, block_size=16)
    worker = FakeWorker()
    (req,) = create_requests(1, prompt_len=20, max_tokens=3)
    scheduler.add_request(req)
    assert scheduler.has_unfinished_requests() and scheduler.get_num_unfinished_requests() == 1

    so, outs = step(scheduler, worker)
    assert [r.req_id for r in so.scheduled_new_reqs] == ["0"]
    new = so.scheduled_new_reqs[0]
    assert new.block_ids == ([1, 2],) and new.num_computed_tokens == 0
    assert new.prompt_token_ids == req.prompt_token_ids
    assert so.num_scheduled_tokens == {"0": 20} and so.total_num_scheduled_tokens == 20
    assert so.scheduled_cached_reqs.req_ids == [] and so.finished_req_ids == set()
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outs] == [("0", [T0], None)]
    assert req.status == RequestStatus.RUNNING and req.num_computed_tokens == 20

    so, outs = step(scheduler, worker)
    assert so.scheduled_new_reqs == []
    assert cached_requests(so) == {"0": (False, ([],), 20)}
    assert so.num_scheduled_tokens == {"0": 1}
    assert [o.new_token_ids for o in outs] == [[T0 + 1]]

    so, outs = step(scheduler, worker)
    assert [(o.new_token_ids, o.finish_reason, o.stop_reason) for o in outs] == [
        ([T0 + 2], FinishReason.LENGTH, None)
    ]
    assert outs[0].finished
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert req.output_token_ids == [T0, T0 + 1, T0 + 2]
    assert not scheduler.has_unfinished_requests() and scheduler.requests == {}
    assert _free_ids(scheduler) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # emptied blocks at the head

    so, outs = step(scheduler, worker)  # the worker learns about the finish one step later
    assert so.finished_req_ids == {"0"} and so.total_num_scheduled_tokens == 0 and outs == []
    so, _ = step(scheduler, worker)
    assert so.finished_req_ids == set()


def test_duplicate_request_id_raises():
    scheduler = create_scheduler()
    (a,) = create_requests(1)
    (b,) = create_requests(1)  # same id "0"
    scheduler.add_request(a)
    with pytest.raises(ValueError):
        scheduler.add_request(b)
    step(scheduler, FakeWorker())  # a is running now: still a duplicate
    with pytest.raises(ValueError):
        scheduler.add_request(b)
    assert list(scheduler.requests) == ["0"] and scheduler.requests["0"] is a
    assert len(scheduler.waiting) == 0 and scheduler.running == [a]


def test_core_does_not_import_torch():
    code = (
        "import sys\n"
        "import minivllm.core.sched.scheduler, minivllm.core.kv_cache_manager\n"
        "import minivllm.core.kv_cache_coordinator, minivllm.core.single_type_kv_cache_manager\n"
        "import minivllm.core.kv_cache_utils, minivllm.core.kv_cache_interface\n"
        "import minivllm.core.block_pool, minivllm.core.request, minivllm.core.outputs\n"
        "import minivllm.core.sched.output, minivllm.config, minivllm.sampling_params\n"
        "heavy = sorted(m for m in ('torch', 'numpy', 'transformers') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


# ---- ordering and admission -------------------------------------------------------------------


def test_admission_in_arrival_order_with_chunking():
    scheduler = create_scheduler(max_num_batched_tokens=64)
    worker = FakeWorker()
    _add(scheduler, create_requests(4, prompt_len=[30, 5, 40, 8], max_tokens=4))

    so, outs = step(scheduler, worker)
    assert [r.req_id for r in so.scheduled_new_reqs] == ["0", "1", "2"]
    assert list(so.num_scheduled_tokens.items()) == [("0", 30), ("1", 5), ("2", 29)]
    assert [r.request_id for r in scheduler.waiting] == ["3"]
    assert [o.request_id for o in outs] == ["0", "1"]  # "2" is mid-prompt: no token

    so, outs = step(scheduler, worker)
    # Running first, in admission order, then the waiting one.
    assert list(so.num_scheduled_tokens.items()) == [("0", 1), ("1", 1), ("2", 11), ("3", 8)]
    assert so.scheduled_cached_reqs.req_ids == ["0", "1", "2"]
    assert [r.req_id for r in so.scheduled_new_reqs] == ["3"]
    assert [o.request_id for o in outs] == ["0", "1", "2", "3"]
    assert [r.request_id for r in scheduler.running] == ["0", "1", "2", "3"]


def test_running_requests_are_scheduled_before_waiting_ones():
    scheduler = create_scheduler(max_num_batched_tokens=8)
    worker = FakeWorker()
    _add(scheduler, create_requests(2, prompt_len=4, max_tokens=10))
    so, _ = step(scheduler, worker)
    assert so.num_scheduled_tokens == {"0": 4, "1": 4}

    (c,) = create_requests(1, prompt_len=20, max_tokens=1, start_index=2)
    scheduler.add_request(c)
    chunks = []
    for _ in range(4):
        so, _ = step(scheduler, worker)
        items = list(so.num_scheduled_tokens.items())
        # The decodes come first and always get their token; the prefill takes the rest.
        assert items[:2] == [("0", 1), ("1", 1)]
        assert items[2][0] == "2" and so.total_num_scheduled_tokens == 2 + items[2][1]
        chunks.append(items[2][1])
    assert chunks == [6, 6, 6, 2]
    assert c.status == RequestStatus.FINISHED_LENGTH_CAPPED and c.output_token_ids == [T0]


def test_chunked_prefill_exact_chunks_and_blocks():
    scheduler = create_scheduler(num_blocks=21, block_size=16, max_num_batched_tokens=32)
    worker = FakeWorker()
    (req,) = create_requests(1, prompt_len=100, max_tokens=15)
    scheduler.add_request(req)
    chunks, new_blocks, outputs = [], [], []
    for _ in range(4):
        so, outs = step(scheduler, worker)
        chunks.append(so.num_scheduled_tokens["0"])
        if so.scheduled_new_reqs:
            new_blocks.append(so.scheduled_new_reqs[0].block_ids)
        else:
            new_blocks.append(cached_requests(so)["0"][1])
        outputs.append([t for o in outs for t in o.new_token_ids])
    assert chunks == [32, 32, 32, 4]
    assert new_blocks == [([1, 2],), ([3, 4],), ([5, 6],), ([7],)]
    assert outputs == [[], [], [], [T0]]  # no token until the prompt is fully computed

    # Decodes: decode k computes position 99 + k; position 112 (k = 13) opens block 8.
    decode_new_blocks = []
    for _ in range(14):
        so, _ = step(scheduler, worker)
        assert so.num_scheduled_tokens == {"0": 1}
        decode_new_blocks.append(cached_requests(so)["0"][1])
    assert decode_new_blocks == [([],)] * 12 + [([8],), ([],)]
    assert req.is_finished() and req.num_output_tokens == 15


def test_two_prompts_share_the_chunk_budget():
    scheduler = create_scheduler(max_num_batched_tokens=32)
    worker = FakeWorker()
    _add(scheduler, create_requests(2, prompt_len=50, max_tokens=5))
    expected = [
        {"0": 32},
        {"0": 18, "1": 14},
        {"0": 1, "1": 31},
        {"0": 1, "1": 5},
        {"0": 1, "1": 1},
    ]
    for exp in expected:
        so, _ = step(scheduler, worker)
        assert so.num_scheduled_tokens == exp
    reqs = scheduler.requests
    assert reqs["0"].num_output_tokens == 4 and reqs["1"].num_output_tokens == 2


def test_chunked_prefill_disabled_waits_for_the_whole_prompt():
    scheduler = create_scheduler(
        max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=False
    )
    worker = FakeWorker()
    _add(scheduler, create_requests(3, prompt_len=[40, 30, 2], max_tokens=3))
    so, _ = step(scheduler, worker)
    # "1" does not fit in the 24 tokens left and is not chunked; "2" waits behind it (FCFS).
    assert so.num_scheduled_tokens == {"0": 40}
    so, _ = step(scheduler, worker)
    assert so.num_scheduled_tokens == {"0": 1, "1": 30, "2": 2}
    run_to_completion(scheduler, worker=worker)


def test_max_num_seqs_cap():
    scheduler = create_scheduler(max_num_seqs=2)
    worker = FakeWorker()
    _add(scheduler, create_requests(5, prompt_len=8, max_tokens=2))
    expected = [
        (set(), {"0": 8, "1": 8}),
        (set(), {"0": 1, "1": 1}),
        ({"0", "1"}, {"2": 8, "3": 8}),
        (set(), {"2": 1, "3": 1}),
        ({"2", "3"}, {"4": 8}),
        (set(), {"4": 1}),
        ({"4"}, {}),
    ]
    for finished, scheduled in expected:
        so, _ = step(scheduler, worker)
        assert so.finished_req_ids == finished
        assert so.num_scheduled_tokens == scheduled
        assert len(scheduler.running) <= 2
    assert not scheduler.has_unfinished_requests()


def test_token_budget_is_used_and_never_exceeded():
    scheduler = create_scheduler(max_num_batched_tokens=50, max_num_seqs=8)
    lengths = [70, 3, 45, 120, 9, 33, 64, 1, 50, 17]
    _add(scheduler, create_requests(10, prompt_len=lengths, max_tokens=6))
    result = run_to_completion(scheduler)  # asserts total <= 50 after every step
    totals = [so.total_num_scheduled_tokens for so in result.scheduler_outputs]
    assert max(totals) == 50 and all(t <= 50 for t in totals)
    # While prompt tokens are pending the budget is filled completely.
    assert totals[: sum(lengths) // 50] == [50] * (sum(lengths) // 50)
    assert all(len(result.outputs[str(i)]) == 6 for i in range(10))


# ---- preemption -------------------------------------------------------------------------------


def test_preemption_victim_is_the_most_recently_admitted():
    # 7 usable blocks of 4 tokens; max_model_len 16 (4 blocks per request).
    scheduler = create_scheduler(num_blocks=8, block_size=4, max_model_len=16, max_num_seqs=3)
    worker = FakeWorker()
    a, b, c, d = create_requests(4, prompt_len=[8, 6, 11, 4], max_tokens=[3, 4, 3, 2])
    _add(scheduler, [a, b, c, d])

    # Step 1: a [1, 2], b [3, 4], c [5, 6, 7]; d waits for a seat. The cache is full.
    so, _ = step(scheduler, worker)
    assert {r.req_id: r.block_ids for r in so.scheduled_new_reqs} == {
        "0": ([1, 2],),
        "1": ([3, 4],),
        "2": ([5, 6, 7],),
    }
    assert _free_ids(scheduler) == [] and list(scheduler.waiting) == [d]

    # Step 2: a's 9th token needs a 3rd block: c (admitted last) is preempted, not b, and a
    # takes c's first block (freed blocks are reused first).
    so, _ = step(scheduler, worker)
    assert so.preempted_req_ids == {"2"}
    assert so.num_scheduled_tokens == {"0": 1, "1": 1}
    assert cached_requests(so) == {"0": (False, ([5],), 8), "1": (False, ([],), 6)}
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert c.num_preemptions == 1 and scheduler.num_preemptions == 1
    assert c.output_token_ids == [T0]  # its sampled token is kept, only the KV is dropped
    assert list(scheduler.waiting) == [c, d]  # back at the head of the queue
    assert scheduler.running == [a, b]
    assert scheduler.kv_cache_manager.get_block_ids("2") == ([],)
    assert _free_ids(scheduler) == [6, 7]

    # Step 3: c needs 3 blocks for its 12 tokens, only 2 are free: it waits (and so does d).
    so, outs = step(scheduler, worker)
    assert so.num_scheduled_tokens == {"0": 1, "1": 1} and so.preempted_req_ids == set()
    assert {o.request_id: o.finish_reason for o in outs} == {"0": FinishReason.LENGTH, "1": None}
    assert _free_ids(scheduler) == [1, 2, 5, 6, 7]

    # Step 4: b decodes first (block 1), then c is resumed with its full new block table,
    # then d is admitted.
    so, outs = step(scheduler, worker)
    assert so.finished_req_ids == {"0"}
    assert cached_requests(so) == {"1": (False, ([1],), 8), "2": (True, ([2, 5, 6],), 0)}
    assert [(r.req_id, r.block_ids) for r in so.scheduled_new_reqs] == [("3", ([7],))]
    assert list(so.num_scheduled_tokens.items()) == [("1", 1), ("2", 12), ("3", 4)]
    assert {o.request_id: o.new_token_ids for o in outs} == {
        "1": [T0 + 3],
        "2": [T0 + 1],
        "3": [T0],
    }
    assert b.is_finished() and c.status == RequestStatus.RUNNING
    assert scheduler.running == [c, d]
    assert _free_ids(scheduler) == [3, 4, 1]

    # Step 5: both decode (and grow by a block), and finish.
    so, outs = step(scheduler, worker)
    assert cached_requests(so) == {"2": (False, ([3],), 12), "3": (False, ([4],), 4)}
    assert {o.request_id: o.finish_reason for o in outs} == {
        "2": FinishReason.LENGTH,
        "3": FinishReason.LENGTH,
    }
    assert c.output_token_ids == [T0, T0 + 1, T0 + 2]
    assert d.output_token_ids == [T0, T0 + 1]
    run_to_completion(scheduler, worker=worker)


def test_long_prompts_advance_side_by_side_in_capped_chunks():
    """long_prefill_token_threshold 8, two partial prefills: three 30-token prompts; each step
    at most two are left unfinished, no chunk exceeds 8, and each prompt's chunks add up to it."""
    scheduler = create_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=8,
                                 max_num_partial_prefills=2)
    _add(scheduler, create_requests(3, prompt_len=30, max_tokens=3))
    result = run_to_completion(scheduler)
    first = result.scheduler_outputs[0]
    assert first.num_scheduled_tokens == {"0": 8, "1": 8}  # the third would be a third partial
    computed = dict.fromkeys(("0", "1", "2"), 0)
    for so in result.scheduler_outputs:
        assert all(n <= 8 for n in so.num_scheduled_tokens.values())
        for req_id, n in so.num_scheduled_tokens.items():
            computed[req_id] += n
        assert sum(0 < n < 30 for n in computed.values()) <= 2
    assert computed == dict.fromkeys(("0", "1", "2"), 30 + 2)  # the prompt, then two decode steps


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold must be >= 0"),
    ({"max_num_partial_prefills": 0}, "max_num_partial_prefills must be >= 1"),
    ({"long_prefill_token_threshold": 64, "enable_chunked_prefill": False, "max_num_batched_tokens": 128},
     "long_prefill_token_threshold chunks prompts: it needs enable_chunked_prefill"),
])
def test_bad_chunking_options_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        create_scheduler(**kwargs)


def test_decodes_go_before_prefill_chunks():
    """A request still prefilling (admitted first) and one already decoding: the decode is
    scheduled first, the prefill chunk gets what is left of the budget."""
    scheduler = create_scheduler(max_num_batched_tokens=20, long_prefill_token_threshold=16,
                                 max_num_partial_prefills=2)
    worker = FakeWorker()
    long, short = create_requests(2, prompt_len=[100, 4], max_tokens=[2, 5])
    _add(scheduler, [long, short])
    so, _ = step(scheduler, worker)
    assert list(so.num_scheduled_tokens.items()) == [("0", 16), ("1", 4)]
    so, _ = step(scheduler, worker)  # short decodes first, long takes the other 19... capped at 16
    assert list(so.num_scheduled_tokens.items()) == [("1", 1), ("0", 16)]
    run_to_completion(scheduler, worker=worker)


def test_priority_policy_admits_the_lowest_value_first():
    """One seat: the requests run one after another, in (priority, arrival) order."""
    scheduler = create_scheduler(max_num_seqs=1, scheduling_policy="priority")
    _add(scheduler, create_requests(4, prompt_len=8, max_tokens=2, priority=[1, 0, 3, 0]))
    result = run_to_completion(scheduler)
    admitted = [r.req_id for so in result.scheduler_outputs for r in so.scheduled_new_reqs]
    assert admitted == ["1", "3", "0", "2"]


def test_priority_policy_preempts_the_lowest_priority_even_if_scheduled_this_step():
    # 8 usable blocks of 4 tokens; max_model_len 16.
    scheduler = create_scheduler(num_blocks=9, block_size=4, max_model_len=16, max_num_seqs=3,
                                 scheduling_policy="priority")
    worker = FakeWorker()
    a, b, c = create_requests(3, prompt_len=[8, 7, 11], max_tokens=[6, 4, 4], priority=[5, 0, 0])
    _add(scheduler, [a])
    step(scheduler, worker)  # a runs alone: 2 blocks
    _add(scheduler, [b, c])
    step(scheduler, worker)  # a grows to 3 blocks, b takes 2, c 3: the cache is full
    assert scheduler.running == [a, b, c] and _free_ids(scheduler) == []
    so, _ = step(scheduler, worker)  # everyone fits in the blocks they hold
    assert so.preempted_req_ids == set()

    # b's 9th token needs a block. a (priority 5) is the victim although it was admitted first
    # and already scheduled in this step: its token is taken back out of the step.
    so, _ = step(scheduler, worker)
    assert so.preempted_req_ids == {"0"}
    assert so.num_scheduled_tokens == {"1": 1, "2": 1}
    assert a.status == RequestStatus.PREEMPTED and a.num_computed_tokens == 0
    assert a.output_token_ids == [T0, T0 + 1, T0 + 2]  # kept, to be recomputed
    assert scheduler.running == [b, c] and list(scheduler.waiting) == [a]
    result = run_to_completion(scheduler, worker=worker)
    assert result.finish_reasons == {"0": FinishReason.LENGTH, "1": FinishReason.LENGTH, "2": FinishReason.LENGTH}


def test_requests_finishing_in_the_same_step_free_blocks_in_batch_order():
    """Block reuse must not depend on PYTHONHASHSEED.

    update_from_output frees the requests that stopped in a step by iterating over a set of
    request ids, so the order in which their blocks join the free queue (and therefore which
    blocks every later request gets, and with prefix caching which blocks are evicted first)
    changes from one process to the next. Expected: batch order, like vLLM.
    """
    scheduler = create_scheduler(num_blocks=41, block_size=16, max_num_seqs=20)
    _add(scheduler, create_requests(20, prompt_len=16, max_tokens=1))
    step(scheduler, FakeWorker())  # request i holds block i + 1; all 20 finish together
    # Each request's (uncached) block goes to the head: the last in the batch ends up first.
    assert _free_ids(scheduler) == list(range(20, 0, -1)) + list(range(21, 41))


def test_request_preempts_itself_when_it_is_the_last_one():
    # 5 usable blocks of 4 tokens.
    scheduler = create_scheduler(num_blocks=6, block_size=4, max_model_len=20)
    worker = FakeWorker()
    a, b = create_requests(2, prompt_len=8, max_tokens=[4, 3])
    _add(scheduler, [a, b])

    so, _ = step(scheduler, worker)  # a [1, 2], b [3, 4]
    assert so.num_scheduled_tokens == {"0": 8, "1": 8}
    assert _free_ids(scheduler) == [5]

    so, _ = step(scheduler, worker)  # a takes block 5; b needs one too: b is the victim
    assert so.num_scheduled_tokens == {"0": 1}
    assert so.preempted_req_ids == {"1"}
    assert cached_requests(so) == {"0": (False, ([5],), 8)}
    assert b.status == RequestStatus.PREEMPTED and list(scheduler.waiting) == [b]
    assert _free_ids(scheduler) == [3, 4]

    for _ in range(2):  # b (9 tokens, 3 blocks) does not fit in 2 free blocks
        so, _ = step(scheduler, worker)
        assert so.num_scheduled_tokens == {"0": 1}
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED and a.num_output_tokens == 4
    assert _free_ids(scheduler) == [1, 2, 5, 3, 4]

    so, outs = step(scheduler, worker)
    assert so.finished_req_ids == {"0"}
    assert cached_requests(so) == {"1": (True, ([1, 2, 5],), 0)}
    assert so.num_scheduled_tokens == {"1": 9}  # the prompt plus its first output token
    assert [o.new_token_ids for o in outs] == [[T0 + 1]]
    result = run_to_completion(scheduler, worker=worker)
    assert result.outputs == {"1": [T0 + 2]}
    assert b.output_token_ids == [T0, T0 + 1, T0 + 2]
    assert b.num_preemptions == 1 and scheduler.num_preemptions == 1


def test_repeated_preemption_still_finishes_everything():
    scheduler = create_scheduler(num_blocks=9, block_size=4, max_model_len=32, max_num_seqs=8)
    reqs = create_requests(6, prompt_len=[5, 9, 3, 12, 7, 1], max_tokens=[20, 15, 25, 10, 18, 30])
    _add(scheduler, reqs)
    result = run_to_completion(scheduler)
    assert scheduler.num_preemptions > 0
    for r in reqs:
        expected = min(r.max_tokens, 32 - r.num_prompt_tokens)
        assert result.outputs[r.request_id] == [T0 + i for i in range(expected)]
    resumed = [
        rid
        for so in result.scheduler_outputs
        for rid, res in zip(
            so.scheduled_cached_reqs.req_ids,
            so.scheduled_cached_reqs.resumed_from_preemption,
            strict=True,
        )
        if res
    ]
    assert len(resumed) == scheduler.num_preemptions == sum(r.num_preemptions for r in reqs)


# ---- stop conditions --------------------------------------------------------------------------


def _eos_at(index: int, token: int = EOS_TOKEN_ID):
    return lambda req_id, i: token if i == index else T0 + i


def test_stop_on_max_tokens():
    scheduler = create_scheduler()
    (req,) = create_requests(1, prompt_len=10, max_tokens=5)
    scheduler.add_request(req)
    result = run_to_completion(scheduler)
    assert result.outputs == {"0": [T0, T0 + 1, T0 + 2, T0 + 3, T0 + 4]}
    assert result.finish_reasons == {"0": FinishReason.LENGTH}
    assert result.stop_reasons == {"0": None}
    assert str(FinishReason.LENGTH) == "length"


def test_stop_on_eos():
    scheduler = create_scheduler()
    (req,) = create_requests(1, prompt_len=10, max_tokens=10)
    scheduler.add_request(req)
    result = run_to_completion(scheduler, token_fn=_eos_at(2))
    assert result.outputs == {"0": [T0, T0 + 1, EOS_TOKEN_ID]}
    assert result.finish_reasons == {"0": FinishReason.STOP}
    assert result.stop_reasons == {"0": None}
    assert req.status == RequestStatus.FINISHED_STOPPED


def test_ignore_eos_continues_to_max_tokens():
    scheduler = create_scheduler()
    (req,) = create_requests(1, prompt_len=10, max_tokens=5, ignore_eos=True)
    scheduler.add_request(req)
    result = run_to_completion(scheduler, token_fn=_eos_at(2))
    assert result.outputs == {"0": [T0, T0 + 1, EOS_TOKEN_ID, T0 + 3, T0 + 4]}
    assert result.finish_reasons == {"0": FinishReason.LENGTH}


def test_no_eos_token_id_never_stops_on_eos():
    scheduler = create_scheduler()
    (req,) = create_requests(1, prompt_len=10, max_tokens=4, eos_token_id=None)
    scheduler.add_request(req)
    result = run_to_completion(scheduler, token_fn=_eos_at(1))
    assert result.outputs["0"] == [T0, EOS_TOKEN_ID, T0 + 2, T0 + 3]
    assert result.finish_reasons == {"0": FinishReason.LENGTH}


def test_stop_token_ids():
    scheduler = create_scheduler()
    stop = create_requests(1, prompt_len=10, max_tokens=10, stop_token_ids=[42, 43])
    plain = create_requests(1, prompt_len=10, max_tokens=4, start_index=1)
    _add(scheduler, stop + plain)
    result = run_to_completion(scheduler, token_fn=_eos_at(1, token=43))
    assert result.outputs == {"0": [T0, 43], "1": [T0, 43, T0 + 2, T0 + 3]}
    assert result.finish_reasons == {"0": FinishReason.STOP, "1": FinishReason.LENGTH}
    assert result.stop_reasons == {"0": 43, "1": None}
    assert stop[0].stop_reason == 43


def test_stop_token_is_honoured_with_ignore_eos():
    scheduler = create_scheduler()
    _add(scheduler, create_requests(1, max_tokens=10, ignore_eos=True, stop_token_ids=[7]))
    result = run_to_completion(scheduler, token_fn=_eos_at(3, token=7))
    assert result.outputs["0"] == [T0, T0 + 1, T0 + 2, 7]
    assert result.finish_reasons == {"0": FinishReason.STOP} and result.stop_reasons == {"0": 7}


@pytest.mark.parametrize(
    ("prompt_len", "max_tokens", "expected"),
    [
        (20, 100, 12),  # max_model_len - prompt_len
        (20, None, 12),  # None means "until max_model_len"
        (20, 5, 5),
        (31, 100, 1),
        (32, 100, 1),  # a prompt of max_model_len tokens still gets its one token
    ],
)
def test_max_model_len_cap(prompt_len, max_tokens, expected):
    scheduler = create_scheduler(max_model_len=32, block_size=16, num_blocks=3)
    (req,) = create_requests(1, prompt_len=prompt_len, max_tokens=max_tokens)
    scheduler.add_request(req)
    result = run_to_completion(scheduler)
    assert len(result.outputs["0"]) == expected
    assert result.finish_reasons == {"0": FinishReason.LENGTH}
    assert req.num_tokens == prompt_len + expected


# ---- aborts -----------------------------------------------------------------------------------


def test_abort_waiting_request():
    scheduler = create_scheduler(max_num_seqs=1)
    worker = FakeWorker()
    a, b = create_requests(2, prompt_len=8, max_tokens=3)
    _add(scheduler, [a, b])
    step(scheduler, worker)
    free_before = _free_ids(scheduler)
    scheduler.finish_requests(["1"], RequestStatus.FINISHED_ABORTED)
    check_invariants(scheduler)
    assert b.status == RequestStatus.FINISHED_ABORTED
    assert b.get_finished_reason() == FinishReason.ABORT
    assert list(scheduler.waiting) == [] and "1" not in scheduler.requests
    assert _free_ids(scheduler) == free_before
    so, _ = step(scheduler, worker)
    assert so.finished_req_ids == {"1"} and so.num_scheduled_tokens == {"0": 1}
    result = run_to_completion(scheduler, worker=worker)
    assert "1" not in result.outputs


def test_abort_running_request_frees_its_blocks():
    scheduler = create_scheduler(num_blocks=11, block_size=16)
    worker = FakeWorker()
    a, b = create_requests(2, prompt_len=[40, 5], max_tokens=10)
    _add(scheduler, [a, b])
    step(scheduler, worker)  # a [1, 2, 3], b [4]
    assert scheduler.kv_cache_manager.get_num_free_blocks() == 6
    scheduler.finish_requests(["0"], RequestStatus.FINISHED_ABORTED)
    check_invariants(scheduler)
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert scheduler.running == [b] and "0" not in scheduler.requests
    assert scheduler.kv_cache_manager.get_num_free_blocks() == 9
    assert _free_ids(scheduler) == [1, 2, 3, 5, 6, 7, 8, 9, 10]
    so, outs = step(scheduler, worker)
    assert so.finished_req_ids == {"0"} and so.num_scheduled_tokens == {"1": 1}
    assert [o.request_id for o in outs] == ["1"]
    so, _ = step(scheduler, worker)
    assert so.finished_req_ids == set()
    run_to_completion(scheduler, worker=worker)


def test_abort_preempted_request():
    scheduler = create_scheduler(num_blocks=6, block_size=4, max_model_len=20)
    worker = FakeWorker()
    a, b = create_requests(2, prompt_len=8, max_tokens=[4, 3])
    _add(scheduler, [a, b])
    step(scheduler, worker)
    so, _ = step(scheduler, worker)
    assert so.preempted_req_ids == {"1"} and b.status == RequestStatus.PREEMPTED
    scheduler.finish_requests(["1"], RequestStatus.FINISHED_ABORTED)
    check_invariants(scheduler)
    assert list(scheduler.waiting) == [] and b.status == RequestStatus.FINISHED_ABORTED
    so, _ = step(scheduler, worker)
    assert so.finished_req_ids == {"1"}
    result = run_to_completion(scheduler, worker=worker)
    assert set(result.outputs) == {"0"}


def test_abort_waiting_request_after_a_failed_allocation():
    # 2 usable blocks: "0" takes both; "1"'s first allocation fails and it keeps waiting.
    scheduler = create_scheduler(num_blocks=3, block_size=16, max_model_len=32)
    worker = FakeWorker()
    _add(scheduler, create_requests(2, prompt_len=[32, 5], max_tokens=1))
    so, _ = step(scheduler, worker)
    assert so.num_scheduled_tokens == {"0": 32}
    scheduler.finish_requests(["1"], RequestStatus.FINISHED_ABORTED)
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    assert all("1" not in manager.req_to_blocks for manager in managers)
    run_to_completion(scheduler, worker=worker)


def test_abort_while_the_step_is_in_flight():
    scheduler = create_scheduler()
    worker = FakeWorker()
    _add(scheduler, create_requests(2, prompt_len=8, max_tokens=5))
    so = scheduler.schedule()
    runner_output = worker.execute_model(so, scheduler)
    scheduler.finish_requests(["0"], RequestStatus.FINISHED_ABORTED)
    outs = scheduler.update_from_output(so, runner_output)
    assert [o.request_id for o in outs] == ["1"]  # the aborted request's token is dropped
    check_invariants(scheduler)
    so, _ = step(scheduler, worker)
    assert so.finished_req_ids == {"0"} and so.num_scheduled_tokens == {"1": 1}
    run_to_completion(scheduler, worker=worker)


def test_abort_unknown_or_finished_request_is_noop():
    scheduler = create_scheduler()
    worker = FakeWorker()
    _add(scheduler, create_requests(1, prompt_len=8, max_tokens=1))
    step(scheduler, worker)  # "0" finishes
    scheduler.finish_requests(["0", "nope"], RequestStatus.FINISHED_ABORTED)
    check_invariants(scheduler)
    so, _ = step(scheduler, worker)
    assert so.finished_req_ids == {"0"}


# ---- update_from_output -----------------------------------------------------------------------


def test_update_ignores_empty_sampled_lists_and_unknown_requests():
    scheduler = create_scheduler(max_num_batched_tokens=16)
    _add(scheduler, create_requests(1, prompt_len=40, max_tokens=2))
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"0": 16}
    outs = scheduler.update_from_output(
        so, ModelRunnerOutput(req_ids=["0", "ghost"], sampled_token_ids=[[], [5]])
    )
    assert outs == []
    assert scheduler.requests["0"].num_tokens == 40
    check_invariants(scheduler)


def test_logprobs_rows_are_sliced_per_request():
    scheduler = create_scheduler(max_num_batched_tokens=20)
    reqs = [
        *create_requests(1, prompt_len=4, logprobs=2),
        *create_requests(1, prompt_len=4, start_index=1),
        *create_requests(1, prompt_len=4, logprobs=0, start_index=2),
        *create_requests(1, prompt_len=40, logprobs=1, start_index=3),
    ]
    _add(scheduler, reqs)
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"0": 4, "1": 4, "2": 4, "3": 8}
    # Rows follow the flattened sampled tokens, in the runner's order ("3" samples nothing);
    # row width is 1 + the largest `logprobs` of the batch.
    rows = LogprobsArrays(
        logprob_token_ids=np.array([[10, 7, 8], [11, 11, 9], [12, 5, 12]]),
        logprobs=np.array([[-0.1, -1.0, -2.0], [-0.2, -0.2, -3.0], [-0.5, -0.4, -0.5]]),
        token_ranks=np.array([1, 1, 2]),
    )
    outs = scheduler.update_from_output(
        so,
        ModelRunnerOutput(
            req_ids=["0", "3", "1", "2"],
            sampled_token_ids=[[10], [], [11], [12]],
            logprobs=rows,
        ),
    )
    by_id = {o.request_id: o for o in outs}
    assert set(by_id) == {"0", "1", "2"}
    as_lists = lambda lp: tuple(x.tolist() for x in lp)  # noqa: E731
    assert as_lists(by_id["0"].new_logprobs) == ([[10, 7, 8]], [[-0.1, -1.0, -2.0]], [1])
    assert by_id["1"].new_logprobs is None
    assert as_lists(by_id["2"].new_logprobs) == ([[12]], [[-0.5]], [2])
    assert [by_id[r].new_token_ids for r in ("0", "1", "2")] == [[10], [11], [12]]


def test_eos_on_the_last_allowed_token_finishes_as_length():
    """Like vLLM's check_stop: the length cap is checked before EOS."""
    scheduler = create_scheduler()
    _add(scheduler, create_requests(1, max_tokens=3))
    result = run_to_completion(scheduler, token_fn=_eos_at(2))
    assert result.outputs["0"] == [T0, T0 + 1, EOS_TOKEN_ID]
    assert result.finish_reasons == {"0": FinishReason.LENGTH}
