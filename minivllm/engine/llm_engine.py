"""LLMEngine: the synchronous engine behind `LLM` — processor, engine core, output processor.

add_request validates and tokenizes in the front end (Processor), registers the request with the
OutputProcessor (which fans n > 1 out into child requests) and hands the engine-core requests to
the core; step() runs one engine-core step, turns its outputs into RequestOutputs, and aborts in
the core what the front end finished (stop strings) before returning them.
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
        # The settings that need no model were checked when engine_args was made. The engine's
        # interpreter starts now and imports the model code (~1.4 s) while this process reads
        # the model's config (an HF directory's takes ~3 s: transformers' config classes import
        # torch); should the config refuse a setting, that interpreter is stopped at once.
        process = None
        if envs.enable_multiprocessing():
            process = start_engine_interpreter(hf_config=not engine_args.is_gguf())
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
        self, request_id: str, prompt: PromptType, params: SamplingParams, arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        """Validate and enqueue one request; a ValueError leaves the engine untouched."""
        request, prompt_text = self.processor.process_inputs(request_id, prompt, params, arrival_time, priority)
        for engine_request in self.output_processor.add_request(request, prompt_text):
            self.engine_core.add_request(engine_request)

    def abort_request(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(self.output_processor.abort_requests(request_ids))

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        if not self.has_unfinished_requests():
            return []  # NOTE: an idle engine process sends nothing to wait for
        processed = self.output_processor.process_outputs(self.engine_core.get_output(), self.stats)
        # Before the caller sees these outputs, and may re-use a finished request's id.
        self.engine_core.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs

    def get_metrics(self) -> list[Metric]:
        return get_metrics_snapshot(
            self.stats, self.vllm_config.model_config.metrics_model_name, self.vllm_config.cache_config)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix block; False if requests are still using blocks."""
        return self.engine_core.call_utility("reset_prefix_cache")

    def get_scheduler_stats(self) -> SchedulerStats:
        """The engine core's current state (running/waiting requests, KV cache usage...)."""
        return msgspec.convert(self.engine_core.call_utility("get_scheduler_stats"), SchedulerStats)

    def shutdown(self) -> None:
        """Stop the engine core (its process, sockets and files); the engine is unusable after."""
        self.engine_core.shutdown()
