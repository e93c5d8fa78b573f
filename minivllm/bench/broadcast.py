"""`minivllm bench broadcast`: round-trip latency of the shared-memory message queue, in the
pattern the multiprocess executor uses: one message broadcast to N reader processes, and reader 0
replying through a second queue with one reader. Measured for a small message and for one past
the chunk size, which takes the ZMQ overflow path."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pickle
import time
from multiprocessing.connection import Connection

import numpy as np

from minivllm.bench.utils import write_json
from minivllm.distributed.shm_broadcast import DEFAULT_MAX_CHUNK_BYTES, Handle, MessageQueue

STARTUP_TIMEOUT_S = 60.0


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-readers", type=int, default=2, help="Reader processes (default: 2).")
    parser.add_argument(
        "--num-messages", type=int, default=2000, help="Timed messages per size (default: 2000)."
    )
    parser.add_argument(
        "--num-warmup", type=int, default=100, help="Untimed messages first (default: 100)."
    )
    parser.add_argument(
        "--message-bytes", type=int, default=4096, help="Small message size (default: 4096)."
    )
    parser.add_argument(
        "--max-chunk-bytes",
        type=int,
        default=DEFAULT_MAX_CHUNK_BYTES,
        help=f"Ring chunk size (default: {DEFAULT_MAX_CHUNK_BYTES}).",
    )
    parser.add_argument(
        "--overflow-bytes",
        type=int,
        default=None,
        help="Size of the overflow round (default: twice the chunk size).",
    )
    parser.add_argument("--output-json", type=str, default=None)


def main(args: argparse.Namespace) -> None:
    if args.num_readers < 1 or args.num_messages < 1:
        raise ValueError("--num-readers and --num-messages must be positive")
    overflow_bytes = args.overflow_bytes or 2 * args.max_chunk_bytes
    results = {}
    for label, size in (("small", args.message_bytes), ("large", overflow_bytes)):
        latencies_us = run_round(args, size)
        pickled = len(pickle.dumps((0, bytes(size)), protocol=5))
        result = {
            "message_bytes": size,
            "path": "inline" if pickled <= args.max_chunk_bytes else "overflow",
            "p50_us": float(np.percentile(latencies_us, 50)),
            "p99_us": float(np.percentile(latencies_us, 99)),
            "mean_us": float(np.mean(latencies_us)),
        }
        results[label] = result
        print(
            f"Broadcast round trip, {size} B to {args.num_readers} readers ({result['path']}, "
            f"{args.num_messages} messages): p50 {result['p50_us']:.1f} us, p99 {result['p99_us']:.1f} us, "
            f"mean {result['mean_us']:.1f} us"
        )
    if args.output_json:
        write_json(args.output_json, vars(args), {"results": results})


def run_round(args: argparse.Namespace, size: int) -> np.ndarray:
    """Per-message round trips in µs: from before the broadcast until reader 0's reply arrives."""
    ctx = mp.get_context("spawn")
    queue = MessageQueue(args.num_readers, max_chunk_bytes=args.max_chunk_bytes)
    handle_recv, handle_send = ctx.Pipe(duplex=False)
    procs = [
        ctx.Process(
            target=reader_main,
            args=(queue.export_handle(), rank, handle_send if rank == 0 else None),
        )
        for rank in range(args.num_readers)
    ]
    for p in procs:
        p.start()
    reply: MessageQueue | None = None
    try:

        def dead() -> bool:
            return any(not p.is_alive() for p in procs)

        queue.wait_until_ready(STARTUP_TIMEOUT_S, dead)
        if not handle_recv.poll(STARTUP_TIMEOUT_S):
            raise TimeoutError("reader 0 sent no reply queue")
        reply = MessageQueue.create_from_handle(handle_recv.recv(), reader_rank=0)
        reply.wait_until_ready(STARTUP_TIMEOUT_S, dead)
        payload = os.urandom(size)
        latencies_ns = np.empty(args.num_messages, dtype=np.int64)
        for i in range(-args.num_warmup, args.num_messages):
            start = time.perf_counter_ns()
            queue.enqueue((i, payload), cancel=dead)
            assert reply.dequeue(cancel=dead) == i
            if i >= 0:
                latencies_ns[i] = time.perf_counter_ns() - start
        queue.enqueue(None)  # readers stop
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        if reply is not None:
            reply.close()
        queue.close()
    return latencies_ns / 1000


def reader_main(handle: Handle, rank: int, handle_send: Connection | None) -> None:
    """A stand-in worker: read every broadcast; reader 0 also replies with the message's number."""
    parent = mp.parent_process()
    assert parent is not None

    def orphaned() -> bool:
        return not parent.is_alive()

    queue = MessageQueue.create_from_handle(handle, rank)
    reply: MessageQueue | None = None
    if handle_send is not None:
        reply = MessageQueue(1)
        handle_send.send(reply.export_handle())
        reply.wait_until_ready(STARTUP_TIMEOUT_S, orphaned)
    queue.wait_until_ready(STARTUP_TIMEOUT_S, orphaned)
    while (msg := queue.dequeue(cancel=orphaned)) is not None:
        if reply is not None:
            reply.enqueue(msg[0], cancel=orphaned)
    queue.close()
    if reply is not None:
        reply.close()
