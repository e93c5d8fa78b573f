"""LLMEngine: the synchronous engine behind `LLM` — processor, engine core, output processor.

add_request validates and tokenizes in the front end (fanning n > 1 out into child requests),
then hands the requests to the engine core; step() runs one engine-core step, turns its outputs
into RequestOutputs, and aborts in the core what the front end finished (stop strings).
"""

from __future__ import annotations

import subprocess
import time
from typing import Any

import msgspec

from minivllm import envs
from minivllm.config import VllmConfig
from minivllm.core.outputs import SchedulerStats
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.core_client import (
    discard_engine_interpreter,
    make_sync_client,
    start_engine_interpreter,
)
from minivllm.engine.parallel_sampling import fan_out
from minivllm.engine.processor import PromptType, start_front_end
from minivllm.metrics.reader import Metric, get_metrics_snapshot
from minivllm.metrics.stats import EngineStats
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, vllm_config: VllmConfig, engine_process: subprocess.Popen[bytes] | None = None) -> None:
        start = time.perf_counter()
        # The engine core in its own process (default) or in this one; a process loads the
        # model while this one loads the tokenizer.
        self.engine_core = make_sync_client(vllm_config, engine_process)
        self.tokenizer, self.processor, self.output_processor = start_front_end(vllm_config, self.engine_core)
        self.vllm_config = self.engine_core.vllm_config
        self.stats = EngineStats(startup_seconds=time.perf_counter() - start)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        # The engine's interpreter starts first and imports the model code while this process
        # reads the model's config.
        process = start_engine_interpreter() if envs.enable_multiprocessing() else None
        try:
            vllm_config = engine_args.create_engine_config()
        except BaseException:
            if process is not None:
                discard_engine_interpreter(process)
            raise
        return cls(vllm_config, process)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams, arrival_time: float | None = None
    ) -> None:
        """Validate and enqueue one request; a ValueError leaves the engine untouched."""
        if request_id in self.output_processor.request_states or request_id in self.output_processor.parent_requests:
            raise ValueError(f"Request id {request_id!r} is already in the engine.")
        request, prompt_text = self.processor.process_inputs(request_id, prompt, params, arrival_time)
        for child, parent, index in fan_out(request):
            self.output_processor.add_request(child, prompt_text, parent, index)
            self.engine_core.add_request(child)

    def abort_request(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(self.output_processor.abort_requests(request_ids))

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        if not self.has_unfinished_requests():
            return []  # NOTE: an idle engine process sends nothing to wait for
        core_outputs = self.engine_core.get_output()
        self.stats.record_scheduler_stats(core_outputs.scheduler_stats)
        processed = self.output_processor.process_outputs(core_outputs.outputs, self.stats)
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs

    def get_metrics(self) -> list[Metric]:
        return get_metrics_snapshot(self.stats, self.vllm_config.model_config.metrics_model_name)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix block; False if requests are still using blocks."""
        return self.engine_core.call_utility("reset_prefix_cache")

    def get_scheduler_stats(self) -> SchedulerStats:
        """The engine core's current state (running/waiting requests, KV cache usage...)."""
        return msgspec.convert(self.engine_core.call_utility("get_scheduler_stats"), SchedulerStats)

    def shutdown(self) -> None:
        """Stop the engine core (its process, sockets and files); the engine is unusable after."""
        self.engine_core.shutdown()
