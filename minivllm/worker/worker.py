"""Worker: owns one device, the model on it, and its share of the KV cache.

It sizes the KV cache from the memory budget (a GiB figure on CPU, a utilisation fraction of
device memory on CUDA), allocates it, and runs the ModelRunner for each step.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from minivllm.core.kv_cache_manager import cdiv
from minivllm.logger import init_logger
from minivllm.worker.cpu_env import configure_allocator
from minivllm.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from minivllm.config import VllmConfig
    from minivllm.core.outputs import ModelRunnerOutput
    from minivllm.core.sched.output import SchedulerOutput

logger = init_logger(__name__)
GiB = 1 << 30


class Worker:
    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config
        self.device = torch.device(vllm_config.device_config.device)
        if self.device.type == "cpu":
            configure_allocator()
        torch.manual_seed(vllm_config.model_config.seed)
        self.model_runner = ModelRunner(vllm_config, self.device)

    def load_model(self) -> None:
        start = time.perf_counter()
        self.model_runner.load_model()
        num_params = sum(p.numel() for p in self.model_runner.model.parameters())
        logger.info(
            "Loaded %s (%.1fM parameters, %s) on %s in %.2f s",
            self.vllm_config.model_config.architecture, num_params / 1e6,
            self.vllm_config.model_config.dtype, self.device, time.perf_counter() - start,
        )

    def determine_num_available_blocks(self) -> int:
        """How many KV blocks fit in the memory budget (capped at what can ever be used)."""
        cache_config = self.vllm_config.cache_config
        sched_config = self.vllm_config.scheduler_config
        if cache_config.num_gpu_blocks_override is not None:
            return cache_config.num_gpu_blocks_override
        bytes_per_block = self.model_runner.kv_cache_bytes_per_block()
        if cache_config.kv_cache_memory_bytes is not None:
            budget = cache_config.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            budget = self._cuda_kv_budget(cache_config.gpu_memory_utilization)
        else:
            budget = int(cache_config.cpu_kvcache_space_gib * GiB)
        num_blocks = budget // bytes_per_block
        # More blocks than max_num_seqs full-length requests can use would only waste memory.
        max_useful = sched_config.max_num_seqs * cdiv(sched_config.max_model_len, cache_config.block_size) + 1
        return int(min(num_blocks, max_useful))

    def _cuda_kv_budget(self, utilization: float) -> int:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.model_runner.profile_run()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        # Memory used by others (other processes, the CUDA context) is not ours to take.
        non_torch = total - free - torch.cuda.memory_reserved(self.device)
        return int(total * utilization - peak - non_torch)

    def initialize_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)
        block_size = self.vllm_config.cache_config.block_size
        size = num_blocks * self.model_runner.kv_cache_bytes_per_block()
        logger.info(
            "KV cache: %d blocks of %d tokens = %d tokens, %.2f GiB",
            num_blocks, block_size, num_blocks * block_size, size / GiB,
        )

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)
