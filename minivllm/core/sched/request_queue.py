"""The waiting queue, in the order the scheduling policy admits requests.

"fcfs": arrival order, and a preempted request goes back to the head (it was admitted before
everything still waiting). "priority" (vLLM's scheduling_policy="priority"): the lowest
`priority` value first, ties by arrival time, so a preempted request simply takes its place
again.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator

from minivllm.config import SchedulingPolicy
from minivllm.core.request import Request


class RequestQueue(ABC):
    @abstractmethod
    def add_request(self, request: Request) -> None:
        """A new arrival."""

    @abstractmethod
    def prepend_request(self, request: Request) -> None:
        """A preempted request, back in the queue ahead of what its policy lets it pass."""

    @abstractmethod
    def peek_request(self) -> Request:
        """The next request to admit (the queue must not be empty)."""

    @abstractmethod
    def pop_request(self) -> Request:
        """Remove and return the next request to admit."""

    @abstractmethod
    def remove_requests(self, request_ids: set[str]) -> None:
        """Drop these requests (aborted), in one pass over the queue."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """The requests in admission order."""

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSRequestQueue(RequestQueue):
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._queue.append(request)

    def prepend_request(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek_request(self) -> Request:
        return self._queue[0]

    def pop_request(self) -> Request:
        return self._queue.popleft()

    def remove_requests(self, request_ids: set[str]) -> None:
        self._queue = deque(r for r in self._queue if r.request_id not in request_ids)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue(RequestQueue):
    """A heap of (priority, arrival time, request id, request): the id makes every key unique,
    so two requests never compare themselves."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, str, Request]] = []

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, request.request_id, request))

    def prepend_request(self, request: Request) -> None:
        # Its priority and arrival time already place it ahead of every later arrival of its
        # priority; nothing should jump the priority order.
        self.add_request(request)

    def peek_request(self) -> Request:
        return self._heap[0][-1]

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)[-1]

    def remove_requests(self, request_ids: set[str]) -> None:
        self._heap = [entry for entry in self._heap if entry[2] not in request_ids]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[-1] for entry in sorted(self._heap))


def create_request_queue(policy: SchedulingPolicy) -> RequestQueue:
    return PriorityRequestQueue() if policy == SchedulingPolicy.PRIORITY else FCFSRequestQueue()
