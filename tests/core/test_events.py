"""The engine core's events (core/events.py), step by step against the scheduler's own state.

Block codes are checked by hand for each transition (allocate, share a prefix, free to
cached-free, evict), and a mirror built only from the events (snapshots + diffs) must equal the
block pool after every step of a workload with preemptions.
"""

from __future__ import annotations

import random

from core_utils import FakeWorker, create_requests, create_scheduler

from minivllm.core.events import EngineEvents, EventCollector, block_code

BLOCK = 4
FREE, CACHED_FREE, HELD, HELD_CACHED, SHARED_CACHED = 0, 1, 2, 3, 5


def run_step(scheduler, worker, collector) -> EngineEvents:
    """EngineCore._step_with_events without a model."""
    output = scheduler.schedule()
    collector.on_schedule(output, 0.0)
    outputs = scheduler.update_from_output(output, worker.execute_model(output, scheduler))
    return collector.on_step_end(outputs)


def apply(mirror: list[int], events: EngineEvents) -> None:
    if events.block_map is not None:
        mirror[:] = events.block_map
    for i in range(0, len(events.block_changes), 2):
        mirror[events.block_changes[i]] = events.block_changes[i + 1]


def pool_codes(scheduler) -> list[int]:
    return [block_code(b.ref_cnt, b.block_hash is not None) for b in scheduler.kv_cache_manager.block_pool.blocks]


def test_block_transitions_by_hand():
    scheduler = create_scheduler(num_blocks=9, block_size=BLOCK, enable_prefix_caching=True, max_model_len=64)
    worker = FakeWorker()
    collector = EventCollector(scheduler)
    # A: 10 prompt tokens, one output token: blocks 1, 2 full (hashed), 3 partial.
    prefix = list(range(100, 108))
    (a,) = create_requests(1, prompts=[prefix + [200, 201]], max_tokens=1, id_prefix="a")
    scheduler.add_request(a)
    collector.on_add(a)
    events = run_step(scheduler, worker, collector)
    assert [x.id for x in events.arrived] == ["a0"] and events.arrived[0].prompt_len == 10
    assert [(c.id, c.tokens, c.prefill) for c in events.scheduled] == [("a0", 10, True)]
    assert events.num_prefill_tokens == 10 and events.num_decode_tokens == 0
    assert events.first_token == ["a0"] and [(f.id, f.reason, f.output_len) for f in events.finished] == [("a0", "length", 1)]
    # The first events are a snapshot: A is already freed (finished in its first step).
    assert events.block_map is not None
    assert events.block_map[:5] == [HELD, CACHED_FREE, CACHED_FREE, FREE, FREE]  # block 0: the null block

    # B shares A's two full blocks (a prefix hit: cached-free -> held), C too (-> shared).
    (b, c) = create_requests(2, prompts=[prefix + [300, 301, 302], prefix + [400]], max_tokens=3,
                             id_prefix="r")
    for r in (b, c):
        scheduler.add_request(r)
    events = run_step(scheduler, worker, collector)
    assert events.block_map is None
    changes = dict(zip(events.block_changes[::2], events.block_changes[1::2], strict=True))
    assert changes[1] == changes[2] == SHARED_CACHED
    table_b, table_c = events.block_tables["r0"], events.block_tables["r1"]
    assert table_b[:2] == table_c[:2] == [1, 2] and len(table_b) == 3 and len(table_c) == 3
    assert {changes[table_b[2]], changes[table_c[2]]} == {HELD}
    assert events.running == ["r0", "r1"]

    # Run B and C to the end: their own blocks are freed, full ones to cached-free.
    mirror = pool_codes(scheduler)
    while scheduler.has_unfinished_requests():
        events = run_step(scheduler, worker, collector)
        apply(mirror, events)
    assert mirror == pool_codes(scheduler)
    assert mirror[1] == mirror[2] == CACHED_FREE
    assert all(code in (FREE, CACHED_FREE) for code in mirror[1:])

    # D takes every block: the cached-free ones are evicted (losing their hash) and held.
    assert mirror.count(CACHED_FREE) >= 2
    (d,) = create_requests(1, prompts=[list(range(500, 531))], max_tokens=1, id_prefix="d")
    scheduler.add_request(d)
    output = scheduler.schedule()
    collector.on_schedule(output, 0.0)
    events = collector.on_step_end([])
    changes = dict(zip(events.block_changes[::2], events.block_changes[1::2], strict=True))
    assert sorted(changes) == sorted(events.block_tables["d0"]) == list(range(1, 9))
    # Its 7 blocks full of prompt tokens are hashed (D's own hashes), the last one is not.
    assert [changes[i] for i in events.block_tables["d0"]] == [HELD_CACHED] * 7 + [HELD]


def test_event_mirror_equals_the_pool_under_preemption():
    """Snapshots + diffs rebuild the block pool exactly, step after step; the queues and the
    preemptions match the scheduler's."""
    rng = random.Random(0)
    scheduler = create_scheduler(num_blocks=14, block_size=BLOCK, max_num_batched_tokens=24, max_model_len=48,
                                 enable_prefix_caching=True)
    worker = FakeWorker()
    collector = EventCollector(scheduler)
    shared = list(range(10, 18))
    prompts = [shared + [rng.randrange(20, 90) for _ in range(rng.randrange(1, 12))] for _ in range(10)]
    requests = create_requests(10, prompts=prompts, max_tokens=[rng.randrange(4, 16) for _ in range(10)])
    mirror: list[int] = []
    preempted = finished = 0
    for step in range(400):
        if step < len(requests):
            scheduler.add_request(requests[step])
            collector.on_add(requests[step])
        if not scheduler.has_unfinished_requests():
            break
        before = scheduler.num_preemptions
        events = run_step(scheduler, worker, collector)
        apply(mirror, events)
        assert mirror == pool_codes(scheduler)
        assert len(events.preempted) == scheduler.num_preemptions - before
        assert events.running == [r.request_id for r in scheduler.running]
        assert events.waiting == [r.request_id for r in scheduler.waiting]
        preempted += len(events.preempted)
        finished += len(events.finished)
    assert finished == 10 and preempted == scheduler.num_preemptions > 0


def test_snapshot_when_asked_or_when_too_many_blocks_changed(monkeypatch):
    scheduler = create_scheduler(num_blocks=30, block_size=BLOCK, max_model_len=64)
    collector = EventCollector(scheduler)
    worker = FakeWorker()
    assert collector.idle_events().block_map is not None  # the first events
    assert collector.idle_events().block_map is None
    collector.request_snapshot()
    snapshot = collector.idle_events()
    assert snapshot.block_map == pool_codes(scheduler) and snapshot.requests == []
    monkeypatch.setattr("minivllm.core.events.MAX_BLOCK_CHANGES", 3)
    (r,) = create_requests(1, prompt_len=20, max_tokens=2)
    scheduler.add_request(r)
    events = run_step(scheduler, worker, collector)  # 5 blocks change: a snapshot instead
    assert events.block_changes == [] and events.block_map == pool_codes(scheduler)
    assert [(i.id, i.status, i.prompt_len, i.computed, i.output_len, i.blocks) for i in events.requests] == [
        ("0", "running", 20, 20, 1, [1, 2, 3, 4, 5])]
    collector.close()
    assert scheduler.kv_cache_manager.block_pool.changed_block_ids is None
