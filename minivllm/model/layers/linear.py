"""Linear layers whose parameters know how to load themselves from a checkpoint.

Weights are kept in the [out_features, in_features] layout and applied with F.linear: that is the
fast layout for bf16 on CPU even for one-row (decode) inputs. Projections that read the same input
are fused into one matrix (q/k/v, gate/up); each fused parameter carries a `weight_loader` that
copies a checkpoint shard ("q", "k", "v", or an index) into its rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        default_weight_loader(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


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
