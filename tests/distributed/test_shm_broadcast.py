"""The shared-memory broadcast queue (minivllm.distributed.shm_broadcast).

In one process, hypothesis interleaves writes and reads against a FIFO model (with chunk-size and
overflow payloads); across spawned processes, readers at different speeds receive every message
in order, the writer never gets more than a ring ahead of the slowest, and no /dev/shm segment
outlives its writer.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import pickle
import random
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.distributed.shm_broadcast import Handle, MessageQueue, QueueClosed

CHUNK = 1024
SPAWN = mp.get_context("spawn")


def shm_exists(handle: Handle) -> bool:
    return os.path.exists(f"/dev/shm/{handle.shm_name}")


def payload_with_pickled_size(target: int) -> bytes:
    """A bytes object whose pickle (protocol 5) is exactly `target` bytes long (15 at least)."""
    for n in range(max(target - 32, 0), target):
        if len(pickle.dumps(b"\x07" * n, protocol=5)) == target:
            return b"\x07" * n
    raise AssertionError(f"no bytes object pickles to {target} bytes")


def connect(n_reader: int, max_chunks: int = 4) -> tuple[MessageQueue, list[MessageQueue]]:
    """A writer and its readers in this process, ready."""
    writer = MessageQueue(n_reader, max_chunk_bytes=CHUNK, max_chunks=max_chunks)
    readers = [MessageQueue.create_from_handle(writer.export_handle(), r) for r in range(n_reader)]
    writer.wait_until_ready(timeout=10)
    for reader in readers:
        reader.wait_until_ready(timeout=10)
    return writer, readers


@pytest.fixture
def queues() -> Iterator[tuple[MessageQueue, list[MessageQueue]]]:
    writer, readers = connect(2)
    yield writer, readers
    for q in (*readers, writer):
        q.close()


# ---- one process -------------------------------------------------------------------------------


SIZES = st.one_of(
    st.integers(15, 200), st.integers(CHUNK - 2, CHUNK + 2), st.integers(CHUNK + 3, 5 * CHUNK)
)
OPS = st.lists(
    st.one_of(st.tuples(st.just("write"), SIZES), st.tuples(st.just("read"), st.integers(0, 1))),
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(ops=OPS, max_chunks=st.integers(1, 4))
def test_interleaved_writes_and_reads_match_a_fifo_model(
    ops: list[tuple[str, int]], max_chunks: int
) -> None:
    writer, readers = connect(2, max_chunks)
    sent: list[bytes] = []
    read_counts = [0, 0]
    try:
        for op, arg in ops:
            if op == "write":
                msg = payload_with_pickled_size(arg)
                if len(sent) - min(read_counts) < max_chunks:
                    writer.enqueue(msg, timeout=0)
                    sent.append(msg)
                else:  # the slowest reader is a whole ring behind
                    with pytest.raises(TimeoutError):
                        writer.enqueue(msg, timeout=0)
            elif read_counts[arg] < len(sent):
                assert readers[arg].dequeue(timeout=5) == sent[read_counts[arg]]
                read_counts[arg] += 1
            else:
                with pytest.raises(TimeoutError):
                    readers[arg].dequeue(timeout=0)
        for r, reader in enumerate(readers):
            rest = sent[read_counts[r] :]
            assert [reader.dequeue(timeout=5) for _ in rest] == rest
    finally:
        for q in (*readers, writer):
            q.close()


@pytest.mark.parametrize("size", [CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 7, 100 * CHUNK])
def test_payloads_around_the_chunk_size(queues, size: int) -> None:
    writer, readers = queues
    msg = payload_with_pickled_size(size)
    writer.enqueue(msg)
    writer.enqueue("after")  # order holds across the inline and overflow paths
    # Exactly the payloads that do not fit a chunk take the socket.
    assert writer._flags[0, 1] == (size > CHUNK)
    for reader in readers:
        assert reader.dequeue(timeout=5) == msg
        assert reader.dequeue(timeout=5) == "after"


def test_timeout_and_cancel(queues) -> None:
    writer, (reader, _) = queues
    start = time.perf_counter()
    with pytest.raises(TimeoutError):
        reader.dequeue(timeout=0.05)
    assert time.perf_counter() - start >= 0.05
    calls = []
    with pytest.raises(QueueClosed):
        reader.dequeue(cancel=lambda: calls.append(1) or len(calls) == 3)
    assert len(calls) == 3
    for i in range(4):  # fill the ring: reader 1 never reads
        writer.enqueue(i)
    with pytest.raises(QueueClosed):
        writer.enqueue(4, cancel=lambda: True)
    with pytest.raises(TimeoutError):
        writer.enqueue(4, timeout=0.01)
    # A writer whose reader never attaches does not wait forever for it either.
    lonely = MessageQueue(1, max_chunk_bytes=CHUNK)
    with pytest.raises(TimeoutError):
        lonely.wait_until_ready(timeout=0.05)
    with pytest.raises(RuntimeError, match="wait_until_ready"):
        lonely.enqueue(0)
    lonely.close()


def test_close_unlinks_the_segment_and_is_idempotent() -> None:
    writer, readers = connect(2)
    handle = writer.export_handle()
    readers[0].close()
    readers[0].close()
    assert shm_exists(handle)  # a reader only detaches
    writer.close()
    writer.close()
    assert not shm_exists(handle)
    with pytest.raises(QueueClosed):
        writer.enqueue(0)
    readers[1].close()


# ---- processes ---------------------------------------------------------------------------------


def make_messages(n: int, seed: int) -> list[tuple[int, bytes]]:
    """Mostly small messages, with an occasional one at or past the chunk size."""
    rng = random.Random(seed)
    sizes = [
        rng.choice((rng.randint(0, 300), rng.randint(CHUNK - 20, 4 * CHUNK)))
        if i % 50 == 0
        else rng.randint(0, 300)
        for i in range(n)
    ]
    return [(i, rng.randbytes(size)) for i, size in enumerate(sizes)]


def digest(messages: list[Any]) -> str:
    h = hashlib.sha256()
    for m in messages:
        h.update(pickle.dumps(m, protocol=5))
    return h.hexdigest()


def reader_main(
    handle: Handle, rank: int, n: int, delay: float, progress: Any, results: Any
) -> None:
    """Receive n messages; report their digest, whether they came in order, and the writer's
    greatest lead (messages written minus messages read) seen before each dequeue."""
    queue = MessageQueue.create_from_handle(handle, rank)
    queue.wait_until_ready(timeout=60)
    received, max_lead = [], 0
    for k in range(n):
        if delay:
            time.sleep(delay)
        max_lead = max(max_lead, progress.value - k)
        received.append(queue.dequeue(timeout=60))
    queue.close()
    in_order = [i for i, _ in received] == list(range(n))
    results.put((rank, digest(received), in_order, max_lead))


def broadcast(
    messages: list[Any], delays: list[float], max_chunks: int
) -> tuple[Handle, list[tuple]]:
    """Send `messages` to one spawned reader per delay; their reports, by rank."""
    writer = MessageQueue(len(delays), max_chunk_bytes=CHUNK, max_chunks=max_chunks)
    handle = writer.export_handle()
    progress, results = SPAWN.RawValue("q", 0), SPAWN.Queue()
    procs = [
        SPAWN.Process(target=reader_main, args=(handle, r, len(messages), d, progress, results))
        for r, d in enumerate(delays)
    ]
    for p in procs:
        p.start()
    try:
        writer.wait_until_ready(timeout=60)
        for i, m in enumerate(messages):
            writer.enqueue(m, timeout=60)
            progress.value = i + 1
        reports = sorted(results.get(timeout=60) for _ in procs)
        for p in procs:
            p.join(timeout=10)
            assert p.exitcode == 0
        assert shm_exists(handle)  # readers exiting leave the writer's segment alone
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        writer.close()
    return handle, reports


def test_three_readers_receive_every_message_in_order() -> None:
    messages = make_messages(2000, seed=0)
    handle, reports = broadcast(messages, delays=[0.0, 0.0, 0.0], max_chunks=8)
    assert [report[:3] for report in reports] == [(r, digest(messages), True) for r in range(3)]
    assert not shm_exists(handle)


def test_writer_runs_at_most_a_ring_ahead_of_the_slowest_reader() -> None:
    max_chunks = 4
    messages = make_messages(60, seed=1)
    _, reports = broadcast(messages, delays=[0.0, 0.002], max_chunks=max_chunks)
    assert [report[1:3] for report in reports] == [(digest(messages), True)] * 2
    # While the slow reader sleeps the writer fills the ring, and gets no further.
    assert reports[1][3] == max_chunks


def echo_main(handle: Handle, replies: Any) -> None:
    """Reply to each message through a queue of our own, as a worker answers the engine."""
    queue = MessageQueue.create_from_handle(handle, 0)
    reply = MessageQueue(1, max_chunk_bytes=CHUNK, max_chunks=2)
    replies.send(reply.export_handle())
    reply.wait_until_ready(timeout=60)
    queue.wait_until_ready(timeout=60)
    while (msg := queue.dequeue(timeout=60)) is not None:
        reply.enqueue(msg, timeout=60)
    queue.close()
    reply.close()


def test_round_trips_through_a_reply_queue() -> None:
    """Each side waits on a chunk while the other rewrites it, every time: the race a reader
    loses if it trusts a previous lap's written flag."""
    queue = MessageQueue(1, max_chunk_bytes=CHUNK, max_chunks=2)
    replies_recv, replies_send = SPAWN.Pipe(duplex=False)
    proc = SPAWN.Process(target=echo_main, args=(queue.export_handle(), replies_send))
    proc.start()
    try:
        queue.wait_until_ready(timeout=60)
        assert replies_recv.poll(60)
        reply = MessageQueue.create_from_handle(replies_recv.recv(), 0)
        reply.wait_until_ready(timeout=60)
        for i in range(3000):
            queue.enqueue(i, timeout=60)
            assert reply.dequeue(timeout=60) == i
        queue.enqueue(None)
        proc.join(timeout=30)
        assert proc.exitcode == 0
        reply.close()
    finally:
        if proc.is_alive():
            proc.kill()
        queue.close()


def writer_main(names: Any) -> None:
    queue = MessageQueue(1, max_chunk_bytes=CHUNK)
    names.put(queue.export_handle())  # exits without close()


def test_a_writer_that_exits_without_close_leaves_no_segment() -> None:
    names = SPAWN.Queue()
    proc = SPAWN.Process(target=writer_main, args=(names,))
    proc.start()
    handle = names.get(timeout=60)
    proc.join(timeout=30)
    assert proc.exitcode == 0
    assert not shm_exists(handle)
