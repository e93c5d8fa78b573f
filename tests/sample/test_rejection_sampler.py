"""The rejection sampler: hand-computed greedy cases, and for random rows a chi-square test that
the emitted tokens follow the target's distributions whatever the drafter's."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from minivllm.sample.metadata import SamplingMetadata
from minivllm.sample.rejection_sampler import (
    PLACEHOLDER_TOKEN_ID,
    RejectionSampler,
    SpecDecodeMetadata,
)
from minivllm.sample.sampler import Sampler

VOCAB = 8


def metadata(num_rows: int, *, greedy_rows=None, generators=None, logprobs=None) -> SamplingMetadata:
    greedy = torch.zeros(num_rows, dtype=torch.bool)
    if greedy_rows is None:
        greedy[:] = True
    else:
        greedy[list(greedy_rows)] = True
    all_greedy = bool(greedy.all())
    return SamplingMetadata(
        temperature=None if all_greedy else torch.ones(num_rows),
        is_greedy=greedy if greedy.any() and not all_greedy else None,
        all_greedy=all_greedy, top_p=None, top_k=None, min_p=None,
        generators=generators or {}, max_num_logprobs=logprobs,
    )


def one_hot_logits(tokens: list[int]) -> torch.Tensor:
    """Rows whose argmax is the given token."""
    logits = torch.zeros(len(tokens), VOCAB)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


def run(drafts: list[list[int]], logits: torch.Tensor, meta: SamplingMetadata, draft_probs=None,
        sampler: Sampler | None = None) -> list[list[int]]:
    spec = SpecDecodeMetadata.make(drafts, torch.device("cpu"))
    out = RejectionSampler(sampler or Sampler())(logits, meta, spec, draft_probs).output_token_ids.tolist()
    return [[t for t in row if t != PLACEHOLDER_TOKEN_ID] for row in out]


# Target argmax per row; request rows are its k drafts' rows then its bonus row.
@pytest.mark.parametrize(("drafts", "argmaxes", "expected"), [
    ([[1, 2, 3]], [1, 2, 3, 4], [[1, 2, 3, 4]]),  # all accepted, then the bonus token
    ([[1, 2, 3]], [5, 2, 3, 4], [[5]]),  # first rejected: the target's token instead
    ([[1, 2, 3]], [1, 6, 3, 4], [[1, 6]]),  # partial: accepted up to the mismatch
    ([[1, 2, 3]], [1, 2, 7, 4], [[1, 2, 7]]),
    ([[]], [3], [[3]]),  # no drafts: plain greedy sampling
    ([[1, 2], [], [4]], [1, 0, 5, 6, 4, 2], [[1, 0], [6], [4, 2]]),
])
def test_greedy_cases(drafts, argmaxes, expected):
    assert run(drafts, one_hot_logits(argmaxes), metadata(len(argmaxes))) == expected


def test_greedy_rows_beside_random_rows_stay_greedy():
    # Request 0 is greedy (rows 0-2), request 1 random with all its mass on token 5 (rows 3-4).
    logits = one_hot_logits([1, 2, 3, 5, 5])
    logits[3:] = -1e9
    logits[3:, 5] = 0.0
    meta = metadata(5, greedy_rows=[0, 1, 2])
    for _ in range(20):
        assert run([[1, 4], [5]], logits, meta) == [[1, 2], [5, 5]]


def test_emitted_logprobs_are_per_row():
    logits = torch.randn(3, VOCAB)
    spec = SpecDecodeMetadata.make([[int(logits[0].argmax()), 0]], torch.device("cpu"))
    out = RejectionSampler(Sampler())(logits, metadata(3, logprobs=2), spec)
    expected = torch.log_softmax(logits, -1)
    tokens = out.output_token_ids[0]
    for row in range(int((tokens != PLACEHOLDER_TOKEN_ID).sum())):
        token = int(tokens[row])
        assert out.logprobs_tensors.logprob_token_ids[row, 0] == token
        assert out.logprobs_tensors.logprobs[row, 0] == pytest.approx(float(expected[row, token]), abs=1e-6)


def chi2_critical(dof: int, z: float = 4.75) -> float:
    """Wilson-Hilferty: the chi-square quantile at about 1e-6 upper tail."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = counts.sum() * probs
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_random_rows_follow_the_target_distribution(with_draft_probs, sampler):
    """Many requests with the same target rows p0, p1, p2 and drafts from q0, q1 (or fixed
    tokens for one-hot drafts): the first token follows p0, the second (after an accepted first
    draft) p1, the third (both accepted) p2, and none follows the drafter's distribution."""
    gen = torch.Generator().manual_seed(0)
    num_reqs, k = 30000, 2
    p = torch.softmax(torch.randn(k + 1, VOCAB, generator=gen) * 1.5, -1)
    p[1, 3] = 0.0  # a token the target never emits at position 1
    p[1] /= p[1].sum()
    q = torch.softmax(torch.randn(k, VOCAB, generator=gen) * 1.5, -1)
    if with_draft_probs:
        drafts = torch.stack([torch.multinomial(q[j], num_reqs, replacement=True, generator=gen) for j in range(k)], 1)
        draft_probs = q.repeat(num_reqs, 1)
    else:
        drafts = torch.tensor([[int(p[0].argmax()), int(p[1].argmax())]]).repeat(num_reqs, 1)
        draft_probs = None
    logits = torch.log(p).repeat(num_reqs, 1)
    out = run(drafts.tolist(), logits, metadata(num_reqs * (k + 1), greedy_rows=[]), draft_probs, sampler)

    first = np.bincount([row[0] for row in out], minlength=VOCAB)
    accepted_first = [row for row, d in zip(out, drafts.tolist(), strict=True) if len(row) > 1 and row[0] == d[0]]
    second = np.bincount([row[1] for row in accepted_first], minlength=VOCAB)
    third = np.bincount([row[2] for row in out if len(row) == 3], minlength=VOCAB)
    limit = chi2_critical(VOCAB - 1)
    assert chi2(first, p[0].numpy()) < limit
    assert chi2(second, p[1].numpy()) < chi2_critical(VOCAB - 2)
    assert third.sum() > 500 and chi2(third, p[2].numpy()) < limit
    if with_draft_probs:  # the test can tell distributions apart: q0 is rejected
        assert chi2(first, q[0].numpy()) > 10 * limit


def test_seeded_requests_repeat(sampler):
    logits = torch.randn(6, VOCAB)
    drafts = [[1, 2], [3, 4]]

    def sample():
        # A request's rows share its generator.
        first, second = torch.Generator().manual_seed(7), torch.Generator().manual_seed(9)
        generators = {0: first, 1: first, 2: first, 3: second, 4: second, 5: second}
        return run(drafts, logits, metadata(6, greedy_rows=[], generators=generators), sampler=sampler)

    results = [sample() for _ in range(3)]
    assert results[0] == results[1] == results[2]
