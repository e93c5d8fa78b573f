"""Benchmark workloads: lists of (prompt token ids, output length) built without any download."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class SampleRequest:
    prompt_token_ids: list[int]
    expected_output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def random_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    vocab_size: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
    input_len_range: tuple[int, int] | None = None,
) -> list[SampleRequest]:
    """vLLM's random dataset: lengths uniform in [len * (1 - r), len * (1 + r)] (or an explicit
    input length range), random token ids (never the first few ids, which are special tokens in
    most vocabularies), an optional shared random prefix."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}.")
    rng = np.random.default_rng(seed)
    low_token = min(100, vocab_size // 2)

    def lengths(mean: int, bounds: tuple[int, int] | None = None) -> np.ndarray:
        if bounds is None:
            bounds = (max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio))))
        return rng.integers(bounds[0], bounds[1] + 1, size=num_prompts)

    prefix = rng.integers(low_token, vocab_size, size=prefix_len).tolist()
    input_lens, output_lens = lengths(input_len, input_len_range), lengths(output_len)
    return [
        SampleRequest(prefix + rng.integers(low_token, vocab_size, size=int(n)).tolist(), int(m))
        for n, m in zip(input_lens, output_lens, strict=True)
    ]
