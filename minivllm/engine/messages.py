"""Messages between the front end and the engine core (msgspec structs: they cross processes as-is).

Front end -> engine: a request-type byte frame, then the payload (EngineCoreRequest to add, a
list of ids to abort, or a UtilityCall). Engine -> front end: EngineCoreOutputs after every step
(and as the answer to a utility call), or the ENGINE_CORE_DEAD frame.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from minivllm.core.events import EngineEvents
from minivllm.core.outputs import EngineCoreOutput, SchedulerStats
from minivllm.sampling_params import SamplingParams

# Sent on the output channel when the engine process dies (by itself, or by its monitor).
ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"


class EngineCoreRequestType(bytes, enum.Enum):
    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A validated, tokenized request: everything the engine core needs, nothing else."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    # Separates this request's prefix-cache entries from other users' (vLLM's cache_salt).
    cache_salt: str | None = None
    # Under scheduling_policy="priority": lower first, ties by arrival (vLLM's request priority).
    priority: int = 0


class UtilityCall(msgspec.Struct, array_like=True, gc=False):
    """Call an EngineCore method by name (stats, reset_prefix_cache, shutdown...)."""

    call_id: int
    method: str
    args: tuple[Any, ...] = ()


class UtilityResult(msgspec.Struct, array_like=True, gc=False):
    call_id: int
    result: Any = None
    error: str | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Everything one engine-core step produced (or the answer to one utility call)."""

    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    utility_result: UtilityResult | None = None
    # The step's events, while a front end watches (start_event_collection): core/events.py.
    events: EngineEvents | None = None


class EngineReady(msgspec.Struct, gc=False):
    """The engine process's handshake: it loaded the model and sized the KV cache (or failed)."""

    num_gpu_blocks: int = 0
    error: str | None = None  # the exception's message
    error_type: str | None = None  # ValueError (bad configuration) or another exception's name
    error_traceback: str | None = None
