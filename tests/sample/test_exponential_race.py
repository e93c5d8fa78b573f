"""The CPU race kernel (ops/csrc/exponential_race.cpp): each row's winner of the exponential race
argmax_i p_i / E_i, with E_i = -log(u_i) and u_i from SplitMix64 started at the row's seed.
Checked against a numpy reimplementation of that generator (the exact winner), and as a sampler:
its draws follow p (chi-square and binomial bounds), a seed repeats its draw wherever its row
sits, zero probabilities never win, NaN wins as in argmax; bad inputs are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minivllm.platforms import get_platform

pytestmark = pytest.mark.usefixtures("cpu_kernels")

MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15


def race(probs: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    return torch.ops.minivllm_cpu.exponential_race(probs, seeds)


def splitmix64_uniforms(seed: int, n: int) -> np.ndarray:
    """The first n outputs of SplitMix64 from state `seed`, as u = (top 23 bits + 0.5) / 2^23 in
    float32, the kernel's arithmetic: every u is strictly between 0 and 1."""
    with np.errstate(over="ignore"):
        z = (np.uint64(seed & MASK64) + np.arange(1, n + 1, dtype=np.uint64) * np.uint64(GAMMA))
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    u = ((z >> np.uint64(41)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-23)
    assert 0 < u.min() and u.max() < 1
    return u.astype(np.float64)


def test_the_largest_draw_does_not_make_a_zero_probability_win():
    """A seed whose first draw has all top 24 bits set (found by search): with 24-bit uniforms
    its u rounded to 1, E to 0, and token 0, of probability 0, won with 0 / 0 = NaN."""
    with np.errstate(over="ignore"):
        for start in range(0, 1 << 27, 1 << 22):
            z = np.arange(start, start + (1 << 22), dtype=np.uint64) + np.uint64(GAMMA)
            z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            hits = np.flatnonzero((z ^ (z >> np.uint64(31))) >> np.uint64(40) == (1 << 24) - 1)
            if hits.size:
                break
    seed = start + int(hits[0])
    assert race(torch.tensor([[0.0, 1.0]]), torch.tensor([seed])).tolist() == [1]


def chi2_critical(df: int) -> float:
    """Upper 0.1% point of chi-square (Wilson-Hilferty)."""
    z = 3.090
    return df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("n", [1, 15, 16, 17, 511, 512, 513, 1000, 49152])
def test_winner_is_the_reference_race(n: int):
    """The kernel's winner has the largest p / E of the reference draws (float64), up to float32
    rounding: the reference ratio of its pick is within 1e-5 of the reference maximum."""
    gen = torch.Generator().manual_seed(n)
    rows = 6
    probs = torch.softmax(torch.randn(rows, n, generator=gen) * 2, dim=-1)
    seeds = torch.randint(0, 2**62, (rows,), generator=gen)
    got = race(probs, seeds)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    for r in range(rows):
        ratios = probs[r].double().numpy() / -np.log(splitmix64_uniforms(int(seeds[r]), n))
        assert ratios[int(got[r])] >= ratios.max() * (1 - 1e-5), (r, int(got[r]), int(ratios.argmax()))


def test_draws_follow_p():
    """200k rows of one distribution, each with its own seed: token counts pass a chi-square test
    at 0.1%; with p of two tokens, the first wins within 4 sigma of its probability."""
    gen = torch.Generator().manual_seed(0)
    vocab, n = 50, 200_000
    p = torch.softmax(torch.randn(vocab, generator=gen) * 1.5, dim=-1)
    seeds = torch.randint(0, 2**62, (n,), generator=gen)
    counts = np.bincount(race(p.expand(n, vocab).contiguous(), seeds).numpy(), minlength=vocab)
    expected = p.double().numpy() * n
    assert ((counts - expected) ** 2 / expected).sum() < chi2_critical(vocab - 1)

    pair = torch.tensor([0.3, 0.7]).expand(n, 2).contiguous()
    wins = float((race(pair, seeds) == 0).double().mean())
    assert abs(wins - 0.3) <= 4 * np.sqrt(0.3 * 0.7 / n)


def test_a_seed_repeats_its_draw_wherever_its_row_is():
    gen = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(16, 3000, generator=gen), dim=-1)
    probs[:] = probs[0]
    seeds = torch.randint(0, 2**62, (16,), generator=gen)
    seeds[9] = seeds[2]
    got = race(probs, seeds)
    assert int(got[9]) == int(got[2]) == int(race(probs[:1], seeds[2:3])[0])
    assert len(set(got.tolist())) > 1  # other seeds, other draws: a random sequence


def test_zero_probabilities_never_win_and_nan_wins():
    gen = torch.Generator().manual_seed(2)
    n = 20_000
    p = torch.zeros(n, 1100)
    p[:, 700] = 0.5
    p[:, 1099] = 0.5  # in the scalar tail of the last block
    seeds = torch.randint(0, 2**62, (n,), generator=gen)
    assert set(race(p, seeds).unique().tolist()) == {700, 1099}
    odd = torch.rand(3, 1100, generator=gen)
    odd[0] = 0.0  # all zero: index 0, as argmax(p / q) gives
    odd[1, 600] = torch.nan
    odd[1, 900] = torch.nan
    odd[2, 1099] = torch.nan
    assert race(odd, seeds[:3]).tolist() == [0, 600, 1099]


def test_bad_inputs_are_refused():
    seeds = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="float32"):
        race(torch.rand(2, 8, dtype=torch.float64), seeds)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        race(torch.rand(8, 2).t(), seeds)
    with pytest.raises(RuntimeError, match="empty"):
        race(torch.rand(2, 0), seeds)
    with pytest.raises(RuntimeError, match="one seed per row"):
        race(torch.rand(3, 8), seeds)
    with pytest.raises(RuntimeError, match="one seed per row"):
        race(torch.rand(2, 8), seeds.int())


def test_cpu_platform_offers_the_kernel_only_when_kernels_are_on(monkeypatch):
    platform = get_platform("cpu")
    assert platform.exponential_race_kernel() is torch.ops.minivllm_cpu.exponential_race
    monkeypatch.setenv("MINIVLLM_CPU_KERNELS", "0")
    assert platform.exponential_race_kernel() is None
