"""How the front end talks to the engine core: one interface, three implementations.

- InprocClient: the EngineCore lives in this process and `get_output` runs one step (tests,
  debugging; `MINIVLLM_ENABLE_MULTIPROCESSING=0` for LLM).
- SyncMPClient (for LLM) and AsyncMPClient (for AsyncLLM): the engine core runs in a fresh
  interpreter (minivllm.engine.launch's main, spawn semantics; or, for AsyncLLM in debug
  mode, a thread), behind two ZMQ PUSH/PULL
  sockets over ipc:// in a private temporary directory. The front end binds both; the engine
  connects. A monitor thread watches the engine and, if it dies, pushes ENGINE_CORE_DEAD into
  the output socket so that every waiting caller fails at once with EngineDeadError.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import weakref
from collections import deque
from typing import Any

import zmq
import zmq.asyncio

import minivllm
from minivllm import envs
from minivllm.config import VllmConfig
from minivllm.engine.exceptions import EngineDeadError
from minivllm.engine.messages import (
    ENGINE_CORE_DEAD,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineReady,
    UtilityCall,
)
from minivllm.engine.serial_utils import MsgpackDecoder, MsgpackEncoder
from minivllm.logger import init_logger

logger = init_logger(__name__)


class InprocClient:
    """The engine core in this process: every call is a direct method call."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        from minivllm.engine.core import EngineCore

        self.engine_core = EngineCore(vllm_config)
        self.vllm_config = self.engine_core.vllm_config
        self.dead_error: BaseException | None = None

    def wait_for_ready(self) -> None:
        pass

    def add_request(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.dead_error is None:
            self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        """One step; an exception in it is engine-fatal, as in the engine process: it is raised
        to the caller, and every later call raises EngineDeadError."""
        self._check_alive()
        try:
            return self.engine_core.step()
        except BaseException as e:
            self.dead_error = e
            raise

    def call_utility(self, method: str, *args: Any) -> Any:
        self._check_alive()
        return getattr(self.engine_core, method)(*args)

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"The engine core failed: {self.dead_error!r}")

    def shutdown(self) -> None:
        self.engine_core.shutdown()


class _EngineResources:
    """Everything the MP clients must release, kept apart from the client so that a finalizer
    can release it at interpreter exit without keeping the client alive."""

    def __init__(self) -> None:
        self.ctx: zmq.Context | None = None
        self.sockets: list[zmq.Socket] = []
        self.engine: subprocess.Popen[bytes] | threading.Thread | None = None
        self.send_shutdown: Any = None
        self.tmpdir = tempfile.mkdtemp(prefix="minivllm-")
        self.closing = False
        self.engine_dead = False

    def close(self) -> None:
        if self.closing:
            return
        self.closing = True
        engine = self.engine
        if engine is not None and _is_alive(engine):
            try:
                self.send_shutdown()
            except Exception:  # the socket may be gone already; the join below decides
                pass
            if isinstance(engine, threading.Thread):
                engine.join(timeout=10)
            else:
                _stop_process(engine)
        for socket in self.sockets:
            socket.close(linger=0)
        if self.ctx is not None:
            self.ctx.term()
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def _monitor_engine(resources: _EngineResources, output_address: str) -> None:
    """Wait for the engine to end; if nobody asked it to, tell every caller it died."""
    engine = resources.engine
    if isinstance(engine, threading.Thread):
        engine.join()
    elif engine is not None:
        engine.wait()
    if resources.closing:
        return
    resources.engine_dead = True
    logger.error("The engine core died unexpectedly.")
    socket = zmq.Context.instance().socket(zmq.PUSH)
    socket.connect(output_address)
    socket.send(ENGINE_CORE_DEAD)
    socket.close(linger=1000)


def _is_alive(engine: subprocess.Popen[bytes] | threading.Thread) -> bool:
    return engine.is_alive() if isinstance(engine, threading.Thread) else engine.poll() is None


def _stop_process(process: subprocess.Popen[bytes]) -> None:
    """Wait for a clean exit, then SIGTERM, then SIGKILL: never leave an orphan."""
    for stop in (None, process.terminate, process.kill):
        if stop is not None:
            stop()
        try:
            process.wait(timeout=10 if stop is None else 5)
            return
        except subprocess.TimeoutExpired:
            continue


class MPClient:
    """Starts the engine (process or thread), binds the sockets, waits for the handshake."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        asyncio_mode: bool,
        use_thread: bool = False,
        process: subprocess.Popen[bytes] | None = None,
    ) -> None:
        self.resources = _EngineResources()
        self._finalizer = weakref.finalize(self, self.resources.close)
        self.encoder = MsgpackEncoder()
        self.decoder = MsgpackDecoder(EngineCoreOutputs)
        self._call_ids = itertools.count()
        res = self.resources
        self.input_address = f"ipc://{res.tmpdir}/input"
        self.output_address = f"ipc://{res.tmpdir}/output"
        res.ctx = zmq.asyncio.Context() if asyncio_mode else zmq.Context()
        self.input_socket = res.ctx.socket(zmq.PUSH)
        self.output_socket = res.ctx.socket(zmq.PULL)
        res.sockets += [self.input_socket, self.output_socket]
        self.input_socket.bind(self.input_address)
        self.output_socket.bind(self.output_address)
        res.send_shutdown = self._make_shutdown_sender()
        res.engine = self._start_engine(vllm_config, use_thread, process)
        self._asyncio_mode = asyncio_mode
        self.vllm_config = vllm_config

    def wait_for_ready(self) -> None:
        """Block until the engine has loaded the model (the front end loads its tokenizer
        meanwhile); then watch it for the rest of its life."""
        num_gpu_blocks = self._wait_for_ready(self._asyncio_mode)
        cache_config = dataclasses.replace(self.vllm_config.cache_config, num_gpu_blocks=num_gpu_blocks)
        self.vllm_config = dataclasses.replace(self.vllm_config, cache_config=cache_config)
        # NOTE: the thread must not reference the client, or the client would never be
        # garbage-collected (and its engine never shut down) while the engine lives.
        threading.Thread(
            target=_monitor_engine, args=(self.resources, self.output_address), name="EngineCoreMonitor", daemon=True
        ).start()

    @property
    def engine_dead(self) -> bool:
        return self.resources.engine_dead

    def _start_engine(
        self, vllm_config: VllmConfig, use_thread: bool, process: subprocess.Popen[bytes] | None
    ) -> subprocess.Popen[bytes] | threading.Thread:
        if use_thread:
            args = (vllm_config, self.input_address, self.output_address, None)
            engine = threading.Thread(target=_engine_main, args=args, name="EngineCore", daemon=True)
            engine.start()
            return engine
        if process is None:
            process = start_engine_interpreter()
        assert process.stdin is not None
        pickle.dump((self.input_address, self.output_address, os.getpid(), vllm_config), process.stdin)
        process.stdin.close()
        return process

    def _make_shutdown_sender(self) -> Any:
        """A closure sending the shutdown call through the input socket, usable synchronously
        (from a finalizer) whatever the socket's mode: a sync shadow of the same socket."""
        shadow = zmq.Socket.shadow(self.input_socket.underlying)
        frames = [EngineCoreRequestType.UTILITY.value, self.encoder.encode(UtilityCall(-1, "shutdown"))]
        # NOBLOCK: an engine that never connected (failed start-up) must not hang the caller.
        return lambda: shadow.send_multipart(frames, flags=zmq.NOBLOCK)

    def _wait_for_ready(self, asyncio_mode: bool) -> int:
        """Block until the engine reports ready; fail fast if it dies or reports an error."""
        poller_socket = zmq.Socket.shadow(self.output_socket.underlying) if asyncio_mode else self.output_socket
        timeout_s = envs.engine_ready_timeout_s()
        waited = 0.0
        while not poller_socket.poll(100):
            waited += 0.1
            if not _is_alive(self.resources.engine):
                self.resources.close()
                raise RuntimeError("The engine core failed to start (it exited); see its log above.")
            if waited > timeout_s:
                self.resources.close()
                raise RuntimeError(f"The engine core did not report ready within {timeout_s:.0f} s.")
        ready = MsgpackDecoder(EngineReady).decode(poller_socket.recv())
        if ready.error_type is not None:
            self.resources.close()
            if ready.error_type == "ValueError":  # a bad setting: the same error as in-process
                raise ValueError(ready.error)
            raise RuntimeError(f"The engine core failed to start:\n{ready.error_traceback}")
        return ready.num_gpu_blocks

    def _decode_output(self, frame: bytes | memoryview) -> EngineCoreOutputs:
        if bytes(frame[: len(ENGINE_CORE_DEAD)]) == ENGINE_CORE_DEAD and len(frame) == len(ENGINE_CORE_DEAD):
            self.resources.engine_dead = True
            raise EngineDeadError()
        return self.decoder.decode(frame)

    def _check_alive(self) -> None:
        if self.resources.closing:
            raise EngineDeadError("The engine was shut down.")
        if self.engine_dead:
            raise EngineDeadError()

    def _request_frames(self, request_type: EngineCoreRequestType, payload: Any) -> list[bytes]:
        return [request_type.value, self.encoder.encode(payload)]

    def abort_requests(self, request_ids: list[str]) -> None:
        """Send an abort now, without awaiting even on the asyncio socket: that one sends at once
        or queues the message ahead of every later one, so the abort is on its way before the
        caller does anything else (AsyncLLM relies on it, see its output handler)."""
        if request_ids and not self.engine_dead:
            self.input_socket.send_multipart(self._request_frames(EngineCoreRequestType.ABORT, request_ids))

    def shutdown(self) -> None:
        self._finalizer()


class SyncMPClient(MPClient):
    def __init__(self, vllm_config: VllmConfig, process: subprocess.Popen[bytes] | None = None) -> None:
        super().__init__(vllm_config, asyncio_mode=False, process=process)
        self._pending: deque[EngineCoreOutputs] = deque()

    def add_request(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        self.input_socket.send_multipart(self._request_frames(EngineCoreRequestType.ADD, request))

    def get_output(self) -> EngineCoreOutputs:
        if self._pending:
            return self._pending.popleft()
        while True:
            outputs = self._recv()
            if outputs.utility_result is None:
                return outputs

    def _recv(self) -> EngineCoreOutputs:
        self._check_alive()
        return self._decode_output(self.output_socket.recv(copy=False).buffer)

    def call_utility(self, method: str, *args: Any) -> Any:
        call_id = next(self._call_ids)
        self._check_alive()
        self.input_socket.send_multipart(
            self._request_frames(EngineCoreRequestType.UTILITY, UtilityCall(call_id, method, args))
        )
        while True:
            outputs = self._recv()
            result = outputs.utility_result
            if result is None:
                self._pending.append(outputs)  # a step's outputs: keep them for get_output
            elif result.call_id == call_id:
                if result.error is not None:
                    raise RuntimeError(result.error)
                return result.result


class AsyncMPClient(MPClient):
    def __init__(self, vllm_config: VllmConfig, use_thread: bool = False) -> None:
        super().__init__(vllm_config, asyncio_mode=True, use_thread=use_thread)
        self._utility_futures: dict[int, asyncio.Future[Any]] = {}

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        await self.input_socket.send_multipart(self._request_frames(EngineCoreRequestType.ADD, request))

    async def get_output_async(self) -> EngineCoreOutputs:
        """The next step's outputs; utility results met on the way go to their callers."""
        while True:
            try:
                self._check_alive()
                frame = await self.output_socket.recv(copy=False)
                outputs = self._decode_output(frame.buffer)
            except EngineDeadError:
                self._fail_utility_calls()
                raise
            result = outputs.utility_result
            if result is None:
                return outputs
            future = self._utility_futures.pop(result.call_id, None)
            if future is not None and not future.done():
                if result.error is not None:
                    future.set_exception(RuntimeError(result.error))
                else:
                    future.set_result(result.result)

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        """Needs get_output_async to be running (AsyncLLM's output handler) to see the answer."""
        self._check_alive()
        call_id = next(self._call_ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._utility_futures[call_id] = future
        await self.input_socket.send_multipart(
            self._request_frames(EngineCoreRequestType.UTILITY, UtilityCall(call_id, method, args))
        )
        return await future

    def _fail_utility_calls(self) -> None:
        for future in self._utility_futures.values():
            if not future.done():
                future.set_exception(EngineDeadError())
        self._utility_futures.clear()


def start_engine_interpreter(hf_config: bool = False) -> subprocess.Popen[bytes]:
    """A fresh interpreter for the engine core (spawn semantics: nothing of this process, its
    threads, sockets or CUDA state, is inherited; the package is found where this process found
    it). It imports the model code at once (and, with hf_config, transformers' config classes),
    then waits on stdin for its addresses and config, so a caller may start it before the config
    exists and overlap the two.

    NOTE: not `python -m minivllm.engine.launch`: -m puts the working directory first on
    sys.path, ahead of PYTHONPATH, so run from another checkout of minivllm the engine would run
    that checkout's code under this front end. The package root goes first instead; the working
    directory stays importable after it (a user's module named in the config)."""
    env = dict(os.environ)
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(minivllm.__file__)))
    # For the processes the engine starts in turn (executor workers).
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    bootstrap = f"import sys; sys.path.insert(0, {package_root!r}); from minivllm.engine.launch import main; main()"
    command = [sys.executable, "-c", bootstrap, *(["--hf-config"] if hf_config else [])]
    return subprocess.Popen(command, stdin=subprocess.PIPE, env=env)


def discard_engine_interpreter(process: subprocess.Popen[bytes]) -> None:
    """An interpreter started for a config that never came. It holds nothing yet (no sockets,
    no model), so it is stopped at once instead of being left to finish its imports."""
    assert process.stdin is not None
    process.stdin.close()
    process.terminate()
    _stop_process(process)


def _engine_main(*args: Any) -> None:
    """The engine's entry point, imported lazily: the front end never loads the model code."""
    from minivllm.engine.core import run_engine_core

    run_engine_core(*args)


def make_sync_client(vllm_config: VllmConfig, process: subprocess.Popen[bytes] | None = None) -> Any:
    """process: an interpreter from start_engine_interpreter, when multiprocessing is on (it
    serves the first engine core; data parallel cores after it start their own)."""
    if not envs.enable_multiprocessing():
        _refuse_data_parallel(vllm_config)
        return InprocClient(vllm_config)
    if vllm_config.parallel_config.data_parallel_size == 1:
        return SyncMPClient(vllm_config, process)
    from minivllm.engine.dp_client import SyncDPClient

    return SyncDPClient([SyncMPClient(config, process if rank == 0 else None)
                         for rank, config in enumerate(data_parallel_configs(vllm_config))])


def make_async_client(vllm_config: VllmConfig) -> Any:
    """The engine core in its own process, or (multiprocessing off, for debugging) a thread."""
    if not envs.enable_multiprocessing():
        _refuse_data_parallel(vllm_config)
        return AsyncMPClient(vllm_config, use_thread=True)
    if vllm_config.parallel_config.data_parallel_size == 1:
        return AsyncMPClient(vllm_config)
    from minivllm.engine.dp_client import AsyncDPClient

    return AsyncDPClient([AsyncMPClient(config) for config in data_parallel_configs(vllm_config)])


def data_parallel_configs(vllm_config: VllmConfig) -> list[VllmConfig]:
    """One config per data parallel engine core: the same, with its rank."""
    parallel = vllm_config.parallel_config
    return [dataclasses.replace(vllm_config, parallel_config=dataclasses.replace(parallel, data_parallel_rank=rank))
            for rank in range(parallel.data_parallel_size)]


def _refuse_data_parallel(vllm_config: VllmConfig) -> None:
    if vllm_config.parallel_config.data_parallel_size > 1:
        raise ValueError("data_parallel_size > 1 runs each engine core in its own process: it needs "
                         "MINIVLLM_ENABLE_MULTIPROCESSING=1 (the default).")
