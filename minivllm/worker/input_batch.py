"""The persistent batch: one row of state per request the worker is running.

Rows survive across steps; each step applies only the diff (requests added, removed, grown by
new blocks or tokens). A removed row is filled by moving the last row into it, so the rows in
use are always 0..num_reqs-1 and every per-step array is a prefix slice.

NOTE: while a request has a row, its token ids live in the row (token_ids_cpu): the sampled
tokens of a step are recorded there, and only there, by append_sampled_token_ids (the sampling
state reads them from the row). When the row is given up (preemption, or a step that does not
schedule the request), its output tokens are copied back to the request's CachedRequestState,
which rebuilds the row when the request returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from minivllm.sampling_params import SamplingParams
from minivllm.worker.block_table import MultiGroupBlockTable
from minivllm.worker.sampling_batch import SamplingBatch


@dataclass
class CachedRequestState:
    """What the worker remembers of a request, in or out of the batch (preempted)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    generator: torch.Generator | None
    block_ids: tuple[list[int], ...]  # per KV cache group
    num_computed_tokens: int
    # Current only while the request has no batch row (see the module docstring).
    output_token_ids: list[int] = field(default_factory=list)
    # Prompt positions whose logprobs were already returned (a resumed request recomputes its
    # prompt; its prompt logprobs must not be sent twice).
    num_prompt_logprobs_done: int = 0


class InputBatch:
    def __init__(
        self, max_num_reqs: int, max_model_len: int, max_num_batched_tokens: int, block_sizes: list[int],
        vocab_size: int, device: torch.device,
    ) -> None:
        """block_sizes: tokens per block of each KV cache group."""
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.device = device
        self.req_ids: list[str] = []
        self.req_id_to_index: dict[str, int] = {}

        self.token_ids_cpu = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)  # prompt + output tokens known
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens_cpu = np.zeros(max_num_reqs, dtype=np.int32)
        self._row_arrays = (self.token_ids_cpu, self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens_cpu)
        self.block_table = MultiGroupBlockTable(max_num_reqs, max_model_len, max_num_batched_tokens, block_sizes, device)
        self.sampling = SamplingBatch(max_num_reqs, vocab_size, device, self.token_ids_cpu, self.num_prompt_tokens,
                                      self.num_tokens)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def add_request(self, state: CachedRequestState) -> int:
        row = len(self.req_ids)
        if row >= self.max_num_reqs:
            raise RuntimeError(f"InputBatch is full ({self.max_num_reqs} rows)")
        self.req_ids.append(state.req_id)
        self.req_id_to_index[state.req_id] = row

        num_prompt = len(state.prompt_token_ids)
        num_tokens = num_prompt + len(state.output_token_ids)
        self.token_ids_cpu[row, :num_prompt] = state.prompt_token_ids
        self.token_ids_cpu[row, num_prompt:num_tokens] = state.output_token_ids
        self.num_tokens[row] = num_tokens
        self.num_prompt_tokens[row] = num_prompt
        self.num_computed_tokens_cpu[row] = state.num_computed_tokens
        self.block_table.add_row(row, state.block_ids)
        self.sampling.add_row(row, state.sampling_params, state.generator, state.eos_token_id)
        return row

    def remove_request(self, req_id: str, state: CachedRequestState | None = None) -> None:
        """Drop a row, moving the last row into its place; `state`, for a request that will come
        back, gets the row's output tokens."""
        row = self.req_id_to_index.pop(req_id)
        if state is not None:
            state.output_token_ids = self.output_token_ids(row)
        last = len(self.req_ids) - 1
        last_req_id = self.req_ids.pop()
        if row != last:
            self.req_ids[row] = last_req_id
            self.req_id_to_index[last_req_id] = row
            for array in self._row_arrays:
                array[row] = array[last]
            self.block_table.move_row(last, row)
            self.sampling.move_row(last, row)
        self.sampling.clear_row(last)

    def output_token_ids(self, row: int) -> list[int]:
        return self.token_ids_cpu[row, self.num_prompt_tokens[row] : self.num_tokens[row]].tolist()

    def append_sampled_token_ids(self, rows: np.ndarray, token_ids: list[list[int]]) -> None:
        """Record the tokens each of `rows` sampled this step (any number per row, in order)."""
        for row, new_ids in zip(rows.tolist(), token_ids, strict=True):
            start = int(self.num_tokens[row])
            # NOTE: a token at max_model_len ends its request and is never an input: not stored.
            end = min(start + len(new_ids), self.max_model_len)
            self.token_ids_cpu[row, start:end] = new_ids[: end - start]
            self.num_tokens[row] = start + len(new_ids)
        self.sampling.count_sampled(rows, token_ids)
