"""The scheduler under speculative decoding, hand-computed: drafts from the runner's output kept
within max_tokens and max_model_len, the drafter's lookahead slots, blocks given back after a
verification, and the acceptance counters."""

from __future__ import annotations

from core_utils import FIRST_SAMPLED_TOKEN_ID, create_requests, create_scheduler

from minivllm.config import SpeculativeConfig
from minivllm.core.outputs import ModelRunnerOutput
from minivllm.core.sched.output import SchedulerOutput
from minivllm.core.sched.scheduler import Scheduler

T0 = FIRST_SAMPLED_TOKEN_ID
BLOCK = 4


def step(scheduler: Scheduler, sampled: list[int], drafts: list[int]) -> SchedulerOutput:
    so = scheduler.schedule()
    (req_id,) = so.num_scheduled_tokens
    scheduler.update_from_output(so, ModelRunnerOutput([req_id], [sampled], draft_token_ids=[drafts]))
    return so


def held_blocks(scheduler: Scheduler) -> int:
    return scheduler.kv_cache_manager.block_pool.num_blocks - 1 - scheduler.kv_cache_manager.get_num_free_blocks()


def make(method: str = "ngram", max_tokens: int = 20, max_model_len: int = 64) -> Scheduler:
    spec = SpeculativeConfig(method, 3, model=None if method == "ngram" else "draft")
    scheduler = create_scheduler(num_blocks=40, block_size=BLOCK, max_model_len=max_model_len,
                                 speculative_config=spec)
    scheduler.add_request(create_requests(1, prompt_len=6, max_tokens=max_tokens, ignore_eos=True)[0])
    return scheduler


def test_rejected_drafts_give_their_blocks_back():
    scheduler = make()
    step(scheduler, [T0], [7, 8, 9])  # prompt of 6: blocks for 6 tokens
    assert held_blocks(scheduler) == 2
    request = scheduler.running[0]
    assert request.spec_token_ids == [7, 8, 9]
    so = scheduler.schedule()  # the last token and 3 drafts: tokens 6..9, 3 blocks
    assert so.scheduled_spec_decode_tokens == {request.request_id: [7, 8, 9]}
    assert so.num_scheduled_tokens[request.request_id] == 4 and held_blocks(scheduler) == 3
    # All drafts rejected: one token back; 7 computed tokens need 2 blocks, the third goes back.
    scheduler.update_from_output(so, ModelRunnerOutput([request.request_id], [[T0 + 1]], draft_token_ids=[[5]]))
    assert request.num_computed_tokens == 7 and held_blocks(scheduler) == 2
    stats = scheduler.make_stats().spec_decoding
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 0)
    # One draft: tokens 7..8; both accepted (2 tokens come back): 9 computed, 3 blocks kept.
    so = scheduler.schedule()
    assert held_blocks(scheduler) == 3
    scheduler.update_from_output(so, ModelRunnerOutput([request.request_id], [[5, T0 + 3]], draft_token_ids=[[]]))
    assert request.num_computed_tokens == 9 and held_blocks(scheduler) == 3
    stats = scheduler.make_stats().spec_decoding
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 4, 1)
    assert stats.num_accepted_tokens_per_pos == [1, 0, 0]


def test_drafter_lookahead_slots_are_allocated_then_given_back():
    scheduler = make("draft_model")
    step(scheduler, [T0], [7, 8, 9])  # 6 prompt tokens + 3 lookahead slots: 3 blocks, trimmed to 2
    assert held_blocks(scheduler) == 2
    so = scheduler.schedule()  # 4 tokens (6..9) + 3 lookahead: 13 slots, 4 blocks
    assert held_blocks(scheduler) == 4
    (req_id,) = so.num_scheduled_tokens
    scheduler.update_from_output(so, ModelRunnerOutput([req_id], [[7, 8, 9, T0 + 4]], draft_token_ids=[[]]))
    assert held_blocks(scheduler) == 3  # 10 computed tokens


def test_drafts_are_kept_within_max_tokens_and_max_model_len():
    scheduler = make(max_tokens=3)
    step(scheduler, [T0], [7, 8, 9])
    # 1 output token of 3: at most 2 more come, the accepted drafts and one more token.
    assert scheduler.running[0].spec_token_ids == [7]
    scheduler = make(max_model_len=9)
    step(scheduler, [T0], [7, 8, 9])
    assert scheduler.running[0].spec_token_ids == [7]  # 7 tokens of 9
