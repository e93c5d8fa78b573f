"""Structured output's token mask on the logits: a packed bitmask row per constrained row (int32
words, bit t % 32 of word t // 32 set when token t is allowed), everything else to -inf."""

from __future__ import annotations

import torch


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: row rows[i] of `logits` keeps only the tokens bitmask[i] allows."""
    vocab_size = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab_size]
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
