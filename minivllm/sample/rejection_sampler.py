"""Verification of draft tokens: which of them the target accepts, and the token that follows.

A request that drafted k tokens has k + 1 logits rows in the step: row j (j < k) is the
target's distribution p_j at the position of draft token d_j (given the tokens before it), row k
the bonus row after the last draft. The output is exactly what sampling one token at a time from
the target would give (Leviathan et al., "Fast Inference from Transformers via Speculative
Decoding", 2023):

- greedy rows: accept d_j while it is the argmax of p_j; the first mismatch emits the argmax
  instead. Every emitted token is the argmax of its row, so the output is token for token that of
  plain greedy decoding.
- random rows: accept d_j with probability min(1, p_j(d_j) / q_j(d_j)), q being the drafter's
  distribution; the first rejection emits a draw from normalize(max(0, p_j - q_j)), the residual.
  Proposers that draft deterministically (n-gram lookup, argmax drafts) have q_j = one-hot(d_j):
  accept with probability p_j(d_j), and the residual is p_j without d_j.
- all k accepted: the bonus row's token is drawn from p_k as any sampled token.

Everything is batched tensor code over all rows of the step (requests without drafts are one
bonus row each); the only host copy is the caller's, of the output token ids. Random draws
(uniforms, the exponential race of sampler.py: Sampler.random_sample) come from each seeded
request's own generator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from minivllm.sample.metadata import SamplingMetadata
from minivllm.sample.sampler import (
    LogprobsTensors,
    Sampler,
    gather_logprobs,
)
from minivllm.torch_utils import to_device

PLACEHOLDER_TOKEN_ID = -1


@dataclass
class SpecDecodeMetadata:
    """Where the draft tokens and bonus rows of a step sit among its logits rows."""

    draft_token_ids: torch.Tensor  # [num_drafts] int64, request by request
    num_draft_tokens: list[int]  # per sampled request, 0 for a request without drafts
    draft_rows: torch.Tensor  # [num_drafts] int64: the logits row each draft token is checked on
    row_req: torch.Tensor  # [num_rows] int64: the request of each logits row
    row_pos: torch.Tensor  # [num_rows] int64: its position j in the request's k + 1 rows
    max_spec_len: int
    draft_rows_np: np.ndarray  # draft_rows on the host

    @classmethod
    def make(cls, draft_token_ids: list[list[int]], device: torch.device) -> SpecDecodeMetadata:
        """From each sampled request's drafts (in logits row order)."""
        num_drafts = np.fromiter(map(len, draft_token_ids), np.int64, len(draft_token_ids))
        rows_per_req = num_drafts + 1
        row_req = np.repeat(np.arange(len(rows_per_req)), rows_per_req)
        starts = np.cumsum(rows_per_req) - rows_per_req
        row_pos = np.arange(len(row_req)) - starts[row_req]
        draft_rows = np.flatnonzero(row_pos < num_drafts[row_req])
        flat_drafts = [t for ids in draft_token_ids for t in ids]

        def on_device(a: np.ndarray | list[int]) -> torch.Tensor:
            return to_device(a, device, torch.int64)

        return cls(on_device(flat_drafts), num_drafts.tolist(), on_device(draft_rows), on_device(row_req),
                   on_device(row_pos), int(num_drafts.max(initial=0)), draft_rows)


class RejectionSamplerOutput(NamedTuple):
    # [num_reqs, max_spec_len + 1]: each request's accepted drafts then one more token, padded
    # with PLACEHOLDER_TOKEN_ID.
    output_token_ids: torch.Tensor
    # One row per logits row, for the token that row emits (if it emits one): the caller keeps
    # the rows of the emitted tokens.
    logprobs_tensors: LogprobsTensors | None


class RejectionSampler(nn.Module):
    def __init__(self, sampler: Sampler) -> None:
        """`sampler`: the step's Sampler, whose logits processing and argmax apply row by row."""
        super().__init__()
        self.sampler = sampler

    def forward(
        self,
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        spec: SpecDecodeMetadata,
        draft_probs: torch.Tensor | None = None,
    ) -> RejectionSamplerOutput:
        """logits [num_rows, vocab] float32; `metadata` per logits row (each position with its
        own penalties and banned tokens, the request's generator on each of its rows);
        draft_probs [num_drafts, vocab], the drafter's distributions, or None for one-hot drafts."""
        raw_logprobs = torch.log_softmax(logits, dim=-1) if metadata.max_num_logprobs is not None else None
        logits = self.sampler.process_logits(logits, metadata)
        greedy_tokens = self.sampler.argmax(logits)
        # Greedy rows: a draft is accepted when it is the argmax, and every row emits its argmax.
        greedy_accepted = greedy_tokens[spec.draft_rows] == spec.draft_token_ids
        if metadata.all_greedy:
            token_per_row, accepted = greedy_tokens, greedy_accepted
        else:
            probs = self.sampler.compute_probs(logits, metadata)
            token_per_row, accepted = self._verify_random(probs, metadata, spec, draft_probs)
            if metadata.is_greedy is not None:
                token_per_row = torch.where(metadata.is_greedy, greedy_tokens, token_per_row)
                accepted = torch.where(metadata.is_greedy[spec.draft_rows], greedy_accepted, accepted)
        logprobs = None
        if raw_logprobs is not None:
            assert metadata.max_num_logprobs is not None
            logprobs = gather_logprobs(raw_logprobs, metadata.max_num_logprobs, token_per_row)
        return RejectionSamplerOutput(self._assemble(token_per_row, accepted, spec), logprobs)

    def _verify_random(
        self, probs: torch.Tensor, metadata: SamplingMetadata, spec: SpecDecodeMetadata,
        draft_probs: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's token (an accepted draft, a draw from the residual, or a bonus draw) and
        whether each draft is accepted, for rows sampled from `probs` [num_rows, vocab]."""
        drafts = spec.draft_token_ids.unsqueeze(1)
        target = probs[spec.draft_rows]
        p = target.gather(1, drafts).squeeze(1).double()
        if draft_probs is None:
            q = torch.ones_like(p)
            residual = target.scatter_(1, drafts, 0.0)  # target is a copy (advanced indexing)
        else:
            q = draft_probs.gather(1, drafts).squeeze(1).double()
            residual = (target - draft_probs).clamp_(min=0.0)
        # NOTE: float64 uniforms: a float32 draw can be exactly 0, which would accept a draft
        # the target gives probability 0.
        accepted = self._uniforms(spec, metadata.generators, probs.device) * q < p
        race = probs.clone()
        race[spec.draft_rows] = residual
        token_per_row = self.sampler.random_sample(race, metadata.generators)
        token_per_row[spec.draft_rows] = torch.where(accepted, spec.draft_token_ids, token_per_row[spec.draft_rows])
        return token_per_row, accepted

    @staticmethod
    def _uniforms(spec: SpecDecodeMetadata, generators: dict[int, torch.Generator], device: torch.device) -> torch.Tensor:
        """One U[0, 1) draw per draft token, from its request's generator where it has one."""
        u = torch.rand(len(spec.draft_rows_np), dtype=torch.float64, device=device)
        rows_of: dict[int, tuple[torch.Generator, list[int]]] = {}
        for row, generator in generators.items():
            rows_of.setdefault(id(generator), (generator, []))[1].append(row)
        for generator, rows in rows_of.values():
            index = np.flatnonzero(np.isin(spec.draft_rows_np, rows))
            if len(index):
                u[to_device(index, device)] = torch.rand(
                    len(index), dtype=torch.float64, device=device, generator=generator)
        return u

    @staticmethod
    def _assemble(token_per_row: torch.Tensor, accepted: torch.Tensor, spec: SpecDecodeMetadata) -> torch.Tensor:
        """[num_reqs, max_spec_len + 1]: each request's tokens up to its first rejected draft
        (which emits the row's other token) or its bonus row, then placeholders."""
        num_reqs = len(spec.num_draft_tokens)
        device = token_per_row.device
        draft_req, draft_pos = spec.row_req[spec.draft_rows], spec.row_pos[spec.draft_rows]
        num_accepted = to_device(spec.num_draft_tokens, device, torch.int64)
        # The first rejected position of each request (its draft count when none is rejected).
        num_accepted.scatter_reduce_(0, draft_req, torch.where(accepted, num_accepted[draft_req], draft_pos), "amin")
        output = torch.full((num_reqs, spec.max_spec_len + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
        emitted = spec.row_pos <= num_accepted[spec.row_req]
        output[spec.row_req, spec.row_pos] = torch.where(emitted, token_per_row, PLACEHOLDER_TOKEN_ID)
        return output
