"""Cores per worker (executor/cpu_placement.py), hand-computed."""

from __future__ import annotations

from minivllm.executor.cpu_placement import cpus_of_rank


def test_ranks_split_the_cores():
    assert [cpus_of_rank([0, 1], 2, r) for r in range(2)] == [[0], [1]]
    assert [cpus_of_rank([0, 1, 2, 3, 4], 2, r) for r in range(2)] == [[0, 1, 2], [3, 4]]
    assert cpus_of_rank([4, 5, 6, 7], 1, 0) == [4, 5, 6, 7]


def test_more_ranks_than_cores_take_one_core_each_in_turn():
    assert [cpus_of_rank([0, 1], 4, r) for r in range(4)] == [[0], [1], [0], [1]]
