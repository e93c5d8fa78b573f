"""The scheduler's side of structured output, with a stand-in manager whose compiles finish when
the test says: a compiling request waits in its place without holding up the others, joins when
its grammar is ready, gets a bitmask row only in the steps where it samples, ends when its
grammar is complete, and a failed compile finishes that request alone, with its error."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
from core_utils import FakeWorker, create_requests, create_scheduler, step

from minivllm.core.request import Request, RequestStatus
from minivllm.sampling_params import SamplingParams, StructuredOutputsParams


class FakeGrammar:
    def __init__(self, length: int) -> None:
        self.length, self.accepted = length, []

    def accept_tokens(self, token_ids: list[int]) -> bool:
        self.accepted += token_ids
        return True

    def fill_bitmask(self, bitmask, row: int) -> None:
        bitmask[row] = len(self.accepted) + 1  # which position the row was filled for

    def is_terminated(self) -> bool:
        return len(self.accepted) >= self.length


class FakeManager:
    def __init__(self) -> None:
        self.futures: dict[str, Future] = {}

    def grammar_init(self, request: Request) -> None:
        self.futures[request.request_id] = request.structured_output_request.future = Future()

    def grammar_bitmask(self, requests: list[Request], spec_tokens: dict[str, list[int]]) -> np.ndarray:
        bitmask = np.zeros((len(requests), 4), np.int32)
        for row, request in enumerate(requests):
            request.structured_output_request.grammar.fill_bitmask(bitmask, row)
        return bitmask


def structured(request_id: str, prompt_len: int, max_tokens: int = 50) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens,
                            structured_outputs=StructuredOutputsParams(choice=["a"]))
    return Request(request_id, [100 + i for i in range(prompt_len)], params, eos_token_id=None)


def engine_with(structured_request: Request, plain_max_tokens: int, **kwargs) -> tuple:
    """A scheduler with the stand-in manager, the structured request and an 8-token plain one."""
    scheduler = create_scheduler(**kwargs)
    scheduler.structured_output_manager = manager = FakeManager()
    (plain,) = create_requests(1, prompt_len=8, max_tokens=plain_max_tokens, ignore_eos=True, id_prefix="p")
    scheduler.add_request(structured_request)
    scheduler.add_request(plain)
    return scheduler, manager, FakeWorker()


def test_compiling_waits_without_blocking_then_joins_samples_and_ends():
    slow = structured("so", prompt_len=40)
    scheduler, manager, worker = engine_with(slow, 30, max_num_batched_tokens=32)
    so, _ = step(scheduler, worker)
    assert slow.status == RequestStatus.WAITING_FOR_FSM and "so" not in so.num_scheduled_tokens
    assert so.num_scheduled_tokens == {"p0": 8} and not so.structured_output_request_ids
    assert [r.request_id for r in scheduler.waiting] == ["so"]
    grammar = FakeGrammar(length=3)
    manager.futures["so"].set_result(grammar)
    so, _ = step(scheduler, worker)  # admitted: a 31-token chunk of its 40-token prompt, no sample
    assert so.num_scheduled_tokens["so"] == 31 and not so.structured_output_request_ids
    so, outs = step(scheduler, worker)  # the rest of the prompt: it samples, row 0 for position 1
    assert so.structured_output_request_ids == {"so": 0} and so.grammar_bitmask[0, 0] == 1
    so, outs = step(scheduler, worker)
    assert so.grammar_bitmask[so.structured_output_request_ids["so"], 0] == 2
    so, outs = step(scheduler, worker)
    (out,) = [o for o in outs if o.request_id == "so"]
    assert str(out.finish_reason) == "stop" and out.stop_reason is None  # the grammar is complete
    assert grammar.accepted == slow.output_token_ids and len(grammar.accepted) == 3
    assert "so" not in scheduler.requests


def test_a_failed_compile_finishes_that_request_alone_with_its_error():
    scheduler, manager, worker = engine_with(structured("broken", prompt_len=10), 5)
    manager.futures["broken"].set_exception(RuntimeError("no such rule"))
    so, outs = step(scheduler, worker)
    assert so.num_scheduled_tokens == {"p0": 8}
    (out,) = [o for o in outs if o.request_id == "broken"]
    assert str(out.finish_reason) == "abort" and "no such rule" in out.stop_reason
    assert out.new_token_ids == [] and "broken" not in scheduler.requests
    while scheduler.has_unfinished_requests():
        step(scheduler, worker)
    assert scheduler.kv_cache_manager.usage == 0.0
