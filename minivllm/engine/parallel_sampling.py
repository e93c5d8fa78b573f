"""n > 1: one user request fans out into n child requests that the engine core runs as usual.

The children share the prompt (and, with prefix caching, its KV blocks); a seeded parent gives
child i the seed `seed + i`, so the n samples differ but the whole request stays reproducible.
ParentRequest gathers the children's completions back into one RequestOutput.
"""

from __future__ import annotations

import msgspec

from minivllm.engine.messages import EngineCoreRequest
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams


class ParentRequest:
    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.params = params
        self.num_children = params.n
        self.completions: list[CompletionOutput | None] = [None] * params.n
        self.num_finished = 0

    def child_request_id(self, index: int) -> str:
        return f"{index}_{self.request_id}"

    def child_params(self, index: int) -> SamplingParams:
        seed = None if self.params.seed is None else self.params.seed + index
        return msgspec.structs.replace(self.params, n=1, seed=seed)

    @property
    def finished(self) -> bool:
        return self.num_finished == self.num_children

    def add_completion(
        self, completion: CompletionOutput, finished: bool, request_output: RequestOutput
    ) -> RequestOutput | None:
        """Fold one child's update in; return what the parent should emit now, if anything."""
        self.completions[completion.index] = completion
        self.num_finished += finished
        kind = self.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not self.finished:
            return None
        if kind == RequestOutputKind.DELTA:
            outputs = [completion]
        else:
            outputs = [c for c in self.completions if c is not None]
        request_output.outputs = outputs
        request_output.finished = self.finished
        return request_output


def fan_out(request: EngineCoreRequest) -> tuple[ParentRequest | None, list[EngineCoreRequest]]:
    """The engine-core requests for one user request: itself when n == 1, else n children
    (with the parent that gathers them)."""
    params = request.sampling_params
    if params.n == 1:
        return None, [request]
    parent = ParentRequest(request.request_id, params)
    children = [
        msgspec.structs.replace(request, request_id=parent.child_request_id(i), sampling_params=parent.child_params(i))
        for i in range(params.n)
    ]
    return parent, children
