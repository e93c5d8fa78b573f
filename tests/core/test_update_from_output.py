"""The multi-token step contract, hand-computed: draft tokens scheduled towards
num_tokens_with_spec, Scheduler.update_from_output with 0, 1 or several tokens per request
(per-token stop checks, trimming after a stop, logprob rows), and the take-back of rejected
draft tokens.

The runner outputs are written by hand here (no fake worker), so each case states exactly
what a worker would return. A request that verified k drafts returns m tokens, 1 <= m <= k + 1:
the m - 1 accepted drafts and one more token.
"""

from __future__ import annotations

import numpy as np
import pytest
from core_utils import (
    EOS_TOKEN_ID,
    FIRST_SAMPLED_TOKEN_ID,
    check_invariants,
    create_requests,
    create_scheduler,
)

from minivllm.core.outputs import LogprobsArrays, ModelRunnerOutput
from minivllm.core.request import FinishReason, Request, RequestStatus
from minivllm.core.sched.output import SchedulerOutput
from minivllm.core.sched.scheduler import Scheduler
from minivllm.sampling_params import SamplingParams

T0 = FIRST_SAMPLED_TOKEN_ID


def _update(
    scheduler: Scheduler, so: SchedulerOutput, sampled: dict[str, list[int]], logprobs=None
):
    """update_from_output with the runner's rows in the order of `sampled`."""
    output = ModelRunnerOutput(
        req_ids=list(sampled), sampled_token_ids=list(sampled.values()), logprobs=logprobs
    )
    return {o.request_id: o for o in scheduler.update_from_output(so, output)}


def _decoding(scheduler: Scheduler, requests: list[Request]) -> None:
    """Admit the requests, compute their prompts and sample T0 for each: all decode next."""
    for request in requests:
        scheduler.add_request(request)
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {r.request_id: r.num_prompt_tokens for r in requests}
    _update(scheduler, so, {r.request_id: [T0] for r in requests})


def _rows(token_ids: list[int]) -> LogprobsArrays:
    """Logprob rows of sampled tokens: row i has token ids [t, t + 1], logprobs [-i, -i - 0.5]."""
    n = len(token_ids)
    return LogprobsArrays(
        logprob_token_ids=np.array([[t, t + 1] for t in token_ids]),
        logprobs=np.array([[-float(i), -i - 0.5] for i in range(n)]),
        token_ranks=np.arange(1, n + 1),
    )


# ---- scheduling draft tokens --------------------------------------------------------------------


def test_zero_one_and_three_tokens_per_request():
    scheduler = create_scheduler(block_size=4, max_num_batched_tokens=32)
    a, b, c = create_requests(3, prompt_len=[4, 4, 40], max_tokens=10)
    for request in (a, b, c):
        scheduler.add_request(request)
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"0": 4, "1": 4, "2": 24}
    outs = _update(scheduler, so, {"0": [T0], "1": [T0], "2": []})  # "2" is mid-prompt
    assert set(outs) == {"0", "1"}
    a.spec_token_ids = [11, 12]
    b.spec_token_ids = [T0 + 1, T0 + 2]
    assert (a.num_tokens_with_spec, b.num_tokens_with_spec) == (7, 7)

    so = scheduler.schedule()
    # Running requests catch up with num_tokens_with_spec: their last token and their drafts.
    assert so.num_scheduled_tokens == {"0": 3, "1": 3, "2": 16}
    assert so.scheduled_spec_decode_tokens == {"0": [11, 12], "1": [T0 + 1, T0 + 2]}
    assert a.spec_token_ids == [] and b.spec_token_ids == []  # handed to the worker
    assert (a.num_computed_tokens, b.num_computed_tokens) == (7, 7)
    assert so.scheduled_cached_reqs.new_block_ids == [([9],), ([10],), ([11, 12, 13, 14],)]

    # "0": both drafts rejected; "1": both accepted, plus one; "2": its first token.
    outs = _update(scheduler, so, {"0": [T0 + 1], "1": [T0 + 1, T0 + 2, T0 + 3], "2": [T0]})
    assert {r: o.new_token_ids for r, o in outs.items()} == {
        "0": [T0 + 1],
        "1": [T0 + 1, T0 + 2, T0 + 3],
        "2": [T0],
    }
    assert (a.num_tokens, a.num_computed_tokens) == (6, 5)  # took back 2 + 1 - 1 = 2
    assert (b.num_tokens, b.num_computed_tokens) == (8, 7)  # took back none
    assert (c.num_tokens, c.num_computed_tokens) == (41, 40)
    check_invariants(scheduler, max_num_spec_tokens=2)

    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"0": 1, "1": 1, "2": 1}
    assert so.scheduled_spec_decode_tokens == {}
    # a recomputes position 5 in block 9, which it kept; c's position 40 opens a block.
    assert so.scheduled_cached_reqs.new_block_ids == [([],), ([],), ([15],)]


@pytest.mark.parametrize("num_accepted", [0, 1, 2, 3])
def test_rejected_drafts_are_taken_back_and_their_blocks_reused(num_accepted):
    scheduler = create_scheduler(block_size=4, max_model_len=32)
    (req,) = create_requests(1, prompt_len=4, max_tokens=20)
    _decoding(scheduler, [req])  # 5 tokens, 4 computed, block [1]
    true_tokens = [T0 + 1, T0 + 2, T0 + 3, T0 + 4]  # what the model samples next
    drafts = true_tokens[:num_accepted] + [7] * (3 - num_accepted)
    req.spec_token_ids = list(drafts)
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"0": 4}
    assert so.scheduled_spec_decode_tokens == {"0": drafts}
    assert so.scheduled_cached_reqs.new_block_ids == [([2],)]  # slots for positions 4..7
    sampled = true_tokens[: num_accepted + 1]  # the accepted drafts, then one more
    outs = _update(scheduler, so, {"0": sampled})
    assert outs["0"].new_token_ids == sampled
    # 4 computed + the last known token + the accepted drafts.
    assert req.num_computed_tokens == 4 + 1 + num_accepted == req.num_tokens - 1
    assert scheduler.kv_cache_manager.get_block_ids("0") == ([1, 2],)

    so = scheduler.schedule()  # no drafts this time: one token, at position 5 + num_accepted
    assert so.num_scheduled_tokens == {"0": 1}
    expected_new = [3] if num_accepted == 3 else []  # position 8 opens block 3
    assert so.scheduled_cached_reqs.new_block_ids == [(expected_new,)]
    assert so.scheduled_cached_reqs.num_computed_tokens == [5 + num_accepted]


def test_no_token_back_takes_back_the_last_token_too():
    """A runner that sampled nothing for a request with drafts verified nothing: all k + 1
    tokens are taken back, and the next step computes the last known token again."""
    scheduler = create_scheduler(block_size=4)
    (req,) = create_requests(1, prompt_len=4, max_tokens=20)
    _decoding(scheduler, [req])
    req.spec_token_ids = [11, 12]
    so = scheduler.schedule()
    assert req.num_computed_tokens == 7
    assert _update(scheduler, so, {"0": []}) == {}
    assert (req.num_tokens, req.num_computed_tokens) == (5, 4)
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"0": 1}
    assert so.scheduled_cached_reqs.new_block_ids == [([],)]  # block 2 is still its own


def test_drafts_are_cut_to_the_token_budget_and_max_model_len():
    scheduler = create_scheduler(block_size=4, max_num_batched_tokens=3, max_model_len=12)
    a, b = create_requests(2, prompt_len=[3, 3], max_tokens=20)
    _decoding(scheduler, [a])  # budget 3: only a's prompt
    a.spec_token_ids = [11, 12, 13, 14]
    scheduler.add_request(b)
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"0": 3}  # the last token + 2 drafts fill the budget
    assert so.scheduled_spec_decode_tokens == {"0": [11, 12]}
    assert a.spec_token_ids == []
    _update(scheduler, so, {"0": [11, 12, T0 + 1]})
    so = scheduler.schedule()  # a decodes, b's prompt is cut to the 2 tokens left
    _update(scheduler, so, {"0": [T0 + 4], "1": []})
    assert (a.num_tokens, a.num_computed_tokens) == (8, 7)

    # A request with 8 of max_model_len 12 tokens: its last token is at position 7, 4 drafts
    # at positions 8..11; a 5th would be at position 12 = max_model_len.
    scheduler = create_scheduler(block_size=4, max_model_len=12)
    (c,) = create_requests(1, prompt_len=7, max_tokens=20)
    _decoding(scheduler, [c])
    c.spec_token_ids = [11, 12, 13, 14, 15, 16]
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"0": 12 - 7}
    assert so.scheduled_spec_decode_tokens == {"0": [11, 12, 13, 14]}
    assert c.num_computed_tokens == 12
    assert scheduler.kv_cache_manager.get_block_ids("0") == ([1, 2, 3],)


def test_drafts_past_the_budget_are_not_scheduled_but_dropped():
    scheduler = create_scheduler(block_size=4, max_num_batched_tokens=8)
    (req,) = create_requests(1, prompt_len=20, max_tokens=5)
    scheduler.add_request(req)
    so = scheduler.schedule()
    _update(scheduler, so, {"0": []})
    req.spec_token_ids = [7, 8]
    so = scheduler.schedule()  # tokens 8..15 of the prompt: no room for the drafts
    assert so.num_scheduled_tokens == {"0": 8} and so.scheduled_spec_decode_tokens == {}
    assert req.spec_token_ids == []  # the proposer drafts anew after every step


def test_preemption_drops_the_drafts():
    scheduler = create_scheduler(num_blocks=5, block_size=4, max_model_len=16, max_num_seqs=2)
    a, b = create_requests(2, prompt_len=[8, 4], max_tokens=10)
    _decoding(scheduler, [a, b])  # a [1, 2], b [3]; 1 block free
    a.spec_token_ids = [11, 12, 13, 14]  # a needs 2 more blocks: b is preempted
    b.spec_token_ids = [15]
    so = scheduler.schedule()
    assert so.preempted_req_ids == {"1"} and so.num_scheduled_tokens == {"0": 5}
    assert b.status == RequestStatus.PREEMPTED and b.spec_token_ids == []
    assert b.num_tokens_with_spec == b.num_tokens == 5


def test_drafts_never_enter_the_prefix_cache():
    scheduler = create_scheduler(block_size=4, enable_prefix_caching=True)
    (req,) = create_requests(1, prompt_len=4, max_tokens=20)
    _decoding(scheduler, [req])
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.blocks[1].block_hash == (req.block_hashes[0], 0)
    req.spec_token_ids = [T0 + 1, T0 + 2, T0 + 3]
    so = scheduler.schedule()  # block 2 gets positions 4..7: 1 known token, 3 drafts
    assert pool.blocks[2].block_hash is None and len(req.block_hashes) == 1
    _update(scheduler, so, {"0": [T0 + 1, T0 + 2, T0 + 3, T0 + 4]})  # all accepted
    so = scheduler.schedule()  # now tokens 4..7 are known and computed: block 2 is cached
    assert so.num_scheduled_tokens == {"0": 1}
    assert req.all_token_ids[4:8] == [T0, T0 + 1, T0 + 2, T0 + 3]
    assert pool.blocks[2].block_hash == (req.block_hashes[1], 0)


# ---- stop conditions inside a step's tokens -----------------------------------------------------


def _one_decoding(scheduler: Scheduler, num_drafts: int = 2, **kwargs) -> Request:
    """A decoding request with one output token (T0) and `num_drafts` drafts to verify (their
    values do not matter to the scheduler, only their number)."""
    (req,) = create_requests(1, prompt_len=4, **kwargs)
    _decoding(scheduler, [req])
    req.spec_token_ids = [11] * num_drafts
    return req


def test_eos_in_the_middle_is_the_last_token_with_its_logprob_row():
    scheduler = create_scheduler(max_num_seqs=3)
    a = create_requests(1, prompt_len=4, max_tokens=10, logprobs=1)[0]
    b = create_requests(1, prompt_len=4, max_tokens=10, logprobs=1, start_index=1)[0]
    _decoding(scheduler, [a, b])
    a.spec_token_ids = [11, 12]
    b.spec_token_ids = [11, 12]
    so = scheduler.schedule()
    sampled = {"0": [T0 + 1, EOS_TOKEN_ID, T0 + 3], "1": [T0 + 1, T0 + 2, T0 + 3]}
    outs = _update(scheduler, so, sampled, logprobs=_rows(sampled["0"] + sampled["1"]))
    assert outs["0"].new_token_ids == [T0 + 1, EOS_TOKEN_ID]
    assert (outs["0"].finish_reason, outs["0"].stop_reason) == (FinishReason.STOP, None)
    assert a.output_token_ids == [T0, T0 + 1, EOS_TOKEN_ID]
    lp = outs["0"].new_logprobs
    assert lp.logprob_token_ids.tolist() == [[T0 + 1, T0 + 2], [EOS_TOKEN_ID, EOS_TOKEN_ID + 1]]
    assert lp.logprobs.tolist() == [[0.0, -0.5], [-1.0, -1.5]] and lp.token_ranks.tolist() == [1, 2]
    # b's rows start after all three of a's, trimmed or not.
    lp = outs["1"].new_logprobs
    assert lp.logprob_token_ids[:, 0].tolist() == [T0 + 1, T0 + 2, T0 + 3]
    assert lp.token_ranks.tolist() == [4, 5, 6] and outs["1"].finish_reason is None
    assert "0" not in scheduler.requests and scheduler.running == [b]
    assert scheduler.schedule().finished_req_ids == {"0"}


def test_stop_token_in_the_middle_is_the_stop_reason():
    scheduler = create_scheduler()
    req = _one_decoding(scheduler, max_tokens=10, stop_token_ids=[42])
    so = scheduler.schedule()
    outs = _update(scheduler, so, {"0": [42, 43, 44]})
    assert outs["0"].new_token_ids == [42]
    assert (outs["0"].finish_reason, outs["0"].stop_reason) == (FinishReason.STOP, 42)
    assert req.status == RequestStatus.FINISHED_STOPPED and req.output_token_ids == [T0, 42]


@pytest.mark.parametrize(
    ("min_tokens", "num_new", "finish_reason"),
    [
        # T0 is output 1; the step gives outputs 2 (EOS), 3 and 4 (EOS).
        (0, 1, FinishReason.STOP),
        (2, 1, FinishReason.STOP),  # output 2 reaches min_tokens: its EOS stops
        (3, 3, FinishReason.STOP),  # the first EOS is suppressed, the second stops
        (4, 3, FinishReason.STOP),
        (5, 3, None),  # both suppressed
    ],
)
def test_min_tokens_suppresses_stops_token_by_token(min_tokens, num_new, finish_reason):
    scheduler = create_scheduler()
    req = _one_decoding(scheduler, max_tokens=10, min_tokens=min_tokens)
    so = scheduler.schedule()
    sampled = [EOS_TOKEN_ID, T0 + 2, EOS_TOKEN_ID]
    outs = _update(scheduler, so, {"0": sampled})
    assert outs["0"].new_token_ids == sampled[:num_new]
    assert outs["0"].finish_reason == finish_reason
    assert req.num_output_tokens == 1 + num_new


def test_ignore_eos_keeps_every_token():
    scheduler = create_scheduler()
    req = _one_decoding(scheduler, max_tokens=10, ignore_eos=True)
    so = scheduler.schedule()
    outs = _update(scheduler, so, {"0": [EOS_TOKEN_ID, T0 + 2, EOS_TOKEN_ID]})
    assert outs["0"].new_token_ids == [EOS_TOKEN_ID, T0 + 2, EOS_TOKEN_ID]
    assert outs["0"].finish_reason is None and req.status == RequestStatus.RUNNING


def test_max_tokens_is_never_exceeded():
    scheduler = create_scheduler()
    req = _one_decoding(scheduler, max_tokens=3, logprobs=0)
    so = scheduler.schedule()
    outs = _update(scheduler, so, {"0": [T0 + 1, T0 + 2, T0 + 3]}, logprobs=_rows([1, 2, 3]))
    assert outs["0"].new_token_ids == [T0 + 1, T0 + 2]
    assert outs["0"].finish_reason == FinishReason.LENGTH
    assert req.num_output_tokens == 3
    assert outs["0"].new_logprobs.logprob_token_ids.tolist() == [[1], [2]]  # width 1 + 0


def test_max_model_len_is_never_exceeded():
    scheduler = create_scheduler(max_model_len=8, block_size=4, num_blocks=3)
    (req,) = create_requests(1, prompt_len=5, max_tokens=None)
    _decoding(scheduler, [req])  # 6 tokens
    req.spec_token_ids = [11, 12]
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"0": 3}  # positions 5, 6, 7
    outs = _update(scheduler, so, {"0": [T0 + 1, T0 + 2, T0 + 3]})
    assert outs["0"].new_token_ids == [T0 + 1, T0 + 2]
    assert outs["0"].finish_reason == FinishReason.LENGTH and req.num_tokens == 8


def test_length_is_checked_before_eos_on_each_token():
    scheduler = create_scheduler()
    _one_decoding(scheduler, max_tokens=2)
    so = scheduler.schedule()
    outs = _update(scheduler, so, {"0": [EOS_TOKEN_ID, T0 + 2, T0 + 3]})
    assert outs["0"].new_token_ids == [EOS_TOKEN_ID]
    assert outs["0"].finish_reason == FinishReason.LENGTH


def test_tokens_of_a_request_aborted_during_the_step_are_dropped():
    scheduler = create_scheduler()
    a, b = create_requests(2, prompt_len=4, max_tokens=10)
    _decoding(scheduler, [a, b])
    a.spec_token_ids = [11, 12]
    b.spec_token_ids = [11, 12]
    so = scheduler.schedule()
    scheduler.finish_requests(["0"], RequestStatus.FINISHED_ABORTED)
    outs = _update(scheduler, so, {"0": [T0 + 1], "1": [T0 + 1]})
    assert set(outs) == {"1"}
    assert a.num_computed_tokens == 7 and a.output_token_ids == [T0]  # untouched
    assert b.num_computed_tokens == 5
    check_invariants(scheduler, max_num_spec_tokens=2)


# ---- the stop-token rule ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "eos_token_id", "expected"),
    [
        ({}, 2, [2]),
        ({"stop_token_ids": [7, 9]}, 2, [7, 9, 2]),
        ({"stop_token_ids": [7], "ignore_eos": True}, 2, [7]),
        ({"ignore_eos": True}, 2, []),
        ({"stop_token_ids": [7]}, None, [7]),
    ],
)
def test_get_stop_token_ids(kwargs, eos_token_id, expected):
    assert SamplingParams(**kwargs).get_stop_token_ids(eos_token_id) == expected


@pytest.mark.parametrize(("ignore_eos", "stop_reason"), [(False, None), (True, EOS_TOKEN_ID)])
def test_eos_listed_as_a_stop_token(ignore_eos, stop_reason):
    """EOS that ends a request as EOS has no stop reason (vLLM); as a listed stop token
    despite ignore_eos, it is its own stop reason."""
    scheduler = create_scheduler()
    _one_decoding(
        scheduler, num_drafts=0, max_tokens=10, ignore_eos=ignore_eos, stop_token_ids=[EOS_TOKEN_ID]
    )
    outs = _update(scheduler, scheduler.schedule(), {"0": [EOS_TOKEN_ID]})
    assert (outs["0"].finish_reason, outs["0"].stop_reason) == (FinishReason.STOP, stop_reason)
