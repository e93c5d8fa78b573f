"""The worker's block tables: one per KV cache group, rows added, grown and moved as the batch
changes, and each token's slot (block id * block size + offset) against the formula."""

from __future__ import annotations

import numpy as np
import torch

from minivllm.worker.block_table import MultiGroupBlockTable


def test_rows_per_group_and_slot_mapping():
    tables = MultiGroupBlockTable(max_num_reqs=4, max_model_len=64, max_num_batched_tokens=32,
                                  block_sizes=[4, 4], device=torch.device("cpu"))
    tables.add_row(0, ([7, 3], [11, 12]))
    tables.add_row(1, ([5], [9]))
    tables.append_row(0, ([8], [13]))
    tables.append_row(1, ([2], [10]))
    tables.move_row(1, 2)  # a removal moved row 1 to row 2
    for g, expected in enumerate(([7, 3, 8], [11, 12, 13])):
        assert tables[g].block_table[0, : tables[g].num_blocks_per_row[0]].tolist() == expected
    assert tables[0].block_table[2, :2].tolist() == [5, 2] and tables[1].block_table[2, :2].tolist() == [9, 10]
    # Tokens: row 0 positions 5..9, row 2 positions 0..4.
    req_indices = np.array([0] * 5 + [2] * 5)
    positions = np.array([5, 6, 7, 8, 9, 0, 1, 2, 3, 4])
    blocks = {0: ([7, 3, 8], [5, 2]), 1: ([11, 12, 13], [9, 10])}
    for g in (0, 1):
        slots = tables[g].compute_slot_mapping(req_indices, positions)
        own = {0: blocks[g][0], 2: blocks[g][1]}
        expected = [own[r][p // 4] * 4 + p % 4 for r, p in zip(req_indices, positions, strict=True)]
        assert slots.dtype == np.int64 and slots.tolist() == expected
