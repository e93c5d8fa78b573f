"""A fused linear layer's GGUF codes (model/layers/linear.py load_quantized): Q8_0 shards (from
Q8_0 or Q5_0 files) make one Q8_0 matrix for steps of few rows, equal to the dequantized product;
shards of mixed kinds leave the layer on its dequantized weight."""

from __future__ import annotations

import pytest
import torch

from minivllm.model.layers.linear import MergedColumnParallelLinear
from minivllm.model.layers.quant import Q8_0_MAX_ROWS, Q4_1Weight, Q8_0Weight

pytestmark = pytest.mark.usefixtures("cpu_kernels")


def _q8_0(rows: int, cols: int, seed: int) -> Q8_0Weight:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (rows, cols), generator=gen, dtype=torch.int8)
    return Q8_0Weight(q, (torch.rand(rows, cols // 32, generator=gen) * 0.01).half())


def _dense(w: Q8_0Weight) -> torch.Tensor:
    return (w.q.float().view(w.q.shape[0], -1, 32) * w.scale.float()[..., None]).view(w.q.shape)


def _layer() -> MergedColumnParallelLinear:
    with torch.device("cpu"):
        torch.set_default_dtype(torch.bfloat16)
        try:
            return MergedColumnParallelLinear(64, {0: 48, 1: 80})
        finally:
            torch.set_default_dtype(torch.float32)


def test_q8_0_shards_run_as_one_matrix_for_few_rows():
    layer = _layer()
    gate, up = _q8_0(48, 64, 0), _q8_0(80, 64, 1)
    for shard_id, w in ((0, gate), (1, up)):
        layer.weight.weight_loader(layer.weight, _dense(w).bfloat16(), shard_id)
        layer.load_quantized(w, shard_id)
    assert isinstance(layer.quantized, Q8_0Weight) and layer.quantized.max_rows == Q8_0_MAX_ROWS
    x = torch.randn(Q8_0_MAX_ROWS, 64).bfloat16()
    exact = x.float() @ torch.cat([_dense(gate), _dense(up)]).T  # the codes' weights, unrounded
    out = layer(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), exact, rtol=1e-2, atol=1e-3)
    # More rows than the kernel's bound: the dequantized bfloat16 weight, same product.
    many = torch.randn(Q8_0_MAX_ROWS + 1, 64).bfloat16()
    torch.testing.assert_close(layer(many).float(), many.float() @ torch.cat([_dense(gate), _dense(up)]).T,
                               rtol=2e-2, atol=2e-2)


def test_mixed_kinds_keep_the_dequantized_weight():
    layer = _layer()
    layer.load_quantized(_q8_0(48, 64, 0), 0)
    q4 = Q4_1Weight(torch.zeros(80, 64, dtype=torch.int32), torch.ones(80, 2), torch.zeros(80, 2))
    layer.load_quantized(q4, 1)
    assert layer.quantized is None
