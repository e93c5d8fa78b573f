"""Block tables in the worker: each batch row's block ids per KV cache group, and where each
scheduled token's K/V goes (its slot) in that group's cache (vLLM's worker/block_table.py).

Layers of different KV cache groups hold different blocks for the same token (a sliding-window
group frees blocks that left its window), so every group has its own table and slot mapping.
"""

from __future__ import annotations

import numpy as np
import torch

from minivllm.utils import cdiv
from minivllm.worker.buffers import CpuGpuBuffer


class BlockTable:
    """One KV cache group's tables: [max_num_reqs, max blocks per request] block ids, padded
    with the null block 0."""

    def __init__(self, max_num_reqs: int, max_model_len: int, max_num_batched_tokens: int, block_size: int,
                 device: torch.device) -> None:
        self.block_size = block_size
        self.buffer = CpuGpuBuffer((max_num_reqs, cdiv(max_model_len, block_size)), torch.int32, device)
        self.block_table = self.buffer.np
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)
        self.slot_mapping = CpuGpuBuffer(max_num_batched_tokens, torch.int64, device)

    def add_row(self, row: int, block_ids: list[int]) -> None:
        self.num_blocks_per_row[row] = 0
        self.append_row(row, block_ids)

    def append_row(self, row: int, block_ids: list[int]) -> None:
        start = self.num_blocks_per_row[row]
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks_per_row[row] = start + len(block_ids)

    def move_row(self, src: int, dst: int) -> None:
        self.block_table[dst] = self.block_table[src]
        self.num_blocks_per_row[dst] = self.num_blocks_per_row[src]

    def compute_slot_mapping(self, req_indices: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The cache slot of each scheduled token (its request's row, its position), written
        into the slot mapping's host buffer."""
        num_tokens = len(positions)
        block_numbers = self.block_table[req_indices, positions // self.block_size]
        return np.add(block_numbers.astype(np.int64) * self.block_size, positions % self.block_size,
                      out=self.slot_mapping.np[:num_tokens])


class MultiGroupBlockTable:
    """A BlockTable per KV cache group; block ids come and go as one tuple per request."""

    def __init__(self, max_num_reqs: int, max_model_len: int, max_num_batched_tokens: int, block_sizes: list[int],
                 device: torch.device) -> None:
        self.block_tables = [BlockTable(max_num_reqs, max_model_len, max_num_batched_tokens, block_size, device)
                             for block_size in block_sizes]

    def __getitem__(self, group_id: int) -> BlockTable:
        return self.block_tables[group_id]

    def __len__(self) -> int:
        return len(self.block_tables)

    def add_row(self, row: int, block_ids: tuple[list[int], ...]) -> None:
        for table, ids in zip(self.block_tables, block_ids, strict=True):
            table.add_row(row, ids)

    def append_row(self, row: int, block_ids: tuple[list[int], ...]) -> None:
        for table, ids in zip(self.block_tables, block_ids, strict=True):
            table.append_row(row, ids)

    def move_row(self, src: int, dst: int) -> None:
        for table in self.block_tables:
            table.move_row(src, dst)
