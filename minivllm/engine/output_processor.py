"""Output processing in the front end: engine-core outputs -> user-facing RequestOutputs.

Per request it detokenizes incrementally, matches stop strings (a match finishes the request
here, and the engine core is told to abort it), converts logprobs, and shapes each output as
asked: the whole generation so far, only the new part, or one final output.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from minivllm.core.outputs import EngineCoreOutput
from minivllm.core.request import FinishReason
from minivllm.engine.detokenizer import IncrementalDetokenizer
from minivllm.engine.logprobs import LogprobsProcessor
from minivllm.engine.messages import EngineCoreRequest
from minivllm.engine.parallel_sampling import ParentRequest
from minivllm.metrics.stats import EngineStats
from minivllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from minivllm.sampling_params import RequestOutputKind


@dataclass
class RequestState:
    request_id: str
    parent: ParentRequest | None
    index: int
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    detokenizer: IncrementalDetokenizer
    logprobs: LogprobsProcessor
    metrics: RequestMetrics
    # How much of the token ids / logprobs / prompt logprobs earlier DELTA outputs already carried.
    num_sent_tokens: int = 0
    num_sent_prompt_logprobs: int = 0
    num_cached_tokens: int = 0


@dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput] = field(default_factory=list)
    # Requests finished here (stop strings) that the engine core is still running.
    reqs_to_abort: list[str] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}

    def add_request(
        self, request: EngineCoreRequest, prompt: str | None, parent: ParentRequest | None = None, index: int = 0
    ) -> None:
        if request.request_id in self.request_states:
            raise ValueError(f"Request id {request.request_id!r} is already in the engine.")
        params = request.sampling_params
        self.request_states[request.request_id] = RequestState(
            request_id=request.request_id,
            parent=parent,
            index=index,
            prompt=prompt,
            prompt_token_ids=request.prompt_token_ids,
            output_kind=params.output_kind,
            detokenizer=IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params),
            logprobs=LogprobsProcessor(self.tokenizer, params),
            metrics=RequestMetrics(request.arrival_time),
        )
        if parent is not None:
            self.parent_requests[parent.request_id] = parent

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget requests (user ids or child ids); returns the engine-core ids to abort."""
        engine_ids = []
        for request_id in request_ids:
            parent = self.parent_requests.pop(request_id, None)
            ids = [parent.child_request_id(i) for i in range(parent.num_children)] if parent else [request_id]
            for engine_id in ids:
                if self.request_states.pop(engine_id, None) is not None:
                    engine_ids.append(engine_id)
        return engine_ids

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def process_outputs(self, outputs: list[EngineCoreOutput], stats: EngineStats) -> OutputProcessorOutput:
        result = OutputProcessorOutput()
        for output in outputs:
            state = self.request_states.get(output.request_id)
            if state is None:  # aborted meanwhile
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
                del self.request_states[output.request_id]
                state.metrics.finished_time = time.monotonic()
                stats.record_finished(str(finish_reason), state.metrics, len(state.detokenizer.output_token_ids))
            request_output = self._make_request_output(state, finish_reason, stop_reason, finished)
            if request_output is None:
                continue
            if state.parent is not None:
                completion = request_output.outputs[0]
                request_output = state.parent.add_completion(completion, finished, request_output)
                if state.parent.finished:
                    self.parent_requests.pop(state.parent.request_id, None)
                if request_output is None:
                    continue
            result.request_outputs.append(request_output)
        return result

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
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            prompt_logprobs=list(prompt_logprobs) if prompt_logprobs is not None else None,
            num_cached_tokens=state.num_cached_tokens,
            metrics=state.metrics,
        )
