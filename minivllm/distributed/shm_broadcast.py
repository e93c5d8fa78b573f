"""A shared-memory broadcast queue: one writer, `n_reader` readers on the same machine.

The engine-core process sends each step's SchedulerOutput to its local tensor-parallel workers
through one of these, and each worker's reply comes back through another (with one reader), so a
step costs a memcpy and a flag flip instead of a socket round trip per worker. Messages larger
than a chunk go over a ZMQ XPUB/SUB socket; the ring still carries their place in the order.
"""

from __future__ import annotations

import os
import pickle
import shutil
import sys
import tempfile
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import numpy as np
import zmq

# A step's SchedulerOutput is a few KB; a large prefill batch can reach MBs, and such a step is
# long enough that one more copy through the socket does not show. 1 MiB x 8 chunks keeps a ring
# at 8 MiB of /dev/shm (Docker gives containers 64 MiB by default), and tmpfs only backs the
# pages a message has touched.
DEFAULT_MAX_CHUNK_BYTES = 1 << 20
# One step is in flight at a time (two with overlapped scheduling), so 8 chunks only fill up when
# a reader has fallen several steps behind.
DEFAULT_MAX_CHUNKS = 8

# Waiting: spin this long without sleeping (a reply usually lands within it), then sleep with
# intervals doubling from the first to the last value; an idle reader then wakes at most ~1000
# times a second instead of taking a core from the other processes of a small machine. Each spin
# yields the core, which costs nothing when no other process wants it; where three processes
# share two cores it let the peer being waited for run at once (4 KB round trip p50 ~25 us
# instead of ~25-280 us, p99 ~80-700 us instead of ~0.4-4 ms; `minivllm bench broadcast`).
SPIN_SECONDS = 50e-6
FIRST_SLEEP_SECONDS = 10e-6
MAX_SLEEP_SECONDS = 1e-3

# Per-chunk flag columns; reader r's read flag is column _READ + r.
_WRITTEN, _OVERFLOW, _READ = 0, 1, 2
_READY = b"READY"


class QueueClosed(Exception):
    """Raised by a wait whose `cancel()` returned True: the caller gave up on its peer."""


@dataclass(frozen=True)
class Handle:
    """What a reader in another process needs to attach to a queue (picklable)."""

    shm_name: str
    n_reader: int
    max_chunk_bytes: int
    max_chunks: int
    overflow_address: str


def wait_until(
    ready: Callable[[], bool],
    timeout: float | None = None,
    cancel: Callable[[], bool] | None = None,
) -> None:
    """Return once `ready()` is true: spin for SPIN_SECONDS, then back off with growing sleeps.

    Raises TimeoutError after `timeout` seconds and QueueClosed when `cancel()` returns True;
    `cancel` is only asked once spinning is over, since it may be costly (a liveness check).
    """
    if ready():
        return
    start = time.perf_counter()
    deadline = None if timeout is None else start + timeout
    sleep = FIRST_SLEEP_SECONDS
    while not ready():
        now = time.perf_counter()
        if deadline is not None and now >= deadline:
            raise TimeoutError(f"not ready after {timeout} s")
        if now - start < SPIN_SECONDS:
            os.sched_yield()
            continue
        if cancel is not None and cancel():
            raise QueueClosed("cancelled while waiting")
        time.sleep(sleep)
        sleep = min(sleep * 2, MAX_SLEEP_SECONDS)


class MessageQueue:
    """A ring of `max_chunks` chunks in shared memory, written by the creator, read by every reader.

    Chunk i holds message i, i + max_chunks, ...; its metadata is a "written" flag, an overflow
    flag, the payload length and one "read" flag per reader. The writer reuses a chunk once every
    reader has set its read flag, so it blocks only when the slowest reader is a whole ring behind.

    NOTE: the flags are plain stores through numpy views, with no fences. This relies on x86's
    total store order: the stores of one process become visible to the others in program order,
    so a reader that sees written=1 also sees the payload and length written before it.
    """

    def __init__(
        self,
        n_reader: int,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        max_chunks: int = DEFAULT_MAX_CHUNKS,
    ) -> None:
        if n_reader < 1 or max_chunk_bytes < 1 or max_chunks < 1:
            raise ValueError("n_reader, max_chunk_bytes and max_chunks must be positive")
        shm = SharedMemory(create=True, size=_segment_bytes(n_reader, max_chunk_bytes, max_chunks))
        self._tmpdir = tempfile.mkdtemp(prefix="minivllm-mq-")
        socket = zmq.Context.instance().socket(zmq.XPUB)
        socket.setsockopt(zmq.XPUB_VERBOSE, 1)  # every reader's subscription, not just the first
        socket.setsockopt(zmq.SNDHWM, 0)  # never drop: the ring already bounds what is in flight
        address = f"ipc://{self._tmpdir}/overflow"
        socket.bind(address)
        self._handle = Handle(shm.name, n_reader, max_chunk_bytes, max_chunks, address)
        self._setup(shm, socket, reader_rank=None)

    @classmethod
    def create_from_handle(cls, handle: Handle, reader_rank: int) -> MessageQueue:
        """Attach as reader `reader_rank` (0 <= rank < n_reader) of the writer's queue."""
        if not 0 <= reader_rank < handle.n_reader:
            raise ValueError(f"reader_rank {reader_rank} outside [0, {handle.n_reader})")
        self = cls.__new__(cls)
        self._handle = handle
        self._tmpdir = None
        socket = zmq.Context.instance().socket(zmq.SUB)
        socket.setsockopt(zmq.RCVHWM, 0)
        socket.connect(handle.overflow_address)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._setup(attach_segment(handle.shm_name), socket, reader_rank)
        return self

    def _setup(self, shm: SharedMemory, socket: zmq.Socket, reader_rank: int | None) -> None:
        h = self._handle
        data_bytes = h.max_chunks * h.max_chunk_bytes
        lengths_offset = _align8(data_bytes)
        self._socket = socket
        self._reader_rank = reader_rank
        self._data = np.ndarray((h.max_chunks, h.max_chunk_bytes), np.uint8, shm.buf)
        self._lengths = np.ndarray(h.max_chunks, np.int64, shm.buf, lengths_offset)
        self._flags = np.ndarray(
            (h.max_chunks, _READ + h.n_reader), np.uint8, shm.buf, lengths_offset + 8 * h.max_chunks
        )
        self._position = 0  # messages written (writer) or read (reader) so far
        self._ready = False
        self._closed = False
        self._finalizer = weakref.finalize(
            self, _release, shm, reader_rank is None, socket, self._tmpdir
        )

    def export_handle(self) -> Handle:
        return self._handle

    @property
    def is_writer(self) -> bool:
        return self._reader_rank is None

    def wait_until_ready(
        self, timeout: float | None = None, cancel: Callable[[], bool] | None = None
    ) -> None:
        """Writer: wait for all readers' subscriptions, then tell them; reader: wait to be told.

        Without this a PUB socket drops what it sends before a subscriber has joined, so the
        first overflow messages could be lost (ZMQ's slow-joiner problem).
        """
        if self._ready:
            return
        socket = self._socket
        if self.is_writer:
            num_subscribed = 0

            def all_subscribed() -> bool:
                nonlocal num_subscribed
                while socket.poll(0, zmq.POLLIN):
                    num_subscribed += socket.recv()[:1] == b"\x01"  # b"\x00" is an unsubscribe
                return num_subscribed >= self._handle.n_reader

            wait_until(all_subscribed, timeout, cancel)
            socket.send(_READY)
        else:
            wait_until(lambda: socket.poll(0, zmq.POLLIN) != 0, timeout, cancel)
            if (msg := socket.recv()) != _READY:
                raise RuntimeError(f"expected the writer's ready message, got {msg[:16]!r}")
        self._ready = True

    def enqueue(
        self, obj: Any, timeout: float | None = None, cancel: Callable[[], bool] | None = None
    ) -> None:
        """Publish `obj` to every reader; blocks while the next chunk is still being read."""
        self._check_ready(writer=True)
        payload = pickle.dumps(obj, protocol=5)
        chunk = self._position % self._handle.max_chunks
        flags = self._flags[chunk]
        wait_until(lambda: flags[_WRITTEN] == 0 or bool(flags[_READ:].all()), timeout, cancel)
        # Readers take a chunk that is written and not yet read by them: hide it before clearing
        # the read flags, and show it only once payload and length are in place.
        flags[_WRITTEN] = 0
        flags[_READ:] = 0
        n = len(payload)
        if n <= self._handle.max_chunk_bytes:
            self._data[chunk, :n] = np.frombuffer(payload, np.uint8)
            flags[_OVERFLOW] = 0
        else:
            self._socket.send(payload, copy=False)
            flags[_OVERFLOW] = 1
        self._lengths[chunk] = n
        flags[_WRITTEN] = 1
        self._position += 1

    def dequeue(
        self, timeout: float | None = None, cancel: Callable[[], bool] | None = None
    ) -> Any:
        """The next message, in the writer's order. Raises TimeoutError or QueueClosed."""
        self._check_ready(writer=False)
        chunk = self._position % self._handle.max_chunks
        flags = self._flags[chunk]
        read = _READ + self._reader_rank
        # NOTE: load the read flag first. The writer clears `written` before the read flags, so
        # a cleared read flag followed by written=1 can only mean the new message is complete;
        # the other order could pair the previous lap's written=1 with the fresh read flag.
        wait_until(lambda: flags[read] == 0 and flags[_WRITTEN] == 1, timeout, cancel)
        if flags[_OVERFLOW]:
            # The writer sent it before setting `written`, but it may still be in transit.
            wait_until(lambda: self._socket.poll(0, zmq.POLLIN) != 0, timeout, cancel)
            obj = pickle.loads(self._socket.recv(copy=False).buffer)
        else:
            obj = pickle.loads(self._data[chunk, : self._lengths[chunk]])
        flags[read] = 1
        self._position += 1
        return obj

    def _check_ready(self, writer: bool) -> None:
        if self._closed:
            raise QueueClosed("queue is closed")
        if writer != self.is_writer:
            raise RuntimeError(f"only the {'writer' if writer else 'readers'} may do this")
        if not self._ready:
            raise RuntimeError("call wait_until_ready() first")

    def close(self) -> None:
        """Detach; the writer also unlinks the segment. Idempotent, and run at exit if forgotten."""
        if self._closed:
            return
        self._closed = True
        del self._data, self._lengths, self._flags  # views pin the mapping open
        self._finalizer()


def _segment_bytes(n_reader: int, max_chunk_bytes: int, max_chunks: int) -> int:
    return _align8(max_chunks * max_chunk_bytes) + max_chunks * (8 + _READ + n_reader)


def _align8(n: int) -> int:
    return -(-n // 8) * 8


def attach_segment(name: str) -> SharedMemory:
    """Open the writer's segment without registering it with this process's resource tracker.

    Before Python 3.13 every SharedMemory registers itself, so a reader's tracker would unlink
    the writer's segment when the reader exits; only the writer's registration must remain.
    """
    if sys.version_info >= (3, 13):
        return SharedMemory(name=name, track=False)  # type: ignore[call-arg]
    register = resource_tracker.register
    resource_tracker.register = lambda *args, **kwargs: None  # type: ignore[assignment]
    try:
        return SharedMemory(name=name)
    finally:
        resource_tracker.register = register  # type: ignore[assignment]


def _release(shm: SharedMemory, is_writer: bool, socket: zmq.Socket, tmpdir: str | None) -> None:
    """Free what a queue holds; a finalizer, so it must not refer to the queue itself."""
    socket.close(linger=0)
    if is_writer:
        try:
            shm.unlink()
        except FileNotFoundError:
            pass
    try:
        shm.close()
    except BufferError:
        pass  # a caller still holds a view at exit; the mapping goes with the process
    if tmpdir is not None and os.path.isdir(tmpdir):
        shutil.rmtree(tmpdir, ignore_errors=True)


def unlink_segment(name: str, tracked_here: bool = True) -> None:
    """Remove a shared-memory segment by name, if it is still there (its creator may have died
    before it could). tracked_here: made by this process or a child sharing its resource tracker,
    which is told to forget it; False for one made elsewhere on this machine (a Ray actor), whose
    file is removed without a word to a tracker that never knew it."""
    try:
        if tracked_here:
            attach_segment(name).unlink()
        else:
            os.unlink(f"/dev/shm/{name}")
    except FileNotFoundError:
        pass


def remove_queue_files(handle: Handle) -> None:
    """Remove what a queue's writer created (its segment, its socket's directory), whether or not
    the writer lived to do it."""
    unlink_segment(handle.shm_name)
    if handle.overflow_address.startswith("ipc://"):
        shutil.rmtree(os.path.dirname(handle.overflow_address.removeprefix("ipc://")), ignore_errors=True)
