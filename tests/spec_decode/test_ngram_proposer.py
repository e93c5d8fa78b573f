"""NgramProposer against a naive pure-Python prompt-lookup reference, plus hand-computed cases."""

from __future__ import annotations

import numpy as np
import pytest

from minivllm.spec_decode.ngram_proposer import NgramProposer


def reference(context: list[int], k: int, lo: int, hi: int, max_model_len: int) -> list[int]:
    """vLLM's rule spelled out: longest n first, then the earliest start, then copy what follows."""
    length = len(context)
    room = min(k, max_model_len - length)
    if room <= 0:
        return []
    for n in range(hi, lo - 1, -1):
        suffix = context[length - n :] if n <= length else None
        for i in range(length):
            if i + n >= length:
                break
            if context[i : i + n] == suffix:
                return context[i + n : i + n + room]
    return []


def propose_one(
    context: list[int], k: int, lo: int, hi: int, max_model_len: int = 1000
) -> list[int]:
    token_ids = np.full((1, max_model_len), -7, dtype=np.int32)
    token_ids[0, : len(context)] = context
    proposer = NgramProposer(k, lo, hi, max_model_len)
    return proposer.propose_rows(token_ids, np.array([len(context)], dtype=np.int32), np.array([0]))[0]


@pytest.mark.parametrize(
    ("context", "k", "lo", "hi", "expected"),
    [
        ([1, 2, 3, 4, 1, 2], 3, 2, 2, [3, 4, 1]),
        # The continuation runs into the end of the context.
        ([1, 2, 3, 1, 2], 5, 2, 2, [3, 1, 2]),
        ([5, 6, 5, 6], 4, 2, 2, [5, 6]),
        # The 3-gram [7, 1, 2] at 4 beats the earlier 2-gram [1, 2] at 0.
        ([1, 2, 9, 7, 1, 2, 8, 7, 1, 2], 2, 2, 3, [8, 7]),
        # Both occurrences of [1, 2] are 2-grams: the earliest wins.
        ([1, 2, 3, 1, 2, 4, 1, 2], 1, 1, 2, [3]),
        ([1, 2, 3, 4], 3, 1, 3, []),
        # Too short to hold both an occurrence and a following token.
        ([3, 3], 2, 2, 2, []),
        ([3], 2, 1, 1, []),
        ([3, 3], 2, 1, 1, [3]),
        # The last token matches but the 2-token suffix does not.
        ([1, 2, 3, 2], 2, 2, 4, []),
    ],
)
def test_hand_computed(context, k, lo, hi, expected):
    assert propose_one(context, k, lo, hi) == expected
    assert reference(context, k, lo, hi, 1000) == expected


def test_max_model_len_caps_the_draft():
    context = [1, 2, 3, 4, 1, 2]
    assert propose_one(context, 3, 2, 2, max_model_len=8) == [3, 4]
    assert propose_one(context, 3, 2, 2, max_model_len=7) == [3]
    assert propose_one(context, 3, 2, 2, max_model_len=6) == []


def test_returns_python_ints():
    draft = propose_one([1, 2, 1], 2, 1, 1)
    assert draft == [2, 1] and all(type(t) is int for t in draft)


@pytest.mark.parametrize(
    ("k", "lo", "hi", "option"),
    [
        (0, 1, 2, "num_speculative_tokens"),
        (3, 0, 2, "prompt_lookup_min"),
        (3, 3, 2, "prompt_lookup_max"),
    ],
)
def test_bad_constructor_args(k, lo, hi, option):
    with pytest.raises(ValueError, match=option):
        NgramProposer(k, lo, hi, max_model_len=100)


@pytest.mark.parametrize(
    ("k", "lo", "hi"), [(1, 1, 1), (3, 1, 3), (4, 2, 2), (5, 2, 5), (2, 3, 6), (7, 1, 8)]
)
@pytest.mark.parametrize("vocab", [4, 6])
def test_matches_reference_on_random_batches(k, lo, hi, vocab):
    rng = np.random.default_rng(1000 * k + 100 * lo + 10 * hi + vocab)
    max_model_len = 310
    num_rows = 40
    proposer = NgramProposer(k, lo, hi, max_model_len)
    for _ in range(10):
        # Garbage after num_tokens uses the same vocab, so reading past the end would change results.
        token_ids = rng.integers(0, vocab, size=(num_rows, max_model_len), dtype=np.int32)
        num_tokens = rng.integers(1, 301, size=num_rows).astype(np.int32)
        # Some rows sit at or near max_model_len so the cap truncates or empties their drafts.
        near_cap = rng.random(num_rows) < 0.25
        num_tokens[near_cap] = max_model_len - rng.integers(0, k + 1, size=int(near_cap.sum()))
        rows = np.sort(rng.choice(num_rows, size=25, replace=False))
        rng.shuffle(rows)
        drafts = proposer.propose_rows(token_ids, num_tokens, rows)
        assert len(drafts) == len(rows)
        for row, draft in zip(rows, drafts, strict=True):
            context = token_ids[row, : num_tokens[row]].tolist()
            assert draft == reference(context, k, lo, hi, max_model_len), (row, context)
