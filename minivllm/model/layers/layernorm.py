"""RMSNorm with an optional fused residual add (the pre-norm transformer's two hot ops)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise x; with `residual`, first add it and also return the sum (the new residual)."""
        if residual is not None:
            # x is the previous sublayer's fresh output, so the sum can take its place.
            x = x.add_(residual)
            residual = x
        # NOTE: computed in float32 and cast back before the weight, as HF does, so that bf16
        # results match the reference rounding. In-place ops on the new tensors: on CPU a
        # broadcast multiply into a fresh bf16 tensor costs about twice as much.
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)  # x * rsqrt(mean(x^2) + eps)
        out = normed.to(x.dtype).mul_(self.weight)
        return out if residual is None else (out, residual)
