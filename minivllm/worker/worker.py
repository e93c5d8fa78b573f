"""Worker: owns one device, the model on it, and its share of the KV cache (vLLM V1's worker API).

The executor drives it through a fixed sequence, by method name (Executor.collective_rpc), so
the same calls work whether the worker lives in the engine process or in one of several worker
processes: init_device, load_model, get_kv_cache_spec, determine_available_memory,
initialize_from_config, then execute_model once per step.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from minivllm.distributed.parallel_state import (
    destroy_distributed_environment,
    init_distributed_environment,
)
from minivllm.logger import init_logger
from minivllm.platforms import get_platform
from minivllm.platforms.interface import GiB
from minivllm.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from minivllm.config import VllmConfig
    from minivllm.core.kv_cache_interface import KVCacheConfig, KVCacheSpec
    from minivllm.core.outputs import ModelRunnerOutput
    from minivllm.core.sched.output import SchedulerOutput

logger = init_logger(__name__)


class Worker:
    def __init__(
        self, vllm_config: VllmConfig, local_rank: int = 0, rank: int = 0, distributed_init_method: str | None = None
    ) -> None:
        """rank: this worker's place among the engine's workers (its tensor-parallel rank);
        local_rank: among those on this machine (which device it takes);
        distributed_init_method: where the workers of a tensor-parallel engine meet (torch.distributed's
        init_method), None for a single worker."""
        self.vllm_config = vllm_config
        self.rank = rank
        self.local_rank = local_rank
        self.distributed_init_method = distributed_init_method
        self.device = torch.device(vllm_config.device_config.device)
        self.platform = get_platform(self.device.type)
        self.model_runner: ModelRunner | None = None

    def init_device(self) -> None:
        self.platform.init_process()
        world_size = self.vllm_config.parallel_config.world_size
        if world_size > 1:
            assert self.distributed_init_method is not None, "a tensor-parallel worker needs its world's address"
            init_distributed_environment(world_size, self.rank, self.distributed_init_method, self.device)
        # Every rank samples every request, and draws the same random numbers for it.
        torch.manual_seed(self.vllm_config.model_config.seed)
        self.model_runner = ModelRunner(self.vllm_config, self.device, self.platform)

    def load_model(self) -> None:
        start = time.perf_counter()
        runner = self._runner()
        runner.load_model()
        num_params = sum(p.numel() for p in runner.model.parameters())
        logger.info(
            "Loaded %s (%.1fM parameters, %s) on %s in %.2f s",
            self.vllm_config.model_config.architecture, num_params / 1e6,
            self.vllm_config.model_config.dtype, self.device, time.perf_counter() - start,
        )

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        return self._runner().get_kv_cache_spec()

    def determine_available_memory(self) -> int:
        """Bytes this worker's KV cache may take (on CUDA after a profiling run of the biggest step)."""
        return self.platform.kv_cache_memory_bytes(self.vllm_config.cache_config, self._runner().profile_run)

    def initialize_from_config(self, kv_cache_configs: list[KVCacheConfig]) -> None:
        """Allocate the KV cache of kv_cache_configs[rank] (every worker gets all of them)."""
        kv_cache_config = kv_cache_configs[self.rank]
        self._runner().initialize_kv_cache(kv_cache_config)
        num_bytes = sum(tensor.size for tensor in kv_cache_config.kv_cache_tensors)
        groups = kv_cache_config.kv_cache_groups
        # NOTE: with several groups a block holds one group's layers, and every group needs
        # blocks for the same tokens: the tokens the cache holds depend on the windows.
        logger.info(
            "KV cache: %d blocks of %d tokens, %.2f GiB, %d group(s): %s",
            kv_cache_config.num_blocks, kv_cache_config.block_size, num_bytes / GiB, len(groups),
            ", ".join(f"{len(g.layer_names)} x {type(g.kv_cache_spec).__name__}" for g in groups),
        )

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._runner().execute_model(scheduler_output)

    def check_health(self) -> None:
        """A worker that answers is alive (the executors watch their processes themselves)."""

    def shutdown(self) -> None:
        """Leave the distributed world (rank 0 removes the collectives' shared memory)."""
        destroy_distributed_environment()

    def _runner(self) -> ModelRunner:
        if self.model_runner is None:
            raise RuntimeError("init_device() must run first")
        return self.model_runner
