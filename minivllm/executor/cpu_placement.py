"""Which cores a worker's threads run on: tensor-parallel ranks on one machine split its cores, so
that two ranks' OpenMP threads do not take turns on the same ones (one core per rank on a 2-core
machine)."""

from __future__ import annotations

import os

from minivllm.model.layers.linear import shard_range


def cpus_of_rank(cpus: list[int], num_local_ranks: int, local_rank: int) -> list[int]:
    """The cores of a machine's local_rank-th worker: its share, or with more ranks than cores one
    core, dealt round-robin (ranks then take turns on it, one thread each)."""
    if len(cpus) < num_local_ranks:
        return [cpus[local_rank % len(cpus)]]
    start, size = shard_range(len(cpus), num_local_ranks, local_rank)
    return cpus[start:start + size]


def pin_to_cpus(cpus: list[int]) -> None:
    """Run this process, and torch's thread pool (one thread per core), on these cores."""
    import torch

    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))
