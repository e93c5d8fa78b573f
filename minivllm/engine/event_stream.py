"""The front end's side of the engine's events: fan each step's EngineEvents out to the
watchers (the dashboard's SSE clients), and turn their collection in the engine core on and off.

The engine core collects events only while someone watches: the first subscriber turns
collection on (a utility call, which also asks for a full snapshot, as does every later
subscriber) and the last one to leave turns it off. Each step's message is encoded once (JSON,
as the SSE clients read it) and put in every subscriber's queue; a queue holds at most
QUEUE_SIZE messages and drops the oldest when a client falls behind, so a slow page costs
memory for QUEUE_SIZE messages, never more. The engine's periodic snapshot (core/events.py)
repairs what a page lost.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable

import msgspec

from minivllm.core.events import EngineEvents
from minivllm.core.outputs import SchedulerStats

QUEUE_SIZE = 256


class EventMessage(msgspec.Struct, gc=False):
    """One SSE message: the step's events and the scheduler stats /metrics reports after it."""

    events: EngineEvents
    stats: SchedulerStats


class EventSubscription:
    """One watcher's queue: the newest QUEUE_SIZE messages; `dropped` counts what it lost."""

    def __init__(self, maxlen: int = QUEUE_SIZE) -> None:
        self.messages: deque[bytes] = deque(maxlen=maxlen)
        self.dropped = 0
        self._ready = asyncio.Event()

    def put(self, message: bytes) -> None:
        if len(self.messages) == self.messages.maxlen:
            self.dropped += 1  # deque(maxlen) drops the oldest on append
        self.messages.append(message)
        self._ready.set()

    async def get(self) -> bytes:
        while not self.messages:
            self._ready.clear()
            await self._ready.wait()
        return self.messages.popleft()


class EngineEventStream:
    def __init__(self, set_collection: Callable[[bool], Awaitable[None]], maxlen: int = QUEUE_SIZE) -> None:
        """set_collection(True) turns collection on (and asks for a snapshot), False off."""
        self._set_collection = set_collection
        self._maxlen = maxlen
        self._subscribers: list[EventSubscription] = []
        self._lock = asyncio.Lock()  # on/off calls reach the engine in the order of (un)subscribing
        self._encoder = msgspec.json.Encoder()

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    async def subscribe(self) -> EventSubscription:
        subscription = EventSubscription(self._maxlen)
        async with self._lock:
            self._subscribers.append(subscription)
            await self._set_collection(True)
        return subscription

    def unsubscribe(self, subscription: EventSubscription) -> asyncio.Task[None]:
        """Synchronous (a cancelled stream's cleanup may not await): the engine is told in a
        task, if nobody is left by then."""
        self._subscribers.remove(subscription)
        return asyncio.get_running_loop().create_task(self._stop_if_unwatched())

    async def _stop_if_unwatched(self) -> None:
        async with self._lock:
            if not self._subscribers:
                await self._set_collection(False)

    def publish(self, events: EngineEvents, stats: SchedulerStats) -> None:
        if not self._subscribers:
            return  # late events of a collection being turned off
        message = b"data: " + self._encoder.encode(EventMessage(events, stats)) + b"\n\n"
        for subscription in self._subscribers:
            subscription.put(message)
