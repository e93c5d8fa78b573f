"""The sampler both ways: torch's ops, and the CPU platform's kernels (ops/csrc/argmax.cpp,
exponential_race.cpp, top_k_top_p.cpp), so every sampling test checks both."""

from __future__ import annotations

import pytest

from minivllm.platforms import get_platform
from minivllm.sample.sampler import Sampler


@pytest.fixture(params=["torch", "cpu kernels"])
def sampler(request) -> Sampler:
    """The sampler with torch's argmax, exponential_ and sort, and with the CPU platform's kernels."""
    if request.param == "torch":
        return Sampler()
    request.getfixturevalue("cpu_kernels")
    platform = get_platform("cpu")
    return Sampler(platform.argmax, platform.exponential_race_kernel(), platform.top_k_top_p_kernel())
