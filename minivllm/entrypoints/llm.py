"""LLM: the offline entry point — a list of prompts in, a list of RequestOutputs out, in order.

Requests are all added up front and the engine is stepped until every one has finished, so the
scheduler batches them continuously (finished requests leave, waiting ones join, every step).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import msgspec
from tqdm.auto import tqdm

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.processor import PromptType
from minivllm.metrics.reader import Metric
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams

ChatMessages = list[dict[str, Any]]


class LLM:
    """An offline engine. Keyword arguments are EngineArgs fields (vLLM's names)."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))
        self.request_counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def get_metrics(self) -> list[Metric]:
        """The engine's counters and gauges under vLLM's metric names."""
        return self.llm_engine.get_metrics()

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt: a string, a list of token ids, or a {"prompt"|"prompt_token_ids": ...} dict.
        `priority`, one per prompt, orders them under scheduling_policy="priority" (lower first)."""
        if isinstance(prompts, str | dict) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"Got {len(params_list)} SamplingParams for {len(prompts)} prompts; "
                    "give one, or one per prompt."
                )
        # Offline, only the finished outputs are wanted: skip building the intermediate ones.
        params_list = [
            msgspec.structs.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params_list
        ]
        if priority is None:
            priority = [0] * len(prompts)
        elif len(priority) != len(prompts):
            raise ValueError(f"Got {len(priority)} priorities for {len(prompts)} prompts; give one per prompt.")
        request_ids = self._add_requests(prompts, params_list, list(priority))
        return self._run_engine(request_ids, use_tqdm)

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations, formatted with the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.get_tokenizer()
        prompts: list[PromptType] = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(
                conversation,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                **(chat_template_kwargs or {}),
            )
            # The template already holds the special tokens; do not add a second BOS.
            token_ids = tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": token_ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _add_requests(self, prompts: list[PromptType], params_list: list[SamplingParams], priority: list[int]) -> list[str]:
        """Add all requests, or none: on a bad one, those already added are aborted."""
        request_ids: list[str] = []
        try:
            for prompt, params, request_priority in zip(prompts, params_list, priority, strict=True):
                request_id = str(next(self.request_counter))
                self.llm_engine.add_request(request_id, prompt, params, priority=request_priority)
                request_ids.append(request_id)
        except Exception:
            self.llm_engine.abort_request(request_ids)
            raise
        return request_ids

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        order = {request_id: i for i, request_id in enumerate(request_ids)}
        results: list[RequestOutput | None] = [None] * len(request_ids)
        num_output_tokens = 0
        with tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm, unit="req") as bar:
            while self.llm_engine.has_unfinished_requests():
                for output in self.llm_engine.step():
                    results[order[output.request_id]] = output
                    num_output_tokens += sum(len(c.token_ids) for c in output.outputs)
                    bar.update(1)
                    if use_tqdm:
                        rate = num_output_tokens / max(bar.format_dict["elapsed"], 1e-6)
                        bar.set_postfix_str(f"output {rate:.1f} tok/s")
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]
