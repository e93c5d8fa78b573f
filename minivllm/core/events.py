"""What the engine core tells a watcher about each step: the dashboard's data and the trace's.

The EventCollector reads the scheduler after each step and describes it as one EngineEvents
message: the step (its time, its token budget split into prefill-chunk and decode tokens), what
happened to requests (arrived, scheduled chunks, first token, preempted, finished), the queues,
the KV blocks that changed state and the block tables that changed. It runs only while someone
watches (a dashboard, over a utility call) or traces (trace_dir): otherwise the engine core never
calls it and the block pool records nothing.

Sizes are bounded per step: the queues are capped, and the block map goes as a diff of the
blocks that changed; when more than MAX_BLOCK_CHANGES changed, or SNAPSHOT_INTERVAL_S passed, or
a watcher asked, a full snapshot (the map of the first MAX_MAP_BLOCKS blocks and every live
request, capped) goes instead, which also repairs a watcher that dropped messages.

Times are time.monotonic() seconds (the clock of Request.arrival_time and of the front end's
request metrics; on Linux the same clock as time.perf_counter()).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import msgspec

from minivllm.core.request import RequestStatus

if TYPE_CHECKING:
    from minivllm.core.block_pool import BlockPool
    from minivllm.core.outputs import EngineCoreOutput
    from minivllm.core.request import Request
    from minivllm.core.sched.output import SchedulerOutput
    from minivllm.core.sched.scheduler import Scheduler

MAX_QUEUE_IDS = 256  # request ids listed per queue per step
MAX_BLOCK_CHANGES = 4096  # changed blocks sent as a diff; more, and a snapshot goes instead
MAX_MAP_BLOCKS = 16384  # blocks in the map (the rest are counted in the usage, not drawn)
MAX_SNAPSHOT_REQUESTS = 1024
SNAPSHOT_INTERVAL_S = 2.0


def block_code(ref_cnt: int, hashed: bool) -> int:
    """One int per block: 2 * holders + (1 if it holds a prefix-cache hash). 0 is a free empty
    block, 1 a free cached one (evictable), >= 2 held (>= 4: shared by several requests)."""
    return 2 * ref_cnt + hashed


class ArrivedRequest(msgspec.Struct, gc=False):
    id: str
    prompt_len: int
    arrival: float


class ScheduledChunk(msgspec.Struct, gc=False):
    """A request's share of one step: a prefill chunk (prompt, or recomputation after a
    preemption) or a decode (the last known token, and draft tokens under speculative
    decoding)."""

    id: str
    tokens: int
    prefill: bool
    computed: int  # tokens computed after this step
    output_len: int = 0  # output tokens after this step


class FinishedRequest(msgspec.Struct, gc=False):
    id: str
    reason: str
    output_len: int


class RequestInfo(msgspec.Struct, gc=False):
    """A live request in a snapshot."""

    id: str
    status: str  # waiting, running, preempted
    prompt_len: int
    arrival: float
    computed: int
    output_len: int
    blocks: list[int]


class EngineEvents(msgspec.Struct, omit_defaults=True, gc=False):
    """One step of the engine core (or, with step -1, a snapshot of an idle engine)."""

    step: int
    start: float
    end: float
    token_budget: int
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    arrived: list[ArrivedRequest] = []
    scheduled: list[ScheduledChunk] = []
    first_token: list[str] = []
    preempted: list[str] = []
    finished: list[FinishedRequest] = []
    running: list[str] = []  # queue order, at most MAX_QUEUE_IDS
    waiting: list[str] = []
    # Block tables (first KV cache group) of requests whose blocks changed in this step.
    block_tables: dict[str, list[int]] = {}
    # [block id, block_code, ...] of the blocks that changed state (diff steps).
    block_changes: list[int] = []
    num_blocks: int = 0
    # Snapshot steps: the block_code of every block (the first MAX_MAP_BLOCKS), and every live
    # request (their block_tables are in the infos).
    block_map: list[int] | None = None
    requests: list[RequestInfo] | None = None


_STATUS_NAMES = {RequestStatus.RUNNING: "running", RequestStatus.PREEMPTED: "preempted"}


class EventCollector:
    """Describes each step of one scheduler as EngineEvents (see the module docstring)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.block_pool: BlockPool = scheduler.kv_cache_manager.block_pool
        self.block_pool.changed_block_ids = set()
        self.token_budget = scheduler.max_num_scheduled_tokens
        self.step_index = 0
        self._arrived: list[ArrivedRequest] = []
        self._finished: list[FinishedRequest] = []  # aborts between steps
        self._scheduled: list[ScheduledChunk] = []
        self._scheduled_requests: dict[str, Request] = {}
        self._preempted: list[str] = []
        self._block_tables: dict[str, list[int]] = {}
        self._start = time.monotonic()
        self._snapshot_due = True
        self._last_snapshot = 0.0

    def close(self) -> None:
        self.block_pool.changed_block_ids = None

    def request_snapshot(self) -> None:
        self._snapshot_due = True

    # ---- between steps ----------------------------------------------------------------------

    def on_add(self, request: Request) -> None:
        self._arrived.append(ArrivedRequest(request.request_id, request.num_prompt_tokens, request.arrival_time))

    def on_abort(self, requests: list[Request]) -> None:
        self._finished += [FinishedRequest(r.request_id, "abort", r.num_output_tokens) for r in requests]

    # ---- one step ---------------------------------------------------------------------------

    def on_schedule(self, output: SchedulerOutput, start: float) -> None:
        """Right after schedule(): which request runs what (num_computed_tokens has advanced)."""
        self._start = start
        requests = self.scheduler.requests
        for req_id, num_tokens in output.num_scheduled_tokens.items():
            request = requests[req_id]
            computed = request.num_computed_tokens
            # A prefill: more than the last known token was still to compute (the scheduler's
            # rule), or the prompt itself (a one-token prompt is no decode to a reader).
            prefill = request.num_tokens - (computed - num_tokens) > 1 or request.num_output_tokens == 0
            self._scheduled.append(ScheduledChunk(req_id, num_tokens, prefill, computed))
            self._scheduled_requests[req_id] = request
        get_block_ids = self.scheduler.kv_cache_manager.get_block_ids
        changed = [r.req_id for r in output.scheduled_new_reqs]
        cached = output.scheduled_cached_reqs
        changed += [req_id for req_id, resumed, new_ids in zip(
            cached.req_ids, cached.resumed_from_preemption, cached.new_block_ids, strict=True)
            if resumed or any(new_ids)]
        for req_id in changed:
            self._block_tables[req_id] = get_block_ids(req_id)[0]
        self._preempted += sorted(output.preempted_req_ids)

    def on_step_end(self, outputs: list[EngineCoreOutput]) -> EngineEvents:
        """After update_from_output: the step's events; resets for the next step."""
        self.step_index += 1
        return self._make_events(outputs, self.step_index - 1)

    def idle_events(self) -> EngineEvents:
        """What happened since the last step while nothing ran (aborts, a watcher's snapshot)."""
        self._start = time.monotonic()
        return self._make_events([], -1)

    def _make_events(self, outputs: list[EngineCoreOutput], step_index: int) -> EngineEvents:
        first_token, finished = [], self._finished
        for chunk in self._scheduled:
            chunk.output_len = self._scheduled_requests[chunk.id].num_output_tokens
        for out in outputs:
            request = self._scheduled_requests.get(out.request_id)
            if request is not None and out.new_token_ids and request.num_output_tokens == len(out.new_token_ids):
                first_token.append(out.request_id)
            if out.finish_reason is not None:
                output_len = request.num_output_tokens if request is not None else len(out.new_token_ids)
                finished.append(FinishedRequest(out.request_id, str(out.finish_reason), output_len))
        num_prefill = sum(c.tokens for c in self._scheduled if c.prefill)
        num_decode = sum(c.tokens for c in self._scheduled if not c.prefill)
        scheduler = self.scheduler
        events = EngineEvents(
            step=step_index, start=self._start, end=time.monotonic(), token_budget=self.token_budget,
            num_prefill_tokens=num_prefill, num_decode_tokens=num_decode,
            arrived=self._arrived, scheduled=self._scheduled, first_token=first_token,
            preempted=self._preempted, finished=finished,
            running=[r.request_id for r in scheduler.running[:MAX_QUEUE_IDS]],
            waiting=[r.request_id for _, r in zip(range(MAX_QUEUE_IDS), scheduler.waiting, strict=False)],
            block_tables=self._block_tables, num_blocks=self.block_pool.num_blocks,
        )
        self._add_blocks(events)
        self._arrived, self._finished, self._scheduled, self._preempted = [], [], [], []
        self._scheduled_requests, self._block_tables = {}, {}
        return events

    def _add_blocks(self, events: EngineEvents) -> None:
        changed = self.block_pool.changed_block_ids
        assert changed is not None
        now = events.end
        if self._snapshot_due or len(changed) > MAX_BLOCK_CHANGES or now - self._last_snapshot >= SNAPSHOT_INTERVAL_S:
            self._snapshot_due = False
            self._last_snapshot = now
            blocks = self.block_pool.blocks[:MAX_MAP_BLOCKS]
            events.block_map = [block_code(b.ref_cnt, b.block_hash is not None) for b in blocks]
            events.requests = self._request_infos()
            events.block_tables = {}
        else:
            blocks = self.block_pool.blocks
            flat = []
            for block_id in sorted(changed):
                if block_id < MAX_MAP_BLOCKS:
                    block = blocks[block_id]
                    flat += (block_id, block_code(block.ref_cnt, block.block_hash is not None))
            events.block_changes = flat
        changed.clear()

    def _request_infos(self) -> list[RequestInfo]:
        get_block_ids = self.scheduler.kv_cache_manager.get_block_ids
        infos = []
        for request in list(self.scheduler.requests.values())[:MAX_SNAPSHOT_REQUESTS]:
            status = _STATUS_NAMES.get(request.status, "waiting")
            blocks = get_block_ids(request.request_id)[0] if request.status == RequestStatus.RUNNING else []
            infos.append(RequestInfo(request.request_id, status, request.num_prompt_tokens, request.arrival_time,
                                     request.num_computed_tokens, request.num_output_tokens, blocks))
        return infos
