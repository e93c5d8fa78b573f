"""Output processing in the front end: engine-core outputs -> user-facing RequestOutputs.

The OutputProcessor holds the front end's state of every request in flight, for LLMEngine and
AsyncLLM alike. It registers each user request: the one check of its id, the fan-out of n > 1
into child requests, and the engine-core ids, unique per registration (vLLM's internal request
ids): outputs of a finished request that were already on their way cannot reach a later request
with the same user id. Per engine-core output it detokenizes incrementally, matches stop
strings (a match finishes the request here, and the caller aborts it in the engine core),
converts logprobs, and shapes each output as asked: the whole generation so far, only the new
part, or one final output. An output goes to its request's queue (AsyncLLM) or back to the
caller (LLMEngine).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from minivllm.core.request import FinishReason
from minivllm.engine.detokenizer import IncrementalDetokenizer
from minivllm.engine.logprobs import LogprobsProcessor
from minivllm.engine.messages import EngineCoreOutputs, EngineCoreRequest
from minivllm.engine.parallel_sampling import ParentRequest, fan_out
from minivllm.metrics.stats import EngineStats
from minivllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from minivllm.sampling_params import RequestOutputKind

if TYPE_CHECKING:
    import asyncio

    # Where AsyncLLM's caller receives a request's outputs, or the error that ended the engine.
    RequestOutputQueue = asyncio.Queue[RequestOutput | BaseException]


@dataclass
class RequestState:
    request_id: str  # the engine core's
    external_req_id: str  # the user's: what RequestOutputs carry
    parent: ParentRequest | None
    index: int
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    detokenizer: IncrementalDetokenizer
    logprobs: LogprobsProcessor
    metrics: RequestMetrics
    queue: RequestOutputQueue | None  # AsyncLLM's; shared by the children of one request
    # How much of the token ids / logprobs / prompt logprobs earlier DELTA outputs already carried.
    num_sent_tokens: int = 0
    num_sent_prompt_logprobs: int = 0
    num_cached_tokens: int = 0


@dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput] = field(default_factory=list)  # of requests without a queue
    # Requests finished here (stop strings) that the engine core is still running.
    reqs_to_abort: list[str] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}  # by engine-core id
        self.external_req_ids: dict[str, list[str]] = {}  # user id -> its unfinished engine-core ids
        self._registrations = itertools.count()

    def add_request(
        self, request: EngineCoreRequest, prompt: str | None, queue: RequestOutputQueue | None = None
    ) -> list[EngineCoreRequest]:
        """Register a user request (its id is request.request_id); returns the requests for the
        engine core: one, or n child requests when params.n > 1. A ValueError (the id is in use)
        leaves everything as it was: this is the check users meet, the scheduler's a safeguard."""
        external_req_id = request.request_id
        if external_req_id in self.external_req_ids:
            raise ValueError(f"Request id {external_req_id!r} is already in the engine.")
        internal_id = f"{external_req_id}-{next(self._registrations)}"
        parent, engine_requests = fan_out(msgspec.structs.replace(request, request_id=internal_id))
        self.external_req_ids[external_req_id] = [r.request_id for r in engine_requests]
        for index, engine_request in enumerate(engine_requests):
            params = engine_request.sampling_params
            self.request_states[engine_request.request_id] = RequestState(
                request_id=engine_request.request_id,
                external_req_id=external_req_id,
                parent=parent,
                index=index,
                prompt=prompt,
                prompt_token_ids=engine_request.prompt_token_ids,
                output_kind=params.output_kind,
                detokenizer=IncrementalDetokenizer(self.tokenizer, params),
                logprobs=LogprobsProcessor(self.tokenizer, params),
                metrics=RequestMetrics(engine_request.arrival_time),
                queue=queue,
            )
        return engine_requests

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget requests (user ids); returns the engine-core ids to abort."""
        engine_ids = [i for request_id in request_ids for i in self.external_req_ids.pop(request_id, ())]
        for engine_id in engine_ids:
            del self.request_states[engine_id]
        return engine_ids

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def process_outputs(self, engine_core_outputs: EngineCoreOutputs, stats: EngineStats) -> OutputProcessorOutput:
        """One engine-core step's outputs: recorded in `stats`, turned into RequestOutputs, which
        go to their requests' queues or, for requests without one, into the result."""
        stats.record_scheduler_stats(engine_core_outputs.scheduler_stats)
        result = OutputProcessorOutput()
        for output in engine_core_outputs.outputs:
            state = self.request_states.get(output.request_id)
            if state is None:  # aborted, or finished here by a stop string, meanwhile
                continue
            if output.new_token_ids:
                if not state.detokenizer.output_token_ids:
                    state.metrics.first_token_time = time.monotonic()
                    stats.record_first_token(len(state.prompt_token_ids), state.metrics)
                    state.num_cached_tokens = output.num_cached_tokens
                stats.record_new_tokens(len(output.new_token_ids))
            state.logprobs.update(output.new_logprobs, output.new_prompt_logprobs)
            finish_reason, stop_reason = output.finish_reason, output.stop_reason
            stop_string = state.detokenizer.update(output.new_token_ids, finish_reason == FinishReason.STOP)
            if stop_string is not None:
                if finish_reason is None:
                    result.reqs_to_abort.append(output.request_id)
                finish_reason, stop_reason = FinishReason.STOP, stop_string
            finished = finish_reason is not None
            if finished:
                self._finish(state)
                state.metrics.finished_time = time.monotonic()
                stats.record_finished(str(finish_reason), state.metrics, len(state.detokenizer.output_token_ids))
            request_output = self._make_request_output(state, finish_reason, stop_reason, finished)
            if request_output is None:
                continue
            if state.parent is not None:
                completion = request_output.outputs[0]
                request_output = state.parent.add_completion(completion, finished, request_output)
                if request_output is None:
                    continue
            if state.queue is not None:
                state.queue.put_nowait(request_output)
            else:
                result.request_outputs.append(request_output)
        return result

    def _finish(self, state: RequestState) -> None:
        del self.request_states[state.request_id]
        engine_ids = self.external_req_ids[state.external_req_id]
        engine_ids.remove(state.request_id)
        if not engine_ids:  # its last sample: the user id is free again
            del self.external_req_ids[state.external_req_id]

    def propagate_error(self, error: BaseException) -> None:
        """Fail every request that has a queue (the engine died): its caller raises `error`."""
        for queue in {s.queue for s in self.request_states.values() if s.queue is not None}:
            queue.put_nowait(error)

    def _make_request_output(
        self, state: RequestState, finish_reason: FinishReason | None, stop_reason: int | str | None, finished: bool
    ) -> RequestOutput | None:
        kind = state.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        token_ids = state.detokenizer.output_token_ids
        logprobs = state.logprobs.logprobs
        prompt_logprobs = state.logprobs.prompt_logprobs
        if delta:
            token_ids = token_ids[state.num_sent_tokens :]
            logprobs = logprobs[state.num_sent_tokens :] if logprobs is not None else None
            state.num_sent_tokens += len(token_ids)
            if prompt_logprobs is not None:
                prompt_logprobs, state.num_sent_prompt_logprobs = (
                    prompt_logprobs[state.num_sent_prompt_logprobs :], len(prompt_logprobs)
                )
        completion = CompletionOutput(
            index=state.index,
            text=state.detokenizer.get_next_output_text(finished, delta),
            token_ids=list(token_ids),
            cumulative_logprob=state.logprobs.cumulative_logprob,
            logprobs=list(logprobs) if logprobs is not None else None,
            finish_reason=str(finish_reason) if finish_reason is not None else None,
            stop_reason=stop_reason,
        )
        return RequestOutput(
            request_id=state.external_req_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            prompt_logprobs=list(prompt_logprobs) if prompt_logprobs is not None else None,
            num_cached_tokens=state.num_cached_tokens,
            metrics=state.metrics,
        )
