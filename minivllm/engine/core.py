"""EngineCore: the inner loop of the engine — schedule, execute, update — one step at a time;
and EngineCoreProc, the same core behind two ZMQ sockets, run in its own process.

EngineCore owns the Scheduler and the executor (and through it the workers and the KV cache).
It sizes the KV cache at start-up: the workers say what their layers need (KV cache specs) and
how much memory they have, core/kv_cache_utils.py turns that into a KVCacheConfig (blocks,
groups, tensors), the workers allocate it and the scheduler's KV manager is built from it.

EngineCoreProc's busy loop: when idle, block on the input queue; when there is work, drain the
new messages without blocking, step, and queue the outputs. Two threads own the sockets and do
the (de)serialization, so it overlaps the model step.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import shutil
import signal
import threading
import time
import traceback
from typing import Any

import zmq

from minivllm.config import VllmConfig
from minivllm.core.events import EngineEvents, EventCollector
from minivllm.core.kv_cache_interface import KVCacheConfig
from minivllm.core.kv_cache_utils import get_kv_cache_configs
from minivllm.core.outputs import SchedulerStats
from minivllm.core.request import Request, RequestStatus
from minivllm.core.sched.scheduler import Scheduler
from minivllm.engine.messages import (
    ENGINE_CORE_DEAD,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineReady,
    UtilityCall,
    UtilityResult,
)
from minivllm.engine.serial_utils import MsgpackDecoder, MsgpackEncoder
from minivllm.engine.tracing import StepTracer
from minivllm.executor.abstract import Executor
from minivllm.executor.cpu_placement import cpus_of_rank, pin_to_cpus
from minivllm.logger import init_logger
from minivllm.structured_output import StructuredOutputManager

logger = init_logger(__name__)

# The longest a step that could run nothing waits for a compiling grammar before the engine
# looks at its input again (an abort or a new request waits at most this long).
GRAMMAR_WAIT_S = 0.05

# Methods a front end may call by name (UtilityCall).
UTILITY_METHODS = frozenset({"get_scheduler_stats", "reset_prefix_cache", "shutdown",
                             "start_event_collection", "stop_event_collection"})


class EngineCore:
    def __init__(self, vllm_config: VllmConfig) -> None:
        start = time.perf_counter()
        self.model_executor = Executor.get_class(vllm_config)(vllm_config)
        kv_cache_config = self._initialize_kv_caches(vllm_config)
        cache_config = dataclasses.replace(vllm_config.cache_config, num_gpu_blocks=kv_cache_config.num_blocks)
        self.vllm_config = dataclasses.replace(vllm_config, cache_config=cache_config)
        self.structured_output_manager = StructuredOutputManager(self.vllm_config)
        self.scheduler = Scheduler(self.vllm_config.scheduler_config, cache_config, kv_cache_config,
                                   self.structured_output_manager, self.vllm_config.speculative_config)
        # Events (core/events.py) are collected only while a front end watches (its dashboard)
        # or the engine traces; otherwise step() neither builds nor times anything for them.
        self.watching = False
        trace_dir = vllm_config.observability_config.trace_dir
        rank = vllm_config.parallel_config.data_parallel_rank
        self.tracer = StepTracer(trace_dir, f"engine-dp{rank}") if trace_dir else None
        self.event_collector = EventCollector(self.scheduler) if self.tracer else None
        logger.info("Engine core ready in %.2f s", time.perf_counter() - start)

    def _initialize_kv_caches(self, vllm_config: VllmConfig) -> KVCacheConfig:
        """Size the KV cache by the worker with the least memory, allocate it on every worker,
        and return the scheduler's view (every worker holds the same blocks)."""
        kv_cache_specs = self.model_executor.get_kv_cache_specs()
        available_memory = min(self.model_executor.determine_available_memory())
        kv_cache_configs = get_kv_cache_configs(
            vllm_config.cache_config, vllm_config.scheduler_config, kv_cache_specs, available_memory
        )
        self.model_executor.initialize_from_config(kv_cache_configs)
        return kv_cache_configs[0]

    def add_request(self, request: EngineCoreRequest) -> None:
        core_request = Request(
            request.request_id,
            request.prompt_token_ids,
            request.sampling_params,
            request.eos_token_id,
            request.arrival_time,
            request.cache_salt,
            request.priority,
        )
        self.scheduler.add_request(core_request)
        if self.event_collector is not None:
            self.event_collector.on_add(core_request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if self.event_collector is not None:
            requests = self.scheduler.requests
            self.event_collector.on_abort([requests[i] for i in request_ids if i in requests])
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> EngineCoreOutputs:
        """Schedule one batch, run it, and return each request's new tokens and the stats."""
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats(), events=self._idle_events())
        collector = self.event_collector  # while watched or traced: the phases timed, the step described
        start = time.perf_counter_ns()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.total_num_scheduled_tokens == 0:
            # Nothing can run until a grammar compiles. Spinning here held the GIL the compile
            # threads need (the first structured request of a fresh server took 47 s, 4.5 s with
            # the wait): wait for one, or at most GRAMMAR_WAIT_S so new input is still seen.
            self.scheduler.wait_for_grammars(GRAMMAR_WAIT_S)
        if collector is not None:
            scheduled = time.perf_counter_ns()
            collector.on_schedule(scheduler_output, start / 1e9)
        model_output = self.model_executor.execute_model(scheduler_output)
        if collector is not None:
            executed = time.perf_counter_ns()
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        # What every running stream waited for: the scheduler's cost model learns from it.
        self.scheduler.observe_step_time((time.perf_counter_ns() - start) / 1e9)
        if collector is None:
            return EngineCoreOutputs(outputs, self.scheduler.make_stats())
        events = collector.on_step_end(outputs)
        if self.tracer is not None:
            self.tracer.record(events, [start, scheduled, executed, time.perf_counter_ns()], model_output.phase_ns)
        return EngineCoreOutputs(outputs, self.scheduler.make_stats(), events=events if self.watching else None)

    def _idle_events(self) -> EngineEvents | None:
        """What changed while nothing ran (aborts, a watcher's snapshot)."""
        if self.event_collector is None:
            return None
        events = self.event_collector.idle_events()
        if self.tracer is not None:
            self.tracer.record(events, None, None)
        return events if self.watching else None

    def start_event_collection(self) -> None:
        """A front end watches (its first dashboard client, or one more): events go out with
        every step's outputs from now on, the next ones with a full snapshot."""
        self.watching = True
        if self.event_collector is None:
            self.event_collector = EventCollector(self.scheduler)
        self.event_collector.request_snapshot()

    def stop_event_collection(self) -> None:
        """Nobody watches any more: no events go out, and none are collected unless tracing."""
        self.watching = False
        if self.event_collector is not None and self.tracer is None:
            self.event_collector.close()
            self.event_collector = None

    def get_scheduler_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the workers and close the trace; the engine core is unusable after."""
        if self.tracer is not None:
            self.tracer.close()
            self.tracer = None
        self.structured_output_manager.shutdown()
        self.model_executor.shutdown()


class EngineCoreProc(EngineCore):
    """An EngineCore serving a front end over ZMQ (input: PULL, output: PUSH; the front end binds)."""

    def __init__(self, vllm_config: VllmConfig, input_address: str, output_address: str) -> None:
        super().__init__(vllm_config)
        self.input_queue: queue.Queue[tuple[EngineCoreRequestType, Any]] = queue.Queue()
        self.output_queue: queue.Queue[EngineCoreOutputs | bytes | None] = queue.Queue()
        self._shutdown_requested = False
        # An abort changed the stats, or a new watcher waits for its snapshot, since the last output.
        self._stats_stale = False
        self.orphaned = False  # the front end died without shutting us down
        self._ctx = zmq.Context()
        self._input_thread = threading.Thread(
            target=self._input_loop, args=(input_address,), name="EngineCoreInput", daemon=True
        )
        self._output_thread = threading.Thread(
            target=self._output_loop, args=(output_address,), name="EngineCoreOutput", daemon=True
        )

    def start_io(self) -> None:
        self._input_thread.start()
        self._output_thread.start()

    def _input_loop(self, address: str) -> None:
        decoders = {
            EngineCoreRequestType.ADD: MsgpackDecoder(EngineCoreRequest),
            EngineCoreRequestType.ABORT: MsgpackDecoder(list[str]),
            EngineCoreRequestType.UTILITY: MsgpackDecoder(UtilityCall),
        }
        socket = self._ctx.socket(zmq.PULL)
        socket.connect(address)
        try:
            while True:
                kind, payload = socket.recv_multipart(copy=False)
                request_type = EngineCoreRequestType(kind.bytes)
                self.input_queue.put((request_type, decoders[request_type].decode(payload.buffer)))
        except zmq.ContextTerminated:
            pass
        finally:
            socket.close(linger=0)

    def _output_loop(self, address: str) -> None:
        encoder = MsgpackEncoder()
        socket = self._ctx.socket(zmq.PUSH)
        socket.connect(address)
        try:
            while (item := self.output_queue.get()) is not None:
                socket.send(item if isinstance(item, bytes) else encoder.encode(item), copy=False)
        except zmq.ContextTerminated:
            pass
        finally:
            socket.close(linger=1000)

    def run_busy_loop(self, parent_pid: int | None) -> None:
        while not self._shutdown_requested:
            self._process_input_queue(parent_pid)
            # An abort that leaves the engine idle still owes the front end fresh stats (running
            # count, KV usage); step() with nothing to run sends exactly that.
            if self.scheduler.has_unfinished_requests() or self._stats_stale:
                self._stats_stale = False
                self.output_queue.put(self.step())

    def _process_input_queue(self, parent_pid: int | None) -> None:
        """Block while idle (waking up every second to notice an orphaned process or a dead
        worker: check_health raises, and the busy loop reports the engine dead), then drain what
        came in."""
        while not self.scheduler.has_unfinished_requests() and not self._shutdown_requested:
            try:
                self._handle(*self.input_queue.get(timeout=1.0))
                break
            except queue.Empty:
                self.model_executor.check_health()
                if parent_pid is not None and os.getppid() != parent_pid:
                    logger.warning("Front-end process %d is gone; shutting down the engine core.", parent_pid)
                    self._shutdown_requested = self.orphaned = True
        while not self.input_queue.empty():
            self._handle(*self.input_queue.get_nowait())

    def _handle(self, request_type: EngineCoreRequestType, payload: Any) -> None:
        if request_type == EngineCoreRequestType.ADD:
            self.add_request(payload)
        elif request_type == EngineCoreRequestType.ABORT:
            self.abort_requests(payload)
            self._stats_stale = True
        else:
            self.output_queue.put(EngineCoreOutputs(utility_result=self._call_utility(payload)))

    def start_event_collection(self) -> None:
        super().start_event_collection()
        self._stats_stale = True  # the snapshot goes out now, even if the engine is idle

    def _call_utility(self, call: UtilityCall) -> UtilityResult:
        if call.method not in UTILITY_METHODS:
            return UtilityResult(call.call_id, error=f"Unknown utility method {call.method!r}")
        try:
            return UtilityResult(call.call_id, result=getattr(self, call.method)(*call.args))
        except Exception as e:  # reported to the caller; the engine keeps serving
            return UtilityResult(call.call_id, error=f"{type(e).__name__}: {e}")

    def shutdown(self) -> None:
        """Shut down, asked by the front end (a utility call): the busy loop ends after this
        message, and close() then stops the workers."""
        self._shutdown_requested = True

    def close(self) -> None:
        self.output_queue.put(None)
        self._output_thread.join(timeout=5)
        self._ctx.term()
        EngineCore.shutdown(self)


def run_engine_core(
    vllm_config: VllmConfig, input_address: str, output_address: str, parent_pid: int | None
) -> None:
    """Entry point of the engine process (and of the engine thread in debug mode).

    Reports EngineReady (or the start-up error) first on the output channel; if the loop dies
    of an exception, sends ENGINE_CORE_DEAD so the front end fails its requests at once.
    """
    if parent_pid is not None:  # its own process, not a thread
        # The front end owns Ctrl-C and shuts us down; SIGTERM ends the loop cleanly.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, _raise_system_exit)
        parallel = vllm_config.parallel_config
        if parallel.data_parallel_size > 1:  # this core's share of the machine (its workers split it)
            cpus = cpus_of_rank(sorted(os.sched_getaffinity(0)), parallel.data_parallel_size, parallel.data_parallel_rank)
            pin_to_cpus(cpus)
    engine: EngineCoreProc | None = None
    try:
        engine = EngineCoreProc(vllm_config, input_address, output_address)
    except BaseException as e:
        _send_direct(
            output_address,
            EngineReady(error=str(e), error_type=type(e).__name__, error_traceback=traceback.format_exc()),
        )
        raise
    engine.output_queue.put_nowait(EngineReady(num_gpu_blocks=engine.vllm_config.cache_config.num_gpu_blocks or 0))
    engine.start_io()
    try:
        engine.run_busy_loop(parent_pid)
    except SystemExit:
        pass
    except BaseException:
        logger.exception("The engine core failed")
        engine.output_queue.put(ENGINE_CORE_DEAD)
        raise
    finally:
        engine.close()
        if engine.orphaned:  # nobody else will remove the front end's socket directory
            shutil.rmtree(os.path.dirname(input_address.removeprefix("ipc://")), ignore_errors=True)


def _raise_system_exit(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def _send_direct(address: str, message: Any) -> None:
    ctx = zmq.Context()
    socket = ctx.socket(zmq.PUSH)
    socket.connect(address)
    socket.send(MsgpackEncoder().encode(message))
    socket.close(linger=2000)
    ctx.term()
