"""Batched sampling: one pass of tensor ops over all sampled rows, whatever their parameters.

Order: logprobs of the raw model distribution (what vLLM reports by default) -> logit_bias,
allowed_token_ids, bad_words -> min_tokens (EOS and stop ids banned) -> penalties ->
temperature -> min-p -> top-k/top-p -> sample. Sampling uses the exponential race, argmax(p / q)
with q ~ Exp(1), an exact draw from p without a device sync; seeded rows draw q from their own
generator. Where the platform has a race kernel (on CPU, ops/csrc/exponential_race.cpp: torch's
CPU exponential_ costs ~1 ms a row of a 49k vocabulary), q comes from a counter-based generator
keyed by one seed per row, and a seeded row draws that seed from its generator. Likewise top-k
and top-p use the platform's truncation kernel where it has one (on CPU,
ops/csrc/top_k_top_p.cpp: torch's path sorts every row, ~4 ms a row). Greedy rows take the argmax
of the processed logits, selected per row by a mask; a batch that is all greedy with no
processing is a single argmax.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from minivllm.core.outputs import LogprobsArrays
from minivllm.sample.logits_processors import apply_logits_edits
from minivllm.sample.metadata import SamplingMetadata
from minivllm.sample.ops.penalties import apply_penalties
from minivllm.sample.ops.topk_topp import TopKTopP, apply_min_p, apply_top_k_top_p


class LogprobsTensors(NamedTuple):
    logprob_token_ids: torch.Tensor  # [num_rows, 1 + N] int64: the chosen token, then the top-N
    logprobs: torch.Tensor  # [num_rows, 1 + N] float32
    token_ranks: torch.Tensor  # [num_rows] int64, 1-based rank of the chosen token

    def to_arrays(self) -> LogprobsArrays:
        """On the host, as ModelRunnerOutput carries them."""
        return LogprobsArrays(*(t.cpu().numpy() for t in self))


class SamplerOutput(NamedTuple):
    sampled_token_ids: torch.Tensor  # [num_rows] int64
    logprobs_tensors: LogprobsTensors | None


def torch_argmax(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=-1)


class Sampler(nn.Module):
    def __init__(self, argmax: Callable[[torch.Tensor], torch.Tensor] = torch_argmax,
                 race_kernel: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 top_k_top_p: TopKTopP | None = None) -> None:
        """argmax: each row's argmax; race_kernel: (probs, one int64 seed per row) -> each row's
        winner of an exponential race drawn from the seed, or None to race with torch's
        exponential_; top_k_top_p: a truncation kernel (apply_top_k_top_p's contract), or None
        for apply_top_k_top_p's sort. All from the device's platform (on CPU C++ kernels)."""
        super().__init__()
        self.argmax = argmax
        self.race_kernel = race_kernel
        self.top_k_top_p = top_k_top_p or apply_top_k_top_p

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """logits [num_rows, vocab] float32 -> one token per row."""
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = self.process_logits(logits, metadata)
        sampled = self.sample(logits, metadata)
        logprobs_tensors = None
        if raw_logprobs is not None:
            logprobs_tensors = gather_logprobs(raw_logprobs, metadata.max_num_logprobs, sampled)
        return SamplerOutput(sampled, logprobs_tensors)

    @staticmethod
    def process_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        if metadata.edits is not None:
            logits = apply_logits_edits(logits.clone(), metadata.edits)
        if metadata.penalties is not None:
            p = metadata.penalties
            logits = logits.clone() if metadata.edits is None else logits
            logits[p.rows] = apply_penalties(
                logits[p.rows], p.prompt_mask, p.output_counts, p.repetition, p.frequency, p.presence
            )
        return logits

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        if metadata.all_greedy:
            return self.argmax(logits)
        greedy = self.argmax(logits) if metadata.is_greedy is not None else None
        random = self.random_sample(self.compute_probs(logits, metadata), metadata.generators)
        if greedy is None:
            return random
        return torch.where(metadata.is_greedy, greedy, random)

    def compute_probs(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """The distribution a random row samples from: temperature, then min-p, top-k and top-p
        (greedy rows are computed at temperature 1 and ignored by the caller)."""
        assert metadata.temperature is not None
        logits = logits / metadata.temperature.unsqueeze(1)
        if metadata.min_p is not None:
            logits = apply_min_p(logits, metadata.min_p)
        if metadata.top_k is not None or metadata.top_p is not None:
            logits = self.top_k_top_p(logits, metadata.top_k, metadata.top_p)
        return logits.softmax(dim=-1)

    def random_sample(self, probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
        """One exact draw from each row of probs [num_rows, vocab]; a seeded row's from its
        generator, whatever else is in the batch."""
        if self.race_kernel is not None:
            return self.race_kernel(probs, race_seeds(probs.shape[0], generators))
        return self.argmax(exponential_race(probs, generators))


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """p / q, q ~ Exp(1), in place: its argmax is an exact draw from each row's distribution p."""
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.exponential_()
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    return probs.div_(q)


def race_seeds(num_rows: int, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """A race kernel's seeds: one draw per row, a seeded row's from its own generator (one draw
    per sampled step, so its tokens do not depend on the batch), the others' from torch's."""
    seeds = torch.empty(num_rows, dtype=torch.int64)
    if len(generators) < num_rows:
        seeds.random_()
    for row, generator in generators.items():
        seeds[row].random_(generator=generator)
    return seeds


def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor) -> LogprobsTensors:
    """The logprob and rank of `token_ids` (one per row), plus each row's top-`num_logprobs`."""
    token_logprob = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > token_logprob).sum(dim=-1) + 1
    if num_logprobs > 0:
        top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
        ids = torch.cat((token_ids.unsqueeze(1), top_ids), dim=1)
        values = torch.cat((token_logprob, top_logprobs), dim=1)
    else:
        ids, values = token_ids.unsqueeze(1), token_logprob
    return LogprobsTensors(ids, values, ranks)
