"""EngineCore: the inner loop of the engine — schedule, execute, update — one step at a time.

It owns the Scheduler and the executor (and through it the workers and the KV cache). It sizes
the KV cache at start-up: the workers say how many blocks fit, the scheduler's KV manager is
built with exactly that many.
"""

from __future__ import annotations

import dataclasses
import time

from minivllm.config import VllmConfig
from minivllm.core.outputs import EngineCoreOutputs
from minivllm.core.request import Request, RequestStatus
from minivllm.core.sched.scheduler import Scheduler
from minivllm.engine.messages import EngineCoreRequest
from minivllm.executor.uniproc_executor import UniProcExecutor
from minivllm.logger import init_logger

logger = init_logger(__name__)


class EngineCore:
    def __init__(self, vllm_config: VllmConfig) -> None:
        start = time.perf_counter()
        self.model_executor = UniProcExecutor(vllm_config)
        num_blocks = self.model_executor.determine_num_available_blocks()
        cache_config = dataclasses.replace(vllm_config.cache_config, num_gpu_blocks=num_blocks)
        self.vllm_config = dataclasses.replace(vllm_config, cache_config=cache_config)
        self.model_executor.initialize_cache(num_blocks)
        self.scheduler = Scheduler(self.vllm_config.scheduler_config, cache_config)
        logger.info("Engine core ready in %.2f s", time.perf_counter() - start)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.scheduler.add_request(
            Request(
                request.request_id,
                request.prompt_token_ids,
                request.sampling_params,
                request.eos_token_id,
                request.arrival_time,
                request.cache_salt,
            )
        )

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> EngineCoreOutputs:
        """Schedule one batch, run it, and return each request's new tokens and the stats."""
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats())
        scheduler_output = self.scheduler.schedule()
        model_output = self.model_executor.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        return EngineCoreOutputs(outputs, self.scheduler.make_stats())

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()
