"""Output processing in the front end: engine-core outputs -> user-facing RequestOutputs.

Keeps each request's generated tokens and logprobs as they arrive, and detokenizes when the
request finishes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minivllm.core.outputs import EngineCoreOutput, LogprobsLists
from minivllm.engine.messages import EngineCoreRequest
from minivllm.outputs import CompletionOutput, Logprob, RequestOutput, SampleLogprobs
from minivllm.sampling_params import SamplingParams


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}

    def add_request(self, request: EngineCoreRequest, prompt: str | None) -> None:
        if request.request_id in self.request_states:
            raise ValueError(f"Request id {request.request_id!r} is already in the engine.")
        params = request.sampling_params
        self.request_states[request.request_id] = RequestState(
            request.request_id, prompt, request.prompt_token_ids, params,
            logprobs=[] if params.logprobs is not None else None,
            cumulative_logprob=0.0 if params.logprobs is not None else None,
        )

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.request_states.pop(request_id, None)

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        """Accumulate new tokens; return a RequestOutput for each request that finished."""
        finished = []
        for output in outputs:
            state = self.request_states.get(output.request_id)
            if state is None:  # aborted meanwhile
                continue
            state.output_token_ids.extend(output.new_token_ids)
            if output.new_logprobs is not None and state.logprobs is not None:
                self._append_logprobs(state, output.new_logprobs)
            if output.finished:
                del self.request_states[output.request_id]
                finished.append(self._make_request_output(state, output))
        return finished

    @staticmethod
    def _append_logprobs(state: RequestState, new: LogprobsLists) -> None:
        assert state.logprobs is not None and state.cumulative_logprob is not None
        for ids, values, rank in zip(new.logprob_token_ids, new.logprobs, new.sampled_token_ranks, strict=True):
            position = {token_id: Logprob(value, i) for i, (token_id, value) in enumerate(zip(ids[1:], values[1:], strict=True), 1)}
            position[ids[0]] = Logprob(values[0], rank)
            state.logprobs.append(position)
            state.cumulative_logprob += values[0]

    def _make_request_output(self, state: RequestState, output: EngineCoreOutput) -> RequestOutput:
        text = self.tokenizer.decode(state.output_token_ids, skip_special_tokens=state.params.skip_special_tokens)
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=state.output_token_ids,
            cumulative_logprob=state.cumulative_logprob,
            logprobs=state.logprobs,
            finish_reason=str(output.finish_reason),
            stop_reason=output.stop_reason,
        )
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[completion],
            finished=True,
        )
