"""Linear layers whose parameters know how to load themselves from a checkpoint.

Weights are loaded in the [out_features, in_features] layout and applied with F.linear.
Projections that read the same input are fused into one matrix (q/k/v, gate/up); each fused
parameter carries a `weight_loader` that copies a checkpoint shard ("q", "k", "v", or an index)
into its rows. A layer loaded from GGUF Q4_1 also keeps the int4 codes and uses them for inputs
of few rows (see quant.py).

On CPU in bfloat16, F.linear runs oneDNN, which re-blocks the [out, in] weight into its GEMM
layout on every call. Where the platform says so (platforms/cpu.py: use_packed_linear),
`process_weights_after_loading` does that once: the weight becomes oneDNN's
packed tensor (same memory) and `linear` calls oneDNN's linear on it, through minivllm's
packed_linear op (ops/csrc/packed_linear.cpp), which decode traces can record. Same results bit
for bit; per call 2x faster at 1 row, 1.6x at 8, 1.1-1.2x at 64-512 rows (2-core AVX-512 CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.model.layers.quant import INT4_MAX_ROWS, Int4Weight, Q4_1Tiles, Q4_1Weight, pack_q4_1


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """A bfloat16 [out, in] weight in oneDNN's blocked GEMM layout, for `linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b), for a plain weight or one packed by pack_linear_weight."""
    if weight.is_mkldnn:
        return torch.ops.minivllm_cpu.packed_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    if param.shape != loaded_weight.shape:
        raise ValueError(f"Shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded_weight.shape)}")
    param.data.copy_(loaded_weight)


class Linear(nn.Module):
    """y = x W^T (+ b), parameters allocated uninitialised (they are always loaded)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)
        self.int4: Q4_1Tiles | Int4Weight | None = None
        self._q4_1_shards: dict[object, Q4_1Weight] = {}

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        default_weight_loader(param, loaded_weight)

    def load_q4_1(self, weight: Q4_1Weight, shard_id: object = None) -> None:
        """Keep one Q4_1 shard; once every shard of the matrix is in, pack them for a Q4_1 kernel."""
        self._q4_1_shards[shard_id] = weight
        order = [None] if shard_id is None else list(self.shard_offsets)  # shards: MergedLinear only
        if all(s in self._q4_1_shards for s in order):
            self.int4 = pack_q4_1([self._q4_1_shards[s] for s in order])
            self._q4_1_shards = {}

    def process_weights_after_loading(self) -> None:
        """Pack the weight for oneDNN (see the module docstring); called once, after loading."""
        self.weight = nn.Parameter(pack_linear_weight(self.weight), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int4 is not None and x.shape[0] <= INT4_MAX_ROWS:
            out = self.int4.matmul(x)
            return out if self.bias is None else out + self.bias
        return linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dimension.

    `shard_sizes` maps each shard id to its number of output rows, in stacking order.
    """

    def __init__(self, input_size: int, shard_sizes: dict[object, int], bias: bool = False) -> None:
        super().__init__(input_size, sum(shard_sizes.values()), bias)
        self.shard_offsets: dict[object, tuple[int, int]] = {}
        offset = 0
        for shard_id, size in shard_sizes.items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if shard_id is None:  # a checkpoint that already stores the fused matrix
            return default_weight_loader(param, loaded_weight)
        offset, size = self.shard_offsets[shard_id]
        default_weight_loader(param.data.narrow(0, offset, size), loaded_weight)


class QKVLinear(MergedLinear):
    """The fused query/key/value projection: [q (heads), k (kv_heads), v (kv_heads)] rows."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool) -> None:
        super().__init__(
            hidden_size,
            {"q": num_heads * head_dim, "k": num_kv_heads * head_dim, "v": num_kv_heads * head_dim},
            bias,
        )
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
