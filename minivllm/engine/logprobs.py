"""Turning the engine core's logprob rows into vLLM's user-facing form, per request.

A position becomes a dict token id -> Logprob(logprob, rank, decoded_token) holding the chosen
token (sampled, or the actual prompt token) and the top-N alternatives. Prompt logprobs start
with None for the first prompt token, which nothing predicts.
"""

from __future__ import annotations

from typing import Any

from minivllm.core.outputs import LogprobsArrays
from minivllm.outputs import Logprob, PromptLogprobs, SampleLogprobs
from minivllm.sampling_params import SamplingParams


class LogprobsProcessor:
    def __init__(self, tokenizer: Any, params: SamplingParams) -> None:
        self.tokenizer = tokenizer if params.detokenize else None
        self.num_logprobs = params.logprobs
        self.num_prompt_logprobs = params.prompt_logprobs
        self.logprobs: SampleLogprobs | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.prompt_logprobs: PromptLogprobs | None = [None] if params.prompt_logprobs is not None else None

    def update(self, new_logprobs: LogprobsArrays | None, new_prompt_logprobs: LogprobsArrays | None) -> None:
        if new_logprobs is not None and self.logprobs is not None:
            positions = self._positions(new_logprobs, self.num_logprobs or 0)
            self.logprobs.extend(positions)
            assert self.cumulative_logprob is not None
            self.cumulative_logprob += float(new_logprobs.logprobs[:, 0].sum(dtype="float64"))
        if new_prompt_logprobs is not None and self.prompt_logprobs is not None:
            self.prompt_logprobs.extend(self._positions(new_prompt_logprobs, self.num_prompt_logprobs or 0))

    def _positions(self, rows: LogprobsArrays, num: int) -> list[dict[int, Logprob]]:
        width = num + 1
        ids_rows = rows.logprob_token_ids[:, :width].tolist()
        values_rows = rows.logprobs[:, :width].tolist()
        texts = self._decode_each(ids_rows)
        positions = []
        for ids, values, rank, words in zip(ids_rows, values_rows, rows.token_ranks.tolist(), texts, strict=True):
            position = {
                token_id: Logprob(value, i, word)
                for i, (token_id, value, word) in enumerate(zip(ids[1:], values[1:width], words[1:], strict=True), 1)
            }
            position[ids[0]] = Logprob(values[0], rank, words[0])
            positions.append(position)
        return positions

    def _decode_each(self, ids_rows: list[list[int]]) -> list[list[str | None]]:
        if self.tokenizer is None:
            return [[None] * len(ids) for ids in ids_rows]
        flat = [[token_id] for ids in ids_rows for token_id in ids]
        words = iter(self.tokenizer.batch_decode(flat))
        return [[next(words) for _ in ids] for ids in ids_rows]
