"""The batched sampler against plain-numpy references on crafted logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minivllm.sample.metadata import SamplingMetadata
from minivllm.sample.ops.topk_topp import apply_min_p

VOCAB = 8


def metadata(num_rows: int, *, temperature=1.0, top_k=None, top_p=None, min_p=None, greedy_rows=(),
             generators=None, logprobs=None) -> SamplingMetadata:
    temp = torch.full((num_rows,), float(temperature))
    is_greedy = torch.zeros(num_rows, dtype=torch.bool)
    is_greedy[list(greedy_rows)] = True
    temp[is_greedy] = 1.0

    def col(value, dtype):
        return None if value is None else torch.as_tensor(value, dtype=dtype).expand(num_rows).clone()

    return SamplingMetadata(
        temperature=temp,
        is_greedy=is_greedy if greedy_rows else None,
        all_greedy=len(greedy_rows) == num_rows,
        top_p=col(top_p, torch.float32),
        top_k=col(top_k, torch.int64),
        min_p=col(min_p, torch.float32),
        generators=generators or {},
        max_num_logprobs=logprobs,
    )


def softmax_np(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.fixture
def logits() -> torch.Tensor:
    rng = np.random.default_rng(0)
    return torch.from_numpy(rng.normal(size=(16, VOCAB)).astype(np.float32) * 2)


def kept_np_top_k(row: np.ndarray, k: int) -> set[int]:
    kth = np.sort(row)[::-1][k - 1]
    return {i for i, v in enumerate(row) if v >= kth}


def kept_np_top_p(row: np.ndarray, p: float) -> set[int]:
    """Smallest set of most likely tokens whose mass reaches p."""
    probs = softmax_np(row)
    kept, mass = set(), 0.0
    for i in np.argsort(-probs, kind="stable"):
        kept.add(int(i))
        mass += probs[i]
        if mass >= p:
            break
    return kept


@pytest.mark.parametrize("k", [1, 3, 5, VOCAB])
def test_top_k_mask(logits, k, sampler):
    out = sampler.top_k_top_p(logits, torch.full((16,), k), None)
    for row_in, row_out in zip(logits.numpy(), out.numpy(), strict=True):
        assert {i for i in range(VOCAB) if np.isfinite(row_out[i])} == kept_np_top_k(row_in, k)
        finite = np.isfinite(row_out)
        np.testing.assert_array_equal(row_out[finite], row_in[finite])


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 0.999])
def test_top_p_mask(logits, p, sampler):
    out = sampler.top_k_top_p(logits, None, torch.full((16,), p))
    for row_in, row_out in zip(logits.numpy(), out.numpy(), strict=True):
        assert {i for i in range(VOCAB) if np.isfinite(row_out[i])} == kept_np_top_p(row_in, p)


def test_top_k_then_top_p_per_row(logits, sampler):
    top_k = torch.tensor([2, 1 << 62] * 8)
    top_p = torch.tensor([1.0, 0.6] * 8)
    out = sampler.top_k_top_p(logits, top_k, top_p).numpy()
    for i, row in enumerate(logits.numpy()):
        kept = {j for j in range(VOCAB) if np.isfinite(out[i, j])}
        assert kept == (kept_np_top_k(row, 2) if i % 2 == 0 else kept_np_top_p(row, 0.6))


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 1.0])
def test_min_p_mask(logits, min_p):
    out = apply_min_p(logits, torch.full((16,), min_p)).numpy()
    probs = softmax_np(logits.numpy())
    expected = probs >= min_p * probs.max(-1, keepdims=True)
    np.testing.assert_array_equal(np.isfinite(out), expected)


def test_greedy_rows_take_argmax(logits, sampler):
    md = metadata(16, temperature=5.0, greedy_rows=range(0, 16, 2))
    sampled = sampler(logits, md).sampled_token_ids
    np.testing.assert_array_equal(sampled[::2].numpy(), logits[::2].argmax(-1).numpy())
    all_greedy = sampler(logits, metadata(16, greedy_rows=range(16))).sampled_token_ids
    np.testing.assert_array_equal(all_greedy.numpy(), logits.argmax(-1).numpy())


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_sampled_frequencies_match_softmax(temperature, sampler):
    """20k draws of one fixed distribution: empirical frequencies within 4 sigma of softmax(l/T)."""
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 0.2, 1.5])
    n = 20000
    torch.manual_seed(0)
    sampled = sampler(base.expand(n, VOCAB).clone(), metadata(n, temperature=temperature)).sampled_token_ids
    freq = np.bincount(sampled.numpy(), minlength=VOCAB) / n
    expected = softmax_np(base.numpy() / temperature)
    sigma = np.sqrt(expected * (1 - expected) / n)
    assert np.all(np.abs(freq - expected) <= 4 * sigma + 1e-4), (freq, expected)


def test_top_p_never_samples_outside_nucleus(sampler):
    base = torch.tensor([3.0, 2.5, 2.0, 0.0, -1.0, -1.0, -2.0, -5.0])
    n = 20000
    torch.manual_seed(1)
    sampled = sampler(base.expand(n, VOCAB).clone(), metadata(n, top_p=0.8)).sampled_token_ids
    nucleus = kept_np_top_p(base.numpy(), 0.8)
    assert set(sampled.unique().tolist()) == nucleus
    # Inside the nucleus the probabilities are renormalised.
    probs = softmax_np(base.numpy())
    idx = sorted(nucleus)
    expected = probs[idx] / probs[idx].sum()
    freq = np.bincount(sampled.numpy(), minlength=VOCAB)[idx] / n
    np.testing.assert_allclose(freq, expected, atol=0.015)


def test_seeded_rows_reproducible_whatever_the_batch(logits, sampler):
    def draw(rows: int, seeded_row: int) -> list[int]:
        g = torch.Generator().manual_seed(1234)
        md = metadata(rows, generators={seeded_row: g})
        batch = logits[:rows].clone()
        batch[seeded_row] = logits[0]
        return [int(sampler(batch.clone(), md).sampled_token_ids[seeded_row]) for _ in range(20)]

    alone = draw(1, 0)
    assert draw(16, 5) == alone
    assert draw(16, 11) == alone
    assert len(set(alone)) > 1  # it is a real random sequence, not a constant


def test_logprobs_are_raw_log_softmax(logits, sampler):
    md = metadata(16, temperature=0.7, top_k=3, logprobs=4)
    out = sampler(logits, md)
    ref = torch.log_softmax(logits, dim=-1)
    t = out.logprobs_tensors
    assert t.logprob_token_ids.shape == (16, 5)
    np.testing.assert_array_equal(t.logprob_token_ids[:, 0].numpy(), out.sampled_token_ids.numpy())
    np.testing.assert_allclose(t.logprobs.numpy(), ref.gather(1, t.logprob_token_ids).numpy(), rtol=1e-6)
    np.testing.assert_array_equal(t.logprob_token_ids[:, 1:].numpy(), ref.topk(4).indices.numpy())
    ranks = (ref > ref.gather(1, out.sampled_token_ids[:, None])).sum(-1) + 1
    np.testing.assert_array_equal(t.token_ranks.numpy(), ranks.numpy())
    assert (t.token_ranks <= 3).all()  # top_k=3 never samples below rank 3
