"""The front end's fan-out of engine events (engine/event_stream.py): bounded per-client queues
that drop the oldest, and collection turned on by the first watcher and off by the last."""

from __future__ import annotations

import asyncio
import json

import pytest

from minivllm.core.events import EngineEvents
from minivllm.core.outputs import SchedulerStats
from minivllm.engine.event_stream import EngineEventStream, EventSubscription


def _events(step: int) -> EngineEvents:
    return EngineEvents(step=step, start=0.0, end=1.0, token_budget=8)


def test_subscription_keeps_the_newest_and_counts_the_dropped():
    async def run():
        sub = EventSubscription(maxlen=3)
        for i in range(5):
            sub.put(b"%d" % i)
        assert sub.dropped == 2
        assert [await sub.get() for _ in range(3)] == [b"2", b"3", b"4"]
        waiter = asyncio.ensure_future(sub.get())
        await asyncio.sleep(0)
        assert not waiter.done()
        sub.put(b"5")
        assert await waiter == b"5"
    asyncio.run(run())


def test_collection_follows_the_watchers_and_slow_clients_lose_only_their_own():
    calls: list[bool] = []

    async def set_collection(on: bool) -> None:
        calls.append(on)

    async def run():
        stream = EngineEventStream(set_collection, maxlen=4)
        stream.publish(_events(0), SchedulerStats())  # nobody watches: nothing kept
        fast, slow = await stream.subscribe(), await stream.subscribe()
        assert calls == [True, True]  # each newcomer asks for a snapshot
        for step in range(10):
            stream.publish(_events(step), SchedulerStats(num_running_reqs=step))
            await fast.get()
        assert fast.dropped == 0 and slow.dropped == 6
        message = await slow.get()
        assert message.startswith(b"data: ") and message.endswith(b"\n\n")
        body = json.loads(message[len(b"data: "):])
        assert body["events"]["step"] == 6 and body["stats"]["num_running_reqs"] == 6
        await stream.unsubscribe(fast)
        assert calls == [True, True] and stream.num_subscribers == 1
        await stream.unsubscribe(slow)
        assert calls == [True, True, False]
    asyncio.run(run())


def test_data_parallel_engines_refuse_watchers():
    """One engine core's queues and block pool per page: data parallel refuses (the route
    answers 501), before anything reaches the cores."""
    from types import SimpleNamespace

    from minivllm.config import ParallelConfig
    from minivllm.engine.async_llm import AsyncLLM

    engine = SimpleNamespace(vllm_config=SimpleNamespace(parallel_config=ParallelConfig(data_parallel_size=2)))
    with pytest.raises(ValueError, match="data_parallel_size > 1"):
        asyncio.run(AsyncLLM.subscribe_events(engine))
