"""Input processing in the front end: prompt -> validated, tokenized EngineCoreRequest.

Every check that can reject a request happens here, before the request reaches the engine core,
so that bad input is a ValueError for its caller and never disturbs the other requests.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import msgspec

from minivllm.config import ModelConfig, SchedulingPolicy, VllmConfig
from minivllm.engine.messages import EngineCoreRequest
from minivllm.engine.output_processor import OutputProcessor
from minivllm.sampling_params import SamplingParams, StructuredOutputsParams, is_int64

# What LLM.generate and LLMEngine.add_request accept as one prompt.
PromptType = str | list[int] | dict[str, Any]


class Processor:
    def __init__(self, model_config: ModelConfig, tokenizer: Any, scheduling_policy: str,
                 structured_outputs_backend: str = "auto", extra_eos_token_ids: Sequence[int] = ()) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.extra_eos_token_ids = list(extra_eos_token_ids)
        self.scheduling_policy = SchedulingPolicy.parse(scheduling_policy)
        self.structured_outputs_backend = structured_outputs_backend
        self.vocab_size = model_config.hf_config.vocab_size

    def process_inputs(
        self, request_id: str, prompt: PromptType, params: SamplingParams, arrival_time: float | None = None,
        priority: int = 0,
    ) -> tuple[EngineCoreRequest, str | None]:
        """Returns the engine request and the prompt text (None when given as token ids)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"Expected SamplingParams, got {type(params).__name__}.")
        if not is_int64(priority):
            raise ValueError(f"priority must be a 64-bit signed integer, got {priority!r}.")
        if priority != 0 and self.scheduling_policy != SchedulingPolicy.PRIORITY:
            raise ValueError(f"Got priority {priority}, but priority scheduling is not enabled "
                             "(scheduling_policy='priority').")
        self._validate_params(params)
        params = self._stop_at_extra_eos(params)
        prompt_text, prompt_token_ids = self._tokenize(prompt)
        self._validate_prompt(prompt_token_ids)
        if params.bad_words:
            params = msgspec.structs.replace(params, bad_words_token_ids=self._tokenize_bad_words(params.bad_words))
        if params.structured_outputs is not None:
            params = msgspec.structs.replace(params, structured_outputs=self._resolve_structured_outputs(params))
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            eos_token_id=self.tokenizer.eos_token_id,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
            cache_salt=prompt.get("cache_salt") if isinstance(prompt, dict) else None,
            priority=priority,
        )
        return request, prompt_text

    def _stop_at_extra_eos(self, params: SamplingParams) -> SamplingParams:
        """The model's other EOS ids (Gemma's <end_of_turn>) as stop_token_ids, as vLLM treats a
        generation_config's EOS list: the engine core knows one EOS id per request."""
        missing = [t for t in self.extra_eos_token_ids if t not in params.stop_token_ids]
        if params.ignore_eos or not missing:
            return params
        return msgspec.structs.replace(params, stop_token_ids=[*params.stop_token_ids, *missing])

    def _resolve_structured_outputs(self, params: SamplingParams) -> StructuredOutputsParams:
        """The constraint checked (a ValueError for one that cannot compile) and its backend
        chosen, here in the front end: the engine only compiles what will compile."""
        from minivllm.structured_output import resolve_backend

        so = params.structured_outputs
        assert so is not None
        return msgspec.structs.replace(so, backend=resolve_backend(so, self.structured_outputs_backend))

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
            raise ValueError("A prompt dict needs a 'prompt' or a 'prompt_token_ids' key.")
        if isinstance(prompt, list | tuple):
            return None, list(prompt)
        raise ValueError(f"Unsupported prompt type {type(prompt).__name__}.")

    def _validate_params(self, params: SamplingParams) -> None:
        max_logprobs = self.model_config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > max_logprobs:
                raise ValueError(f"Requested {name} of {value}, which is greater than max allowed: {max_logprobs}.")
        for name, ids in (
            ("logit_bias", list(params.logit_bias or ())),
            ("allowed_token_ids", params.allowed_token_ids or []),
            ("stop_token_ids", params.stop_token_ids or []),
        ):
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"{name} contains token id(s) {bad[:5]} out of the vocabulary (size {self.vocab_size}).")

    def _tokenize_bad_words(self, bad_words: list[str]) -> list[list[int]]:
        """Each bad word as token ids, both as a word of its own (" word") and glued to what
        precedes it ("word"): byte-level BPE tokenizes the two differently."""
        sequences: list[list[int]] = []
        for word in bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in sequences:
                    sequences.append(ids)
        return sequences

    def _validate_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("The prompt is empty; it must contain at least one token.")
        max_model_len = self.model_config.max_model_len
        if len(prompt_token_ids) > max_model_len:
            raise ValueError(
                f"The prompt (length {len(prompt_token_ids)}) is longer than the maximum model "
                f"length of {max_model_len}."
            )
        for token_id in prompt_token_ids:
            if not isinstance(token_id, int) or not 0 <= token_id < self.vocab_size:
                raise ValueError(f"Token id {token_id!r} is out of the vocabulary (size {self.vocab_size}).")


def start_front_end(vllm_config: VllmConfig, engine_core: Any) -> tuple[Any, Processor, OutputProcessor]:
    """Load the tokenizer and build the processors while the engine core starts; then wait for
    it. On any failure the engine core is shut down (no orphan process)."""
    try:
        # Imported only now, while the engine starts: transformers takes ~0.6 s to import.
        from minivllm.transformers_utils.tokenizer import extra_eos_token_ids, get_tokenizer

        tokenizer_path = vllm_config.model_config.tokenizer
        tokenizer = get_tokenizer(tokenizer_path)
        processor = Processor(vllm_config.model_config, tokenizer, vllm_config.scheduler_config.policy,
                              vllm_config.structured_outputs_config.backend,
                              extra_eos_token_ids(tokenizer_path))
        output_processor = OutputProcessor(tokenizer)
        engine_core.wait_for_ready()
    except BaseException:
        engine_core.shutdown()
        raise
    return tokenizer, processor, output_processor
