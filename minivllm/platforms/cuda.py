"""The CUDA platform: torch's kernels, Triton paged attention (the torch reference where Triton is
missing), decode steps replayed from CUDA graphs, and a KV cache sized from the memory a profiling run leaves
free under gpu_memory_utilization, as vLLM does."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from minivllm.logger import init_logger
from minivllm.platforms.interface import GiB, Platform

if TYPE_CHECKING:
    from minivllm.config import CacheConfig

logger = init_logger(__name__)


class CudaPlatform(Platform):
    device_type = "cuda"

    def use_custom_kernels(self, dtype: torch.dtype) -> bool:
        return False

    def attention_backend_names(self, dtype: torch.dtype, head_size: int) -> list[str]:
        return ["TRITON_ATTN", "TORCH_REF"]

    def graph_runner_qualname(self) -> str | None:
        return "minivllm.worker.cuda_graph.CudaGraphRunner"

    def kv_cache_memory_bytes(self, cache_config: CacheConfig, profile_run: Callable[[], None]) -> int:
        if cache_config.kv_cache_memory_bytes is not None:
            return cache_config.kv_cache_memory_bytes
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        profile_run()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        free, total = torch.cuda.mem_get_info(device)
        # Memory used by others (other processes, the CUDA context) is not ours to take.
        non_torch = total - free - torch.cuda.memory_reserved(device)
        available = int(total * cache_config.gpu_memory_utilization - peak - non_torch)
        logger.info("GPU memory: %.2f GiB x gpu_memory_utilization %.2f, less the profiling run's peak "
                    "(weights and activations) %.2f GiB and %.2f GiB used outside torch: %.2f GiB for the KV cache",
                    total / GiB, cache_config.gpu_memory_utilization, peak / GiB, non_torch / GiB, available / GiB)
        return available
