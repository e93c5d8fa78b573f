"""Repetition, frequency and presence penalties (vLLM's / OpenAI's definitions).

repetition_penalty r applies to tokens seen in the prompt or the output: positive logits are
divided by r, negative ones multiplied. frequency_penalty subtracts once per occurrence in the
output, presence_penalty once per distinct token in the output.
"""

from __future__ import annotations

import torch


def apply_penalties(
    logits: torch.Tensor,  # [num_rows, vocab] float32
    prompt_mask: torch.Tensor,  # [num_rows, vocab] bool: token occurs in the prompt
    output_counts: torch.Tensor,  # [num_rows, vocab] int32: occurrences in the output so far
    repetition: torch.Tensor,  # [num_rows]
    frequency: torch.Tensor,  # [num_rows]
    presence: torch.Tensor,  # [num_rows]
) -> torch.Tensor:
    output_mask = output_counts > 0
    seen = prompt_mask | output_mask
    rep = torch.where(seen, repetition.unsqueeze(1), 1.0)
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits = logits - frequency.unsqueeze(1) * output_counts
    return logits - presence.unsqueeze(1) * output_mask
