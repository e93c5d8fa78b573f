"""Truncation of the distribution: min-p, top-k and top-p, batched with per-row parameters."""

from __future__ import annotations

from collections.abc import Callable

import torch

# (logits [rows, vocab] float32, top_k [rows] int64 or None, top_p [rows] float32 or None) ->
# the logits with every token outside each row's top-k and then top-p set to -inf.
TopKTopP = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor | None], torch.Tensor]


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the most likely token's."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep the k most likely tokens, then the smallest set whose mass reaches p (one sort)."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)
    vocab_size = logits.shape[-1]
    if top_k is not None:
        # Ascending order: the k-th largest sits at index vocab - k. Ties with it are kept.
        kth = sorted_logits.gather(1, (vocab_size - top_k).clamp(min=0).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop the low tail whose total mass is at most 1 - p; the top token always stays.
        drop = cumulative <= (1 - top_p).unsqueeze(1)
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)
