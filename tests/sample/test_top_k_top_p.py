"""The CPU truncation kernel (ops/csrc/top_k_top_p.cpp) at a real vocabulary's size against numpy:
top-k keeps the k largest logits and their ties; top-p, on what top-k leaves, keeps the smallest
set of most likely tokens whose mass reaches p (float64 sums). Peaked and flat rows (the nucleus
ends in a bucket of a few tokens or of thousands), rows already partly masked, a NaN row, per-row
parameters that turn either off; bad inputs are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.usefixtures("cpu_kernels")

VOCAB = 49152


def truncate(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.minivllm_cpu.top_k_top_p(logits, top_k, top_p)


def numpy_top_k(row: np.ndarray, k: int) -> np.ndarray:
    if k <= 0 or k >= row.size:
        return np.isfinite(row) | (row == np.inf)
    return row >= np.sort(row)[::-1][k - 1]


def numpy_top_p(row: np.ndarray, p: float) -> np.ndarray:
    """The smallest set of most likely tokens whose mass reaches p, in float64."""
    finite = row[np.isfinite(row)]
    probs = np.exp(row.astype(np.float64) - finite.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    count = int(np.searchsorted(np.cumsum(probs[order]), p)) + 1  # first prefix with mass >= p
    kept = np.zeros(row.size, dtype=bool)
    kept[order[:count]] = True
    return kept


def kept(out: torch.Tensor) -> np.ndarray:
    return np.isfinite(out.numpy())


@pytest.mark.parametrize("scale", [0.3, 1.0, 3.0, 8.0])  # flat to peaked rows
def test_top_p_against_numpy(scale: float):
    gen = torch.Generator().manual_seed(int(scale * 10))
    logits = torch.randn(6, VOCAB, generator=gen) * scale
    top_p = torch.tensor([0.05, 0.3, 0.6, 0.9, 0.95, 0.999])
    out = truncate(logits, None, top_p)
    for r in range(6):
        np.testing.assert_array_equal(kept(out[r]), numpy_top_p(logits[r].numpy(), float(top_p[r])))
    finite = kept(out)
    np.testing.assert_array_equal(out.numpy()[finite], logits.numpy()[finite])  # kept logits unchanged


@pytest.mark.parametrize("k", [1, 2, 50, 1000, VOCAB - 1, VOCAB, VOCAB + 5])
def test_top_k_against_numpy_with_ties(k: int):
    gen = torch.Generator().manual_seed(k % 1000)
    logits = torch.randint(-40, 40, (3, VOCAB), generator=gen).float() / 4  # many ties
    out = truncate(logits, torch.full((3,), k), None)
    for r in range(3):
        np.testing.assert_array_equal(kept(out[r]), numpy_top_k(logits[r].numpy(), k))


def test_top_k_then_top_p_on_what_top_k_leaves():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, VOCAB, generator=gen) * 2
    top_k, top_p = torch.tensor([40, 40, 1 << 62, 0]), torch.tensor([0.5, 1.0, 0.5, 0.8])
    out = truncate(logits, top_k, top_p)
    for r in range(4):
        row = logits[r].numpy()
        after_k = np.where(numpy_top_k(row, int(top_k[r])), row, -np.inf)
        expected = numpy_top_p(after_k, float(top_p[r])) if top_p[r] < 1 else np.isfinite(after_k)
        np.testing.assert_array_equal(kept(out[r]), expected)


def test_masked_tokens_nan_rows_and_inputs_left_alone():
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(3, VOCAB, generator=gen)
    logits[0, ::2] = -torch.inf  # banned tokens (bad_words, a grammar) stay out of the nucleus
    logits[1] = -torch.inf
    logits[1, 7] = 0.0  # one token allowed: it is the nucleus
    logits[2, 100] = torch.nan
    before = logits.clone()
    out = truncate(logits, torch.full((3,), 10), torch.full((3,), 0.7))
    assert torch.equal(logits.nan_to_num(), before.nan_to_num())  # the input is not written
    np.testing.assert_array_equal(kept(out[0]), numpy_top_p(np.where(numpy_top_k(logits[0].numpy(), 10),
                                                                     logits[0].numpy(), -np.inf), 0.7))
    assert kept(out[1]).nonzero()[0].tolist() == [7]
    assert torch.isnan(out[2, 100])  # top-p leaves a row with a NaN logit as it is, as the sort does


def test_strided_logits_are_read_as_values():
    gen = torch.Generator().manual_seed(7)
    wide = torch.randn(4, 2 * VOCAB, generator=gen) * 3
    logits = wide[:, ::2]
    out = truncate(logits, None, torch.full((4,), 0.9))
    for r in range(4):
        np.testing.assert_array_equal(kept(out[r]), numpy_top_p(logits[r].contiguous().numpy(), 0.9))


def test_bad_inputs_are_refused():
    logits = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="float32"):
        truncate(logits.double(), None, torch.full((2,), 0.5))
    with pytest.raises(RuntimeError, match="one value per row"):
        truncate(logits, torch.full((3,), 2), None)
    with pytest.raises(RuntimeError, match="one value per row"):
        truncate(logits, None, torch.full((2,), 0.5, dtype=torch.float64))
