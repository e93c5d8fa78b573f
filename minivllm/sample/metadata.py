"""Per-step sampling parameters of the rows being sampled, as device tensors.

Built by the worker's SamplingBatch from its persistent per-row state; a field is None when no
row uses it, so the sampler skips that operation entirely.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.sample.logits_processors import SparseLogitsEdits


@dataclass
class PenaltyState:
    """Penalty inputs of the penalised rows only (`rows` indexes the sampled rows)."""

    rows: torch.Tensor  # [num_penalised] int64
    prompt_mask: torch.Tensor  # [num_penalised, vocab] bool
    output_counts: torch.Tensor  # [num_penalised, vocab] int32
    repetition: torch.Tensor  # [num_penalised] float32
    frequency: torch.Tensor
    presence: torch.Tensor


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor | None  # [num_rows] float32; greedy rows hold 1.0; None if all greedy
    is_greedy: torch.Tensor | None  # [num_rows] bool; None if no row or every row is greedy
    all_greedy: bool
    top_p: torch.Tensor | None  # [num_rows] float32
    top_k: torch.Tensor | None  # [num_rows] int64, a huge value where disabled
    min_p: torch.Tensor | None  # [num_rows] float32
    # row -> generator, for the rows of seeded requests (reproducible whatever the batch)
    generators: dict[int, torch.Generator]
    max_num_logprobs: int | None  # largest `logprobs` asked for; None if nobody asked
    edits: SparseLogitsEdits | None = None  # logit_bias, allowed_token_ids, bad_words, min_tokens
    penalties: PenaltyState | None = None
