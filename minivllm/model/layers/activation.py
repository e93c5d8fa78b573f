"""Gated activations over the fused gate/up projection: act(gate) * up. SiLU for Llama's MLP,
GELU with the tanh approximation for Gemma's (HF's `gelu_pytorch_tanh`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.model.layers.custom_op import CustomOp
from minivllm.ops.cpu_kernels import VECTOR_ALIGN


class SiluAndMul(CustomOp):
    def __init__(self, intermediate_size: int) -> None:
        super().__init__()
        self.use_cpu_kernels &= intermediate_size % VECTOR_ALIGN == 0

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, 2 * d] (gate then up) -> [T, d]."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
        torch.ops.minivllm_cpu.silu_and_mul(out, x)
        return out


class GeluTanhAndMul(nn.Module):
    """gelu_tanh(gate) * up; torch only (a small share of a step next to the matmuls)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh").mul_(up)


def get_act_and_mul(hidden_act: str, intermediate_size: int) -> nn.Module:
    """The gated activation an HF config names (hidden_act, or Gemma's hidden_activation)."""
    if hidden_act == "silu":
        return SiluAndMul(intermediate_size)
    if hidden_act in ("gelu_pytorch_tanh", "gelu_tanh"):
        return GeluTanhAndMul()
    raise ValueError(f"Unsupported activation {hidden_act!r}; supported: silu, gelu_pytorch_tanh.")
