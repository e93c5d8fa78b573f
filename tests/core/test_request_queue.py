"""The waiting queue of each scheduling policy, against hand-written orders."""

from __future__ import annotations

import pytest
from core_utils import create_requests

from minivllm.config import SchedulingPolicy
from minivllm.core.sched.request_queue import create_request_queue


def ids(queue) -> list[str]:
    return [r.request_id for r in queue]


def test_fcfs_is_arrival_order_and_a_preempted_request_goes_first():
    a, b, c = create_requests(3)
    queue = create_request_queue(SchedulingPolicy.FCFS)
    for r in (a, b, c):
        queue.add_request(r)
    assert queue.peek_request() is a and ids(queue) == ["0", "1", "2"]
    assert queue.pop_request() is a
    queue.prepend_request(a)
    assert ids(queue) == ["0", "1", "2"] and len(queue) == 3
    queue.remove_requests({"1"})
    assert ids(queue) == ["0", "2"]


def test_priority_is_lowest_value_first_then_arrival():
    # Arrival times 0..4 (create_requests): priorities 2, 0, 2, -1, 0.
    reqs = create_requests(5, priority=[2, 0, 2, -1, 0])
    queue = create_request_queue(SchedulingPolicy.PRIORITY)
    for r in reversed(reqs):  # insertion order does not matter, only (priority, arrival)
        queue.add_request(r)
    assert ids(queue) == ["3", "1", "4", "0", "2"]
    assert [queue.pop_request().request_id for _ in range(2)] == ["3", "1"]
    queue.prepend_request(reqs[1])  # a preempted request takes its place again, no more
    assert ids(queue) == ["1", "4", "0", "2"]
    queue.remove_requests({"4", "0"})
    assert ids(queue) == ["1", "2"] and queue.peek_request() is reqs[1]
    assert [queue.pop_request().request_id for _ in range(2)] == ["1", "2"] and not queue


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority, got 'lifo'"):
        SchedulingPolicy.parse("lifo")
