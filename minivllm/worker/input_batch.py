"""The persistent batch: one row of state per request the worker is running.

Rows survive across steps; each step applies only the diff (requests added, removed, grown by
new blocks or tokens). A removed row is filled by moving the last row into it, so the rows in
use are always 0..num_reqs-1 and every per-step array is a prefix slice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from minivllm.sampling_params import SamplingParams
from minivllm.worker.sampling_batch import SamplingBatch


@dataclass
class CachedRequestState:
    """What the worker remembers of a request, in or out of the batch (preempted)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    generator: torch.Generator | None
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    # Prompt positions whose logprobs were already returned (a resumed request recomputes its
    # prompt; its prompt logprobs must not be sent twice).
    num_prompt_logprobs_done: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class InputBatch:
    def __init__(
        self, max_num_reqs: int, max_model_len: int, max_num_blocks_per_req: int, vocab_size: int,
        device: torch.device,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.device = device
        self.req_ids: list[str] = []
        self.req_id_to_index: dict[str, int] = {}

        self.token_ids_cpu = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)  # prompt + output tokens known
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens_cpu = np.zeros(max_num_reqs, dtype=np.int32)
        # Padded with 0, the null block.
        self.block_table = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)
        self._row_arrays = (
            self.token_ids_cpu, self.num_tokens, self.num_prompt_tokens,
            self.num_computed_tokens_cpu, self.block_table, self.num_blocks,
        )
        self.sampling = SamplingBatch(max_num_reqs, vocab_size, device)

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
        self.token_ids_cpu[row, :num_prompt] = state.prompt_token_ids
        self.token_ids_cpu[row, num_prompt : state.num_tokens] = state.output_token_ids
        self.num_tokens[row] = state.num_tokens
        self.num_prompt_tokens[row] = num_prompt
        self.num_computed_tokens_cpu[row] = state.num_computed_tokens
        self.num_blocks[row] = 0
        self.append_block_ids(row, state.block_ids)
        self.sampling.add_row(
            row, state.sampling_params, state.generator, state.eos_token_id,
            state.prompt_token_ids, state.output_token_ids,
        )
        return row

    def remove_request(self, req_id: str) -> None:
        """Drop a row, moving the last row into its place."""
        row = self.req_id_to_index.pop(req_id)
        last = len(self.req_ids) - 1
        last_req_id = self.req_ids.pop()
        if row != last:
            self.req_ids[row] = last_req_id
            self.req_id_to_index[last_req_id] = row
            for array in self._row_arrays:
                array[row] = array[last]
            self.sampling.move_row(last, row)
        self.sampling.clear_row(last)

    def append_block_ids(self, row: int, block_ids: list[int]) -> None:
        start = self.num_blocks[row]
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def append_token(self, row: int, token_id: int) -> None:
        n = self.num_tokens[row]
        if n < self.max_model_len:  # NOTE: a token at max_model_len ends the request; never an input
            self.token_ids_cpu[row, n] = token_id
        self.num_tokens[row] = n + 1
