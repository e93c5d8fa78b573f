"""AsyncLLM: the asyncio front end the server uses; many concurrent generate() calls share one
engine core running in its own process.

generate() tokenizes and validates in this process, sends the request to the engine core, and
yields RequestOutputs from the request's queue. One output_handler task receives every step's
outputs and runs output processing (detokenization, stop strings, logprobs) here; the
OutputProcessor puts each RequestOutput in its request's queue. Cancelling a generate() (or
abort()) aborts the request in the engine, which frees its blocks. If the engine dies, every
pending and future call raises EngineDeadError.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

import msgspec

from minivllm.config import VllmConfig
from minivllm.core.outputs import SchedulerStats
from minivllm.engine.arg_utils import AsyncEngineArgs
from minivllm.engine.core_client import make_async_client
from minivllm.engine.event_stream import EngineEventStream, EventSubscription
from minivllm.engine.exceptions import EngineDeadError
from minivllm.engine.processor import PromptType, start_front_end
from minivllm.logger import init_logger
from minivllm.metrics.loggers import LoggingStatLogger
from minivllm.metrics.reader import Metric, get_metrics_snapshot
from minivllm.metrics.stats import EngineStats
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minivllm.engine.output_processor import RequestOutputQueue

logger = init_logger(__name__)


class AsyncLLM:
    def __init__(self, vllm_config: VllmConfig) -> None:
        start = time.perf_counter()
        # NOTE: with multiprocessing off (debugging), the engine core runs in a thread instead.
        self.engine_core = make_async_client(vllm_config)
        self.tokenizer, self.processor, self.output_processor = start_front_end(vllm_config, self.engine_core)
        self.vllm_config = self.engine_core.vllm_config
        self.stats = EngineStats(startup_seconds=time.perf_counter() - start)
        self.stat_logger = LoggingStatLogger()
        self.output_handler: asyncio.Task[None] | None = None
        self.dead_error: EngineDeadError | None = None
        self.engine_events = EngineEventStream(self._set_event_collection)

    @classmethod
    def from_engine_args(cls, engine_args: AsyncEngineArgs) -> AsyncLLM:
        return cls(engine_args.create_engine_config())

    @property
    def errored(self) -> bool:
        return self.dead_error is not None or self.engine_core.engine_dead

    async def generate(
        self, prompt: PromptType, sampling_params: SamplingParams, request_id: str, priority: int = 0
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream the outputs of one request (cumulative, delta or final, per output_kind)."""
        queue = await self.add_request(request_id, prompt, sampling_params, priority)
        async for output in self.stream_outputs(request_id, queue):
            yield output

    async def stream_outputs(self, request_id: str, queue: RequestOutputQueue) -> AsyncGenerator[RequestOutput, None]:
        """The outputs of a request added with add_request; closing or cancelling the stream
        before the request finished aborts it."""
        finished = False
        try:
            while not finished:
                output = await queue.get()
                if isinstance(output, BaseException):
                    raise output
                finished = output.finished
                yield output
        except (asyncio.CancelledError, GeneratorExit):
            if not finished:
                await self.abort(request_id)
            raise

    async def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0
    ) -> RequestOutputQueue:
        """Validate and send one request to the engine; a ValueError here means it was rejected
        and nothing was added. Its outputs arrive in the returned queue (see stream_outputs)."""
        self.check_health()
        self._start_output_handler()
        request, prompt_text = self.processor.process_inputs(request_id, prompt, params, priority=priority)
        queue: RequestOutputQueue = asyncio.Queue()
        engine_requests = self.output_processor.add_request(request, prompt_text, queue)
        try:
            for engine_request in engine_requests:
                await self.engine_core.add_request_async(engine_request)
        except BaseException:
            # Cancelled (the client left) part-way through a large n: the samples already sent
            # must not go on generating for nobody.
            await self.abort(request_id)
            raise
        return queue

    async def abort(self, request_id: str) -> None:
        """Stop a request: it produces no more output and its blocks are freed in the engine."""
        engine_ids = self.output_processor.abort_requests([request_id])
        if not self.errored:
            self.engine_core.abort_requests(engine_ids)

    def _start_output_handler(self) -> None:
        if self.output_handler is None or self.output_handler.done():
            self.output_handler = asyncio.get_running_loop().create_task(self._run_output_handler())

    async def _run_output_handler(self) -> None:
        try:
            while True:
                core_outputs = await self.engine_core.get_output_async()
                processed = self.output_processor.process_outputs(core_outputs, self.stats)
                if core_outputs.events is not None:
                    self.engine_events.publish(core_outputs.events, self.stats.scheduler)
                self.stat_logger.maybe_log(self.stats)
                # The outputs are in their queues, but no caller runs before this task awaits
                # again: the abort of what a stop string finished leaves first, ahead of
                # anything a caller who saw that output may send (re-using its id, say).
                self.engine_core.abort_requests(processed.reqs_to_abort)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            error = e if isinstance(e, EngineDeadError) else EngineDeadError(f"The engine's output handler failed: {e!r}")
            if not isinstance(e, EngineDeadError):
                logger.exception("The output handler failed")
            self.dead_error = error
            self.output_processor.propagate_error(error)

    def check_health(self) -> None:
        """Raise EngineDeadError if the engine core is gone."""
        if self.errored:
            raise self.dead_error or EngineDeadError()

    async def get_scheduler_stats(self) -> SchedulerStats:
        self.check_health()
        self._start_output_handler()
        return msgspec.convert(await self.engine_core.call_utility_async("get_scheduler_stats"), SchedulerStats)

    async def reset_prefix_cache(self) -> bool:
        self.check_health()
        self._start_output_handler()
        return await self.engine_core.call_utility_async("reset_prefix_cache")

    async def subscribe_events(self) -> EventSubscription:
        """Watch the engine core's events (the dashboard's data): each step's EngineEvents and
        scheduler stats as an SSE message. One engine core only: data parallel engines refuse
        (ValueError), their cores' block maps and queues are separate."""
        if self.vllm_config.parallel_config.data_parallel_size > 1:
            raise ValueError("Engine events (the dashboard) show one engine core; data_parallel_size > 1 "
                             "is not supported.")
        self.check_health()
        self._start_output_handler()
        return await self.engine_events.subscribe()

    def unsubscribe_events(self, subscription: EventSubscription) -> None:
        self.engine_events.unsubscribe(subscription)

    async def _set_event_collection(self, on: bool) -> None:
        if not self.errored:
            await self.engine_core.call_utility_async("start_event_collection" if on else "stop_event_collection")

    def get_metrics(self) -> list[Metric]:
        return get_metrics_snapshot(
            self.stats, self.vllm_config.model_config.metrics_model_name, self.vllm_config.cache_config)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def shutdown(self) -> None:
        if self.output_handler is not None:
            self.output_handler.cancel()
        self.engine_core.shutdown()
