"""The sampling half of the persistent batch: each row's sampling parameters and penalty state.

Per-row numbers live in numpy arrays (sliced per step, never rebuilt from Python objects).
Each row's tokens are the InputBatch's (its token table, shared here by reference). Penalty
state — which tokens the prompt holds, how often each was generated — lives in device tensors
allocated the first time a request asks for a penalty, and is updated incrementally: one
scatter-add of the sampled tokens per step.
"""

from __future__ import annotations

import numpy as np
import torch

from minivllm.sample.logits_processors import SparseLogitsEdits, banned_bad_words
from minivllm.sample.metadata import PenaltyState, SamplingMetadata
from minivllm.sampling_params import SamplingParams
from minivllm.torch_utils import to_device

_NO_TOP_K = 1 << 62


class SamplingBatch:
    def __init__(
        self, max_num_reqs: int, vocab_size: int, device: torch.device, token_ids: np.ndarray,
        num_prompt_tokens: np.ndarray, num_tokens: np.ndarray,
    ) -> None:
        """token_ids, num_prompt_tokens, num_tokens: the InputBatch's rows, read, never written."""
        self.vocab_size = vocab_size
        self.device = device
        self.token_ids = token_ids
        self.num_prompt_tokens = num_prompt_tokens
        self.num_tokens = num_tokens
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int32)  # -1: not asked
        self.num_prompt_logprobs = np.full(max_num_reqs, -1, dtype=np.int32)
        self.repetition = np.ones(max_num_reqs, dtype=np.float32)
        self.frequency = np.zeros(max_num_reqs, dtype=np.float32)
        self.presence = np.zeros(max_num_reqs, dtype=np.float32)
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.has_penalties = np.zeros(max_num_reqs, dtype=bool)
        self.has_edits = np.zeros(max_num_reqs, dtype=bool)  # logit_bias, allowed or bad words
        self._arrays = (
            self.temperature, self.top_p, self.top_k, self.min_p, self.num_logprobs,
            self.num_prompt_logprobs, self.repetition,
            self.frequency, self.presence, self.min_tokens, self.has_penalties, self.has_edits,
        )
        self.params: list[SamplingParams | None] = [None] * max_num_reqs
        self.stop_ids: list[list[int]] = [[] for _ in range(max_num_reqs)]  # banned under min_tokens
        self.generators: dict[int, torch.Generator] = {}
        # [max_num_reqs, vocab], allocated on the first penalised request.
        self.prompt_mask: torch.Tensor | None = None
        self.output_counts: torch.Tensor | None = None

    def add_row(self, row: int, params: SamplingParams, generator: torch.Generator | None,
                eos_token_id: int | None) -> None:
        """Fill `row` for a request whose tokens are already in the row."""
        self.temperature[row] = params.temperature
        self.top_p[row] = params.top_p
        self.top_k[row] = params.top_k
        self.min_p[row] = params.min_p
        self.num_logprobs[row] = -1 if params.logprobs is None else params.logprobs
        self.num_prompt_logprobs[row] = -1 if params.prompt_logprobs is None else params.prompt_logprobs
        self.repetition[row] = params.repetition_penalty
        self.frequency[row] = params.frequency_penalty
        self.presence[row] = params.presence_penalty
        self.min_tokens[row] = params.min_tokens
        self.has_edits[row] = bool(params.logit_bias or params.allowed_token_ids or params.bad_words_token_ids)
        self.has_penalties[row] = (
            params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
        )
        self.params[row] = params
        self.stop_ids[row] = params.get_stop_token_ids(eos_token_id)
        self.generators.pop(row, None)
        if generator is not None:
            self.generators[row] = generator
        if self.has_penalties[row]:
            self._init_penalty_row(row)

    def _output_token_ids(self, row: int) -> np.ndarray:
        return self.token_ids[row, self.num_prompt_tokens[row] : self.num_tokens[row]]

    def _init_penalty_row(self, row: int) -> None:
        if self.prompt_mask is None:
            shape = (len(self.temperature), self.vocab_size)
            self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
            self.output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
        assert self.output_counts is not None
        self.prompt_mask[row] = False
        prompt = self.token_ids[row, : self.num_prompt_tokens[row]].astype(np.int64)
        self.prompt_mask[row, torch.from_numpy(prompt).to(self.device)] = True
        self.output_counts[row] = 0
        output = self._output_token_ids(row)
        if len(output):  # a request resumed after preemption
            ids = torch.from_numpy(output.astype(np.int64)).to(self.device)
            self.output_counts[row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))

    def move_row(self, src: int, dst: int) -> None:
        for array in self._arrays:
            array[dst] = array[src]
        self.params[dst], self.params[src] = self.params[src], None
        self.stop_ids[dst] = self.stop_ids[src]
        self.generators.pop(dst, None)
        if src in self.generators:
            self.generators[dst] = self.generators.pop(src)
        if self.has_penalties[src] and self.prompt_mask is not None and self.output_counts is not None:
            self.prompt_mask[dst] = self.prompt_mask[src]
            self.output_counts[dst] = self.output_counts[src]

    def clear_row(self, row: int) -> None:
        self.params[row] = None
        self.generators.pop(row, None)
        self.has_penalties[row] = self.has_edits[row] = False
        self.num_prompt_logprobs[row] = -1

    def count_sampled(self, rows: np.ndarray, token_ids: list[list[int]]) -> None:
        """Count the tokens just sampled (any number per row) into the penalised rows' counts."""
        penalised = self.has_penalties[rows]
        if not penalised.any():
            return
        assert self.output_counts is not None
        batch_rows = [row for row, ids, p in zip(rows.tolist(), token_ids, penalised.tolist(), strict=True)
                      if p for _ in ids]
        tokens = [t for ids, p in zip(token_ids, penalised.tolist(), strict=True) if p for t in ids]
        self.output_counts.index_put_(
            (self._index(batch_rows), self._index(tokens)), torch.ones(len(tokens), dtype=torch.int32,
                                                                        device=self.device), accumulate=True
        )

    # ---- per-step metadata ------------------------------------------------------------------

    def make_metadata(self, rows: np.ndarray, draft_prefixes: list[list[int]] | None = None) -> SamplingMetadata:
        """Sampling parameters of `rows` (the batch rows sampled this step), in that order.

        Speculative decoding samples a row at several positions: `rows` then repeats it, and
        `draft_prefixes` gives each entry the draft tokens before its position, which count as
        output for min_tokens, bad words and penalties there."""
        max_num_logprobs = int(self.num_logprobs[rows].max()) if len(rows) else -1
        metadata = SamplingMetadata(
            temperature=None, is_greedy=None, all_greedy=True, top_p=None, top_k=None, min_p=None,
            generators={}, max_num_logprobs=None if max_num_logprobs < 0 else max_num_logprobs,
            edits=self._make_edits(rows, draft_prefixes), penalties=self._make_penalties(rows, draft_prefixes),
        )
        temperature = self.temperature[rows]
        is_greedy = temperature == 0.0
        if is_greedy.all():
            return metadata
        top_k, top_p, min_p = self.top_k[rows], self.top_p[rows], self.min_p[rows]
        metadata.all_greedy = False
        metadata.temperature = self._to_device(np.where(is_greedy, 1.0, temperature).astype(np.float32))
        metadata.is_greedy = self._to_device(is_greedy) if is_greedy.any() else None
        metadata.top_p = self._to_device(top_p) if (top_p < 1.0).any() else None
        metadata.top_k = self._to_device(np.where(top_k > 0, top_k, _NO_TOP_K)) if (top_k > 0).any() else None
        metadata.min_p = self._to_device(min_p) if (min_p > 0.0).any() else None
        # NOTE: a row sampled at several positions draws from its generator in position order.
        metadata.generators = {i: g for i, row in enumerate(rows.tolist()) if (g := self.generators.get(row))}
        return metadata

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.device)

    def _make_penalties(self, rows: np.ndarray, draft_prefixes: list[list[int]] | None) -> PenaltyState | None:
        penalised = self.has_penalties[rows]
        if not penalised.any():
            return None
        assert self.prompt_mask is not None and self.output_counts is not None
        batch_rows = self._to_device(rows[penalised].astype(np.int64))
        output_counts = self.output_counts[batch_rows]
        if draft_prefixes is not None:
            prefixes = [draft_prefixes[i] for i in np.flatnonzero(penalised).tolist()]
            entries = [j for j, prefix in enumerate(prefixes) for _ in prefix]
            if entries:
                tokens = [t for prefix in prefixes for t in prefix]
                output_counts.index_put_((self._index(entries), self._index(tokens)),
                                         torch.ones(len(tokens), dtype=torch.int32, device=self.device), accumulate=True)
        return PenaltyState(
            rows=self._to_device(np.flatnonzero(penalised)),
            prompt_mask=self.prompt_mask[batch_rows],
            output_counts=output_counts,
            repetition=self._to_device(self.repetition[rows][penalised]),
            frequency=self._to_device(self.frequency[rows][penalised]),
            presence=self._to_device(self.presence[rows][penalised]),
        )

    def _make_edits(self, rows: np.ndarray, draft_prefixes: list[list[int]] | None) -> SparseLogitsEdits | None:
        num_output = self.num_tokens[rows] - self.num_prompt_tokens[rows]
        if draft_prefixes is not None:
            num_output = num_output + np.fromiter(map(len, draft_prefixes), np.int32, len(rows))
        under_min = num_output < self.min_tokens[rows]
        needs = self.has_edits[rows] | under_min
        if not needs.any():
            return None
        bias: tuple[list[int], list[int], list[float]] = ([], [], [])
        allowed_rows: list[int] = []
        allowed_ids: list[list[int]] = []
        banned: tuple[list[int], list[int]] = ([], [])
        for i in np.flatnonzero(needs).tolist():
            row = int(rows[i])
            params = self.params[row]
            assert params is not None
            if params.logit_bias:
                bias[0].extend([i] * len(params.logit_bias))
                bias[1].extend(params.logit_bias)
                bias[2].extend(params.logit_bias.values())
            if params.allowed_token_ids:
                allowed_rows.append(i)
                allowed_ids.append(params.allowed_token_ids)
            tokens = list(self.stop_ids[row]) if under_min[i] else []
            if params.bad_words_token_ids:
                longest_prefix = max(len(word) for word in params.bad_words_token_ids) - 1
                output = self._output_token_ids(row).tolist() + (draft_prefixes[i] if draft_prefixes else [])
                tail = output[len(output) - min(longest_prefix, len(output)) :]
                tokens += banned_bad_words(tail, params.bad_words_token_ids)
            banned[0].extend([i] * len(tokens))
            banned[1].extend(tokens)
        edits = SparseLogitsEdits()
        if bias[0]:
            edits.bias_rows, edits.bias_tokens = self._index(bias[0]), self._index(bias[1])
            edits.bias_values = to_device(bias[2], self.device, torch.float32)
        if allowed_rows:
            mask = torch.zeros(len(allowed_rows), self.vocab_size, dtype=torch.bool, device=self.device)
            for j, ids in enumerate(allowed_ids):
                mask[j, self._index(ids)] = True
            edits.allowed_rows, edits.allowed_mask = self._index(allowed_rows), mask
        if banned[0]:
            edits.banned_rows, edits.banned_tokens = self._index(banned[0]), self._index(banned[1])
        return edits

    def _index(self, values: list[int]) -> torch.Tensor:
        return to_device(values, self.device, torch.int64)
