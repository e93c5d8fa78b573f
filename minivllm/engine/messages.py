"""Messages from the front end to the engine core (msgspec structs: they cross processes as-is)."""

from __future__ import annotations

import msgspec

from minivllm.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A validated, tokenized request: everything the engine core needs, nothing else."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    # Separates this request's prefix-cache entries from other users' (vLLM's cache_salt).
    cache_salt: str | None = None
