"""The executor of a tensor-parallel engine: one worker process per rank on this machine.

Every call goes out once, through a shared-memory broadcast queue that all workers read
(`collective_rpc`: method name, arguments, and which rank answers); each worker answers through
its own queue, and a step reads only rank 0's answer (every rank computed the same tokens).

Failure: a monitor thread waits on the worker processes. When one dies (a crash, SIGKILL, the
OOM killer) the executor marks itself failed, and every wait on a worker gives up within
milliseconds (its cancel check); the engine core raises, and its clients get EngineDeadError. The
other workers are stopped, and what the workers had in /dev/shm removed, by shutdown.

Workers leave with their parent: each holds the read end of a pipe whose write end only the
executor has; when the executor's process goes, however it goes, the pipe closes and the
worker exits.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

from minivllm.distributed.parallel_state import communicator_shm_name
from minivllm.distributed.shm_broadcast import (
    Handle,
    MessageQueue,
    QueueClosed,
    remove_queue_files,
    unlink_segment,
)
from minivllm.executor.abstract import Executor, ExecutorFailedError
from minivllm.executor.cpu_placement import cpus_of_rank, pin_to_cpus
from minivllm.logger import init_logger
from minivllm.utils import get_open_port

if TYPE_CHECKING:
    from minivllm.config import VllmConfig

logger = init_logger(__name__)

READY_TIMEOUT_S = 600  # loading a large model from a slow disk
SHUTDOWN_GRACE_S = 5  # then SIGTERM, and SIGKILL after as long again
SUCCESS, FAILURE = "ok", "failed"


@dataclass
class _WorkerProc:
    rank: int
    process: BaseProcess
    death_writer: Connection  # closing it tells the worker to exit
    response_mq: MessageQueue | None = None
    response_handle: Handle | None = None


class MultiprocExecutor(Executor):
    def _init_executor(self) -> None:
        self.world_size = self.vllm_config.parallel_config.world_size
        self.is_failed = False
        self._shutting_down = False
        self.rpc_broadcast_mq = MessageQueue(self.world_size)
        self.distributed_init_method = f"tcp://127.0.0.1:{get_open_port()}"
        context = multiprocessing.get_context("spawn")
        cpus = sorted(os.sched_getaffinity(0))
        self.workers: list[_WorkerProc] = []
        ready_readers = []
        try:
            for rank in range(self.world_size):
                ready_reader, ready_writer = context.Pipe(duplex=False)
                death_reader, death_writer = context.Pipe(duplex=False)
                process = context.Process(
                    target=worker_main, name=f"minivllm-worker-{rank}", daemon=True,
                    args=(self.vllm_config, rank, self.distributed_init_method, self.rpc_broadcast_mq.export_handle(),
                          ready_writer, death_reader, cpus_of_rank(cpus, self.world_size, rank)),
                )
                process.start()
                ready_writer.close()
                death_reader.close()
                self.workers.append(_WorkerProc(rank, process, death_writer))
                ready_readers.append(ready_reader)
            for worker, ready_reader in zip(self.workers, ready_readers, strict=True):
                worker.response_handle = self._wait_for_ready(worker, ready_reader)
            self.rpc_broadcast_mq.wait_until_ready(timeout=READY_TIMEOUT_S, cancel=self._any_dead)
            for worker in self.workers:
                worker.response_mq = MessageQueue.create_from_handle(worker.response_handle, 0)
                worker.response_mq.wait_until_ready(timeout=READY_TIMEOUT_S, cancel=self._any_dead)
        except BaseException:
            self.shutdown()
            raise
        self._monitor = threading.Thread(target=self._monitor_workers, name="minivllm-worker-monitor", daemon=True)
        self._monitor.start()

    def _wait_for_ready(self, worker: _WorkerProc, ready_reader: Connection) -> Handle:
        """The worker's answer queue, once its model is loaded; its error if it failed."""
        ready = wait([ready_reader, worker.process.sentinel], timeout=READY_TIMEOUT_S)
        if ready_reader not in ready:
            raise RuntimeError(
                f"Worker {worker.rank} exited during start-up (exit code {worker.process.exitcode})"
                if worker.process.sentinel in ready else f"Worker {worker.rank} not ready after {READY_TIMEOUT_S} s"
            )
        try:
            status, payload = ready_reader.recv()
        except EOFError:
            raise RuntimeError(f"Worker {worker.rank} exited during start-up") from None
        if status != SUCCESS:
            raise RuntimeError(f"Worker {worker.rank} failed to start:\n{payload}")
        return payload

    def _any_dead(self) -> bool:
        return self.is_failed or any(not w.process.is_alive() for w in self.workers)

    def _monitor_workers(self) -> None:
        sentinels = {w.process.sentinel: w for w in self.workers}
        dead = wait(list(sentinels))
        if self._shutting_down:
            return
        worker = sentinels[dead[0]]
        self.is_failed = True
        logger.error("Worker %d died unexpectedly (exit code %s); the engine cannot go on.",
                     worker.rank, worker.process.exitcode)

    def collective_rpc(self, method: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
                       unique_reply_rank: int | None = None) -> list[Any]:
        """Run a Worker method on every worker; the results by rank (only unique_reply_rank's,
        when given: the others run the call and send nothing back)."""
        if self.is_failed:
            raise ExecutorFailedError("A worker died; the executor is shut down.")
        try:
            self.rpc_broadcast_mq.enqueue((method, args, kwargs or {}, unique_reply_rank), cancel=self._any_dead)
            ranks = range(self.world_size) if unique_reply_rank is None else [unique_reply_rank]
            replies = [self.workers[r].response_mq.dequeue(cancel=self._any_dead) for r in ranks]
        except QueueClosed:
            self.is_failed = True
            raise ExecutorFailedError(f"A worker died during {method}().") from None
        for rank, (status, result) in zip(ranks, replies, strict=True):
            if status != SUCCESS:
                raise RuntimeError(f"Worker {rank} failed in {method}():\n{result}")
        return [result for _, result in replies]

    def execute_model(self, scheduler_output: Any) -> Any:
        return self.collective_rpc("execute_model", args=(scheduler_output,), unique_reply_rank=0)[0]

    def check_health(self) -> None:
        if self._any_dead():
            self.is_failed = True
            raise ExecutorFailedError("A worker died; the engine cannot go on.")

    def shutdown(self) -> None:
        """Tell the workers to exit (close their pipes), then SIGTERM and SIGKILL the late ones;
        remove every shared-memory segment and socket file the workers made."""
        if self._shutting_down:
            return
        self._shutting_down = True
        for worker in self.workers:
            worker.death_writer.close()
        _stop([w.process for w in self.workers])
        for worker in self.workers:
            if worker.response_mq is not None:
                worker.response_mq.close()
            if worker.response_handle is not None:
                remove_queue_files(worker.response_handle)
        unlink_segment(communicator_shm_name(self.distributed_init_method))
        self.rpc_broadcast_mq.close()


def _stop(processes: list[BaseProcess]) -> None:
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None:
            for p in processes:
                if p.is_alive():
                    os.kill(p.pid, sig)
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        for p in processes:
            p.join(max(0.0, deadline - time.monotonic()))
        if not any(p.is_alive() for p in processes):
            return


def worker_main(vllm_config: VllmConfig, rank: int, distributed_init_method: str, broadcast_handle: Handle,
                ready_pipe: Connection, death_pipe: Connection, cpus: list[int]) -> None:
    """A worker process: pin to its cores, load its shard, then run calls until told to stop."""
    # The front end owns Ctrl-C; SIGTERM (from shutdown) ends the process at once.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    threading.Thread(target=_exit_with_parent, args=(death_pipe,), daemon=True).start()
    from minivllm.worker.worker import Worker

    pin_to_cpus(cpus)
    try:
        worker = Worker(vllm_config, local_rank=rank, rank=rank, distributed_init_method=distributed_init_method)
        worker.init_device()
        worker.load_model()
        broadcast_mq = MessageQueue.create_from_handle(broadcast_handle, rank)
        response_mq = MessageQueue(1)
    except Exception:
        ready_pipe.send((FAILURE, traceback.format_exc()))
        return
    ready_pipe.send((SUCCESS, response_mq.export_handle()))
    ready_pipe.close()
    broadcast_mq.wait_until_ready()
    response_mq.wait_until_ready()
    while True:
        method, args, kwargs, output_rank = broadcast_mq.dequeue()
        try:
            reply = (SUCCESS, getattr(worker, method)(*args, **kwargs))
        except Exception as e:
            logger.exception("Worker %d failed in %s()", rank, method)
            reply = (FAILURE, f"{type(e).__name__}: {e}")
        if output_rank is None or output_rank == rank:
            response_mq.enqueue(reply)


def _exit_with_parent(death_pipe: Connection) -> None:
    """Block until the executor closes the pipe (or its process is gone), then exit."""
    try:
        death_pipe.recv()
    except EOFError:
        pass
    os._exit(0)
