"""Per-step sampling parameters of the rows being sampled, as device tensors.

Built by the InputBatch from its persistent per-row arrays; a field is None when no row uses
it, so that the sampler skips that operation entirely.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor | None  # [num_rows] float32; greedy rows hold 1.0; None if all greedy
    is_greedy: torch.Tensor | None  # [num_rows] bool; None if no row or every row is greedy
    all_greedy: bool
    top_p: torch.Tensor | None  # [num_rows] float32
    top_k: torch.Tensor | None  # [num_rows] int64, vocab_size where disabled
    min_p: torch.Tensor | None  # [num_rows] float32
    # row -> generator, for the rows of seeded requests (reproducible whatever the batch)
    generators: dict[int, torch.Generator]
    max_num_logprobs: int | None  # largest `logprobs` asked for; None if nobody asked
