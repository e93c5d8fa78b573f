"""RMSNorm with an optional fused residual add (the pre-norm transformer's two hot ops), and
Gemma's variant."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.model.layers.custom_op import CustomOp
from minivllm.ops.cpu_kernels import VECTOR_ALIGN


class RMSNorm(CustomOp):
    gemma = False
    """Gemma's variant (GemmaRMSNorm): scale by 1 + w, in float32 before the cast back."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size) if self.gemma else torch.ones(hidden_size),
                                   requires_grad=False)
        self.use_cpu_kernels &= hidden_size % VECTOR_ALIGN == 0

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise x; with `residual`, first add it and also return the sum (the new residual)."""
        if residual is not None:
            # x is the previous sublayer's fresh output, so the sum can take its place.
            x = x.add_(residual)
            residual = x
        # NOTE: computed in float32 and cast back before the weight, as HF's Llama does, so that
        # bf16 results match the reference rounding (Gemma: after the weight, as HF's Gemma).
        # In-place ops on the new tensors: on CPU a broadcast multiply into a fresh bf16 tensor
        # costs about twice as much.
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)  # x * rsqrt(mean(x^2) + eps)
        if self.gemma:
            out = normed.mul_(self.weight.float() + 1.0).to(x.dtype)
        else:
            out = normed.to(x.dtype).mul_(self.weight)
        return out if residual is None else (out, residual)

    def forward_cpu(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Same values in one pass; with `residual`, both are updated in place (x: the normalised
        sum, residual: the sum), as vLLM's fused_add_rms_norm."""
        if residual is None:
            out = torch.empty(x.shape, dtype=x.dtype)
            torch.ops.minivllm_cpu.rms_norm(out, x, self.weight, self.eps, self.gemma)
            return out
        torch.ops.minivllm_cpu.fused_add_rms_norm(x, residual, self.weight, self.eps, self.gemma)
        return x, residual


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the checkpoint stores w and the norm scales by (1 + w), in float32 before
    the cast back, as HF's Gemma3RMSNorm."""

    gemma = True
