"""Data parallelism: N engine cores behind one front end (`data_parallel_size`).

Each core is its own process with its own scheduler, KV cache and copy of the model (and its own
tensor-parallel workers, if any), on its share of the machine's cores; the front end holds one
MP client per core. A new request goes to the core with the fewest unfinished requests (running
plus waiting, as the front end counts them: it knows what it sent and what finished), ties to
the lowest rank, like vLLM's DP load balancing; an abort goes to the core that has the request.
The front end sees one engine: each step's scheduler stats are summed over the cores' latest,
utility calls go to every core. Should any core die, the engine is dead: every caller gets
EngineDeadError (as in vLLM, where a DP group fails together).
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import zmq

from minivllm.core.outputs import Histogram, SchedulerStats, SpecDecodingStats
from minivllm.engine.core_client import AsyncMPClient, SyncMPClient
from minivllm.engine.messages import EngineCoreOutputs, EngineCoreRequest


def merge_scheduler_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """One engine's stats from several cores': counts summed, KV cache usage averaged (every
    core has a cache of the same size), histograms added bucket by bucket."""
    merged = SchedulerStats()
    for name in ("num_running_reqs", "num_waiting_reqs", "num_preemptions", "num_computed_tokens",
                 "prefix_cache_requests", "prefix_cache_queries", "prefix_cache_hits", "num_steps_over_budget"):
        setattr(merged, name, sum(getattr(s, name) for s in stats))
    merged.kv_cache_usage = sum(s.kv_cache_usage for s in stats) / len(stats)
    merged.step_seconds = _add_histograms([s.step_seconds for s in stats])
    merged.step_cost_error = _add_histograms([s.step_cost_error for s in stats])
    spec = [s.spec_decoding for s in stats if s.spec_decoding is not None]
    if spec:
        merged.spec_decoding = SpecDecodingStats(
            spec[0].num_spec_tokens,
            num_drafts=sum(s.num_drafts for s in spec),
            num_draft_tokens=sum(s.num_draft_tokens for s in spec),
            num_accepted_tokens=sum(s.num_accepted_tokens for s in spec),
            num_accepted_tokens_per_pos=[sum(col) for col in zip(*(s.num_accepted_tokens_per_pos for s in spec), strict=True)],
        )
    return merged


def _add_histograms(histograms: list[Histogram]) -> Histogram:
    return Histogram(histograms[0].buckets, [sum(col) for col in zip(*(h.counts for h in histograms), strict=True)],
                     sum(h.total for h in histograms), sum(h.count for h in histograms))


class _DPClient:
    """What the sync and async clients share: routing, counting, merging."""

    def __init__(self, clients: list[Any]) -> None:
        self.clients = clients
        self.owner: dict[str, int] = {}  # unfinished request -> its core
        self.load = [0] * len(clients)
        self.latest_stats: list[SchedulerStats | None] = [None] * len(clients)

    @property
    def vllm_config(self) -> Any:
        return self.clients[0].vllm_config

    @property
    def engine_dead(self) -> bool:
        return any(c.engine_dead for c in self.clients)

    def wait_for_ready(self) -> None:
        for client in self.clients:
            client.wait_for_ready()

    def _assign(self, request: EngineCoreRequest) -> Any:
        rank = min(range(len(self.clients)), key=self.load.__getitem__)
        self.owner[request.request_id] = rank
        self.load[rank] += 1
        return self.clients[rank]

    def _forget(self, request_id: str) -> int | None:
        rank = self.owner.pop(request_id, None)
        if rank is not None:
            self.load[rank] -= 1
        return rank

    def abort_requests(self, request_ids: list[str]) -> None:
        by_core: dict[int, list[str]] = {}
        for request_id in request_ids:
            rank = self._forget(request_id)
            if rank is not None:
                by_core.setdefault(rank, []).append(request_id)
        for rank, ids in by_core.items():
            self.clients[rank].abort_requests(ids)

    def _merged(self, rank: int, outputs: EngineCoreOutputs) -> EngineCoreOutputs:
        for output in outputs.outputs:
            if output.finished:
                self._forget(output.request_id)
        if outputs.scheduler_stats is not None:
            self.latest_stats[rank] = outputs.scheduler_stats
            outputs.scheduler_stats = merge_scheduler_stats([s for s in self.latest_stats if s is not None])
        return outputs

    @staticmethod
    def _combine(method: str, results: list[Any]) -> Any:
        if method == "get_scheduler_stats":
            merged = merge_scheduler_stats([msgspec.convert(r, SchedulerStats) for r in results])
            return msgspec.to_builtins(merged)
        if method == "reset_prefix_cache":
            return all(results)
        return results[0]

    def shutdown(self) -> None:
        for client in self.clients:
            client.shutdown()


class SyncDPClient(_DPClient):
    def __init__(self, clients: list[SyncMPClient]) -> None:
        super().__init__(clients)
        self._poller = zmq.Poller()
        for client in clients:
            self._poller.register(client.output_socket, zmq.POLLIN)
        self._next = 0  # the core whose outputs are taken first when several have some

    def add_request(self, request: EngineCoreRequest) -> None:
        self._assign(request).add_request(request)

    def get_output(self) -> EngineCoreOutputs:
        """The next step's outputs of any core (cores take turns when several have some)."""
        while True:
            ready = {socket for socket, _ in self._poller.poll(0 if self._has_pending() else None)}
            for offset in range(len(self.clients)):
                rank = (self._next + offset) % len(self.clients)
                client = self.clients[rank]
                if client._pending or client.output_socket in ready:
                    self._next = rank + 1
                    return self._merged(rank, client.get_output())

    def _has_pending(self) -> bool:
        return any(c._pending for c in self.clients)

    def call_utility(self, method: str, *args: Any) -> Any:
        return self._combine(method, [c.call_utility(method, *args) for c in self.clients])


class AsyncDPClient(_DPClient):
    def __init__(self, clients: list[AsyncMPClient]) -> None:
        super().__init__(clients)
        self._receiving: dict[asyncio.Task[EngineCoreOutputs], int] = {}

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        await self._assign(request).add_request_async(request)

    async def get_output_async(self) -> EngineCoreOutputs:
        """The first step's outputs any core sends; every core keeps one receive in flight."""
        waiting = set(self._receiving.values())
        for rank, client in enumerate(self.clients):
            if rank not in waiting:
                self._receiving[asyncio.ensure_future(client.get_output_async())] = rank
        done, _ = await asyncio.wait(self._receiving, return_when=asyncio.FIRST_COMPLETED)
        task = min(done, key=self._receiving.__getitem__)
        rank = self._receiving.pop(task)
        return self._merged(rank, task.result())

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        results = await asyncio.gather(*(c.call_utility_async(method, *args) for c in self.clients))
        return self._combine(method, list(results))

    def shutdown(self) -> None:
        for task in self._receiving:
            task.cancel()
        super().shutdown()
