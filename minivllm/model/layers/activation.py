"""SiLU-and-multiply over the fused gate/up projection: silu(gate) * up (Llama's MLP)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
