"""How tensor parallelism splits a model, against hand-computed tables: the even split with
remainders, attention heads kept with their KV head (uneven, replicated, refused), and quantized
matrices narrowed by whole groups (their dequantized values equal the dense matrix's slice)."""

from __future__ import annotations

import pytest
import torch

from minivllm.model.layers.linear import head_shard, shard_range, split_unit
from minivllm.model.layers.quant import Q4_1Weight, Q8_0Weight


@pytest.mark.parametrize(("total", "world", "unit", "expected"), [
    (1536, 2, 32, [(0, 768), (768, 768)]),
    (10, 3, 1, [(0, 4), (4, 3), (7, 3)]),
    (96, 2, 32, [(0, 64), (64, 32)]),  # 3 groups: the first rank takes the extra one
    (49152, 4, 1, [(0, 12288), (12288, 12288), (24576, 12288), (36864, 12288)]),
])
def test_shard_range(total, world, unit, expected):
    assert [shard_range(total, world, rank, unit) for rank in range(world)] == expected


def test_shard_range_refuses_a_size_that_is_not_whole_units():
    with pytest.raises(ValueError, match="does not split into units of 32"):
        shard_range(100, 2, 0, 32)
    assert split_unit(1536) == 32 and split_unit(100) == 1


@pytest.mark.parametrize(("heads", "kv_heads", "world", "expected"), [
    # SmolLM2: 9 query heads in 3 groups of 3; 2 ranks take 2 groups and 1.
    (9, 3, 2, [(0, 6, 0, 2), (6, 3, 2, 1)]),
    (9, 3, 3, [(0, 3, 0, 1), (3, 3, 1, 1), (6, 3, 2, 1)]),
    (32, 8, 4, [(0, 8, 0, 2), (8, 8, 2, 2), (16, 8, 4, 2), (24, 8, 6, 2)]),
    # Gemma 3 270M: 4 query heads, 1 KV head, replicated on every rank.
    (4, 1, 2, [(0, 2, 0, 1), (2, 2, 0, 1)]),
    (4, 1, 4, [(0, 1, 0, 1), (1, 1, 0, 1), (2, 1, 0, 1), (3, 1, 0, 1)]),
    # 2 KV heads on 4 ranks: each replicated twice, its 4 query heads split 2 + 2.
    (8, 2, 4, [(0, 2, 0, 1), (2, 2, 0, 1), (4, 2, 1, 1), (6, 2, 1, 1)]),
])
def test_head_shard(heads, kv_heads, world, expected):
    assert [head_shard(heads, kv_heads, world, rank) for rank in range(world)] == expected


@pytest.mark.parametrize(("heads", "kv_heads", "world"), [(9, 3, 4), (6, 2, 4)])
def test_head_shard_refuses_what_does_not_divide(heads, kv_heads, world):
    """4 ranks over 3 KV heads cannot replicate evenly; 2 KV heads of 3 query heads each cannot
    share those between 2 replicas."""
    with pytest.raises(ValueError, match=f"tensor_parallel_size={world} does not divide the attention heads"):
        head_shard(heads, kv_heads, world, 0)


def _dequantize_q4_1(w: Q4_1Weight) -> torch.Tensor:
    return w.q.float() * w.scale.repeat_interleave(32, 1) + w.min.repeat_interleave(32, 1)


def test_quantized_matrices_narrow_by_rows_and_whole_groups():
    gen = torch.Generator().manual_seed(0)
    w = Q4_1Weight(torch.randint(0, 16, (8, 128), generator=gen, dtype=torch.int32),
                   torch.rand(8, 4, generator=gen), torch.rand(8, 4, generator=gen))
    dense = _dequantize_q4_1(w)
    assert torch.equal(_dequantize_q4_1(w.narrow(0, 2, 4)), dense[2:6])
    assert torch.equal(_dequantize_q4_1(w.narrow(1, 64, 64)), dense[:, 64:128])
    q8 = Q8_0Weight(torch.randint(-127, 128, (6, 64), generator=gen, dtype=torch.int8), torch.rand(6, 2).half())
    part = q8.narrow(0, 3, 3)
    assert torch.equal(part.q, q8.q[3:]) and torch.equal(part.scale, q8.scale[3:])
    with pytest.raises(ValueError, match="groups of 32 columns, not at 16..48"):
        w.narrow(1, 16, 32)
