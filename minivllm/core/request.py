"""The scheduler's view of one request: its tokens, progress and state machine.

A Request is created by EngineCore.add_request from an EngineCoreRequest and lives until it
finishes or is aborted. The scheduler advances `num_computed_tokens` towards
`num_tokens_with_spec` step by step (prefill chunks, decode steps and the verification of draft
tokens are the same thing), appends sampled tokens, and moves it through
WAITING -> RUNNING -> (PREEMPTED -> RUNNING)* -> FINISHED_*, a structured-output request
first waiting in WAITING_FOR_FSM while its grammar compiles.
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minivllm.sampling_params import SamplingParams
    from minivllm.structured_output.request import StructuredOutputRequest


class FinishReason(enum.IntEnum):
    """Why a request finished; `str()` gives the OpenAI/vLLM name."""

    STOP = 0
    LENGTH = 1
    ABORT = 2

    def __str__(self) -> str:
        return ("stop", "length", "abort")[self]


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_FSM = enum.auto()  # structured output: its grammar is still compiling
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # NOTE: every status after PREEMPTED is a finished one.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> FinishReason | None:
        return _FINISHED_REASONS.get(status)


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


class Request:
    """Token-level state of one request inside the engine core."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        # Under scheduling_policy="priority": lower is admitted first, and preempted last.
        self.priority = priority
        # max_tokens None means "up to max_model_len"; the scheduler checks both.
        self.max_tokens = sampling_params.max_tokens if sampling_params.max_tokens else 1 << 62

        self.structured_output_request: StructuredOutputRequest | None = None
        if sampling_params.structured_outputs is not None:
            from minivllm.structured_output.request import StructuredOutputRequest

            self.structured_output_request = StructuredOutputRequest(sampling_params.structured_outputs)
        self.status = RequestStatus.WAITING_FOR_FSM if self.structured_output_request else RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        # Prefix caching: hashes of the full blocks of all_token_ids (filled lazily by the KV
        # manager), the salt that separates this request's cache entries, and how many prompt
        # tokens were found cached when it was first admitted.
        self.cache_salt = cache_salt
        self.block_hashes: list[bytes | int] = []
        self.num_cached_tokens = -1
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(prompt_token_ids)
        # Speculative decoding: draft tokens to verify after the last known token in the next
        # step (empty until a proposer exists); scheduling them hands them to the worker.
        self.spec_token_ids: list[int] = []

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        """Known tokens plus draft tokens: what a running request is scheduled towards."""
        return len(self._all_token_ids) + len(self.spec_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self._output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        return RequestStatus.get_finished_reason(self.status)
