"""The persistent batch: one row of numpy state per request the worker is running.

Rows survive across steps; each step applies only the diff (requests added, removed, grown by
new blocks or tokens). A removed row is filled by moving the last row into it, so the rows in
use are always 0..num_reqs-1 and every per-step array is a prefix slice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from minivllm.sample.metadata import SamplingMetadata
from minivllm.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """What the worker remembers of a request, in or out of the batch (preempted)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_num_blocks_per_req: int, device: torch.device) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.device = device
        self.req_ids: list[str] = []
        self.req_id_to_index: dict[str, int] = {}

        self.token_ids_cpu = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)  # prompt + output tokens known
        self.num_computed_tokens_cpu = np.zeros(max_num_reqs, dtype=np.int32)
        # Padded with 0, the null block.
        self.block_table = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)

        self.temperature_cpu = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_p_cpu = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k_cpu = np.zeros(max_num_reqs, dtype=np.int64)
        self.min_p_cpu = np.zeros(max_num_reqs, dtype=np.float32)
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int32)  # -1: not asked
        self.generators: dict[int, torch.Generator] = {}
        self._row_arrays = (
            self.token_ids_cpu, self.num_tokens, self.num_computed_tokens_cpu, self.block_table,
            self.num_blocks, self.temperature_cpu, self.top_p_cpu, self.top_k_cpu, self.min_p_cpu,
            self.num_logprobs,
        )

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
        self.num_computed_tokens_cpu[row] = state.num_computed_tokens
        self.num_blocks[row] = 0
        self.append_block_ids(row, state.block_ids)

        params = state.sampling_params
        self.temperature_cpu[row] = params.temperature
        self.top_p_cpu[row] = params.top_p
        self.top_k_cpu[row] = params.top_k
        self.min_p_cpu[row] = params.min_p
        self.num_logprobs[row] = -1 if params.logprobs is None else params.logprobs
        if state.generator is not None:
            self.generators[row] = state.generator
        return row

    def remove_request(self, req_id: str) -> None:
        """Drop a row, moving the last row into its place."""
        row = self.req_id_to_index.pop(req_id)
        self.generators.pop(row, None)
        last = len(self.req_ids) - 1
        last_req_id = self.req_ids.pop()
        if row == last:
            return
        self.req_ids[row] = last_req_id
        self.req_id_to_index[last_req_id] = row
        for array in self._row_arrays:
            array[row] = array[last]
        if last in self.generators:
            self.generators[row] = self.generators.pop(last)

    def append_block_ids(self, row: int, block_ids: list[int]) -> None:
        start = self.num_blocks[row]
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def append_token(self, row: int, token_id: int) -> None:
        n = self.num_tokens[row]
        if n < self.max_model_len:  # NOTE: a token at max_model_len ends the request; never an input
            self.token_ids_cpu[row, n] = token_id
        self.num_tokens[row] = n + 1

    def make_sampling_metadata(self, rows: np.ndarray) -> SamplingMetadata:
        """Sampling parameters of `rows` (the rows sampled this step), in that order."""
        max_num_logprobs = int(self.num_logprobs[rows].max()) if len(rows) else -1
        max_num_logprobs_or_none = None if max_num_logprobs < 0 else max_num_logprobs
        temperature = self.temperature_cpu[rows]
        is_greedy = temperature == 0.0
        if is_greedy.all():
            return SamplingMetadata(None, None, True, None, None, None, {}, max_num_logprobs_or_none)

        def to_device(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(self.device)

        top_k = self.top_k_cpu[rows]
        top_p = self.top_p_cpu[rows]
        min_p = self.min_p_cpu[rows]
        row_of = {int(row): i for i, row in enumerate(rows)}
        return SamplingMetadata(
            temperature=to_device(np.where(is_greedy, 1.0, temperature).astype(np.float32)),
            is_greedy=to_device(is_greedy) if is_greedy.any() else None,
            all_greedy=False,
            top_p=to_device(top_p) if (top_p < 1.0).any() else None,
            top_k=to_device(np.where(top_k > 0, top_k, 1 << 62)) if (top_k > 0).any() else None,
            min_p=to_device(min_p) if (min_p > 0.0).any() else None,
            generators={row_of[row]: g for row, g in self.generators.items() if row in row_of},
            max_num_logprobs=max_num_logprobs_or_none,
        )
