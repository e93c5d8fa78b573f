"""Batched sampling: one pass of tensor ops over all sampled rows, whatever their parameters.

Order: logprobs of the raw distribution (what vLLM reports by default) -> temperature -> min-p
-> top-k/top-p -> sample. Sampling uses the exponential-race trick, argmax(p / q) with
q ~ Exp(1), which draws from p without a device sync; seeded rows draw their q from their own
generator. Greedy rows take the argmax of the raw logits, selected per row by a mask.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from minivllm.sample.metadata import SamplingMetadata


class LogprobsTensors(NamedTuple):
    logprob_token_ids: torch.Tensor  # [num_rows, 1 + N] int64: sampled token, then the top-N
    logprobs: torch.Tensor  # [num_rows, 1 + N] float32
    sampled_token_ranks: torch.Tensor  # [num_rows] int64, 1-based


class SamplerOutput(NamedTuple):
    sampled_token_ids: torch.Tensor  # [num_rows] int64
    logprobs_tensors: LogprobsTensors | None


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """logits [num_rows, vocab] float32 -> one token per row."""
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        sampled = self.sample(logits, metadata)
        logprobs_tensors = None
        if raw_logprobs is not None:
            logprobs_tensors = gather_logprobs(raw_logprobs, metadata.max_num_logprobs, sampled)
        return SamplerOutput(sampled, logprobs_tensors)

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        if metadata.all_greedy:
            return logits.argmax(dim=-1)
        greedy = logits.argmax(dim=-1) if metadata.is_greedy is not None else None
        assert metadata.temperature is not None
        logits = logits / metadata.temperature.unsqueeze(1)
        if metadata.min_p is not None:
            logits = apply_min_p(logits, metadata.min_p)
        if metadata.top_k is not None or metadata.top_p is not None:
            logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
        probs = logits.softmax(dim=-1)
        random = exponential_race(probs, metadata.generators)
        if greedy is None:
            return random
        return torch.where(metadata.is_greedy, greedy, random)


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """argmax(p / q), q ~ Exp(1): an exact draw from each row's distribution p."""
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.exponential_()
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    return probs.div_(q).argmax(dim=-1)


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


def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int, sampled: torch.Tensor) -> LogprobsTensors:
    sampled_logprob = logprobs.gather(1, sampled.unsqueeze(1))
    ranks = (logprobs > sampled_logprob).sum(dim=-1) + 1
    if num_logprobs > 0:
        top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
        ids = torch.cat((sampled.unsqueeze(1), top_ids), dim=1)
        values = torch.cat((sampled_logprob, top_logprobs), dim=1)
    else:
        ids, values = sampled.unsqueeze(1), sampled_logprob
    return LogprobsTensors(ids, values, ranks)
