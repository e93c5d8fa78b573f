"""Per-request edits of the logits that come before penalties: logit_bias, allowed_token_ids,
bad_words and min_tokens. Each is sparse (a few (row, token) pairs), gathered once per step by
the worker into index tensors, so applying one is a single index_put on the whole batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SparseLogitsEdits:
    """What to do to the logits of the sampled rows, as flat (row, token) index lists."""

    bias_rows: torch.Tensor | None = None  # logit_bias: logits[row, token] += value
    bias_tokens: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    allowed_rows: torch.Tensor | None = None  # rows restricted to allowed_token_ids ...
    allowed_mask: torch.Tensor | None = None  # ... [num_restricted, vocab] True = allowed
    banned_rows: torch.Tensor | None = None  # bad_words and min_tokens: logits[row, token] = -inf
    banned_tokens: torch.Tensor | None = None


def apply_logits_edits(logits: torch.Tensor, edits: SparseLogitsEdits) -> torch.Tensor:
    """Bias, then restrict to allowed tokens, then ban (in place; logits are the sampler's copy)."""
    if edits.bias_rows is not None:
        logits.index_put_((edits.bias_rows, edits.bias_tokens), edits.bias_values, accumulate=True)
    if edits.allowed_rows is not None:
        rows = logits[edits.allowed_rows]
        logits[edits.allowed_rows] = rows.masked_fill(~edits.allowed_mask, float("-inf"))
    if edits.banned_rows is not None:
        logits[edits.banned_rows, edits.banned_tokens] = float("-inf")
    return logits


def banned_bad_words(output_token_ids: list[int], bad_words_token_ids: list[list[int]]) -> list[int]:
    """Tokens that would complete a bad word now: a one-token word always; a longer word when the
    output ends with all its tokens but the last."""
    banned = []
    for word in bad_words_token_ids:
        prefix = word[:-1]
        if not prefix or output_token_ids[len(output_token_ids) - len(prefix) :] == prefix:
            banned.append(word[-1])
    return banned
