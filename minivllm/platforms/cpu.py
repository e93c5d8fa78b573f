"""The CPU platform: minivllm's C++ kernels (minivllm/ops) where built, oneDNN-packed linear
weights in bfloat16, the CPU paged attention backend, decode steps replayed from a TorchScript
trace, and a KV cache sized in GiB (vLLM's VLLM_CPU_KVCACHE_SPACE)."""

from __future__ import annotations

import mmap
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from minivllm import envs
from minivllm.ops import cpu_kernels
from minivllm.platforms.cpu_env import bound_onednn_caches, configure_allocator
from minivllm.platforms.interface import GiB, Platform

if TYPE_CHECKING:
    from minivllm.config import CacheConfig

KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def _has_bf16_conversions() -> bool:
    """oneDNN's bfloat16 weight packing needs AVX-NE-CONVERT or AVX-512 BW/VL/DQ."""
    caps = torch.cpu.get_capabilities()
    return bool(caps.get("avx_ne_convert")) or all(caps.get(f) for f in ("avx512_bw", "avx512_vl", "avx512_dq"))


class CpuPlatform(Platform):
    device_type = "cpu"

    def init_process(self) -> None:
        configure_allocator()
        bound_onednn_caches()

    def use_custom_kernels(self, dtype: torch.dtype) -> bool:
        return dtype in KERNEL_DTYPES and cpu_kernels.enabled()

    def use_packed_linear(self, dtype: torch.dtype) -> bool:
        """bfloat16 only: float32 keeps F.linear, whose MKL GEMM is what the reference runs; the
        packed weight goes through minivllm's packed_linear op (which step traces can record).
        oneDNN packs bfloat16 weights only where the CPU converts bfloat16 in hardware."""
        return (dtype == torch.bfloat16 and envs.cpu_packed_linear() and torch.backends.mkldnn.is_available()
                and _has_bf16_conversions() and cpu_kernels.enabled())

    def use_gguf_quantized_linear(self, dtype: torch.dtype) -> bool:
        """bfloat16 only (float32 must equal the reference); torch's int4 kernel is the fallback
        of minivllm's Q4_1 kernel, so it must exist."""
        return dtype == torch.bfloat16 and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")

    def attention_backend_names(self, dtype: torch.dtype, head_size: int) -> list[str]:
        return ["CPU_PAGED", "TORCH_REF"]

    def graph_runner_qualname(self) -> str | None:
        return "minivllm.worker.step_traces.StepTraces"

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """minivllm's kernel (ops/csrc/argmax.cpp) for float32 rows: torch's CPU argmax reduces
        one element at a time, 3 ms per step for 64 rows of a 49k vocabulary."""
        if (x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] > 0 and x.stride(1) == 1
                and x.device.type == "cpu" and cpu_kernels.enabled()):
            return torch.ops.minivllm_cpu.argmax_rows(x)
        return x.argmax(dim=-1)

    def exponential_race_kernel(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """minivllm's (ops/csrc/exponential_race.cpp): torch's CPU exponential_ draws on one
        thread, ~1 ms per row of a 49k vocabulary, 20-30x the kernel's time."""
        return torch.ops.minivllm_cpu.exponential_race if cpu_kernels.enabled() else None

    def top_k_top_p_kernel(self) -> Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor | None],
                                             torch.Tensor] | None:
        """minivllm's (ops/csrc/top_k_top_p.cpp): torch's path sorts every row, ~4 ms a row of a
        49k vocabulary, 10-24x the kernel's time."""
        return torch.ops.minivllm_cpu.top_k_top_p if cpu_kernels.enabled() else None

    def kv_cache_memory_bytes(self, cache_config: CacheConfig, profile_run: Callable[[], None]) -> int:
        if cache_config.kv_cache_memory_bytes is not None:
            return cache_config.kv_cache_memory_bytes
        return int(cache_config.cpu_kvcache_space_gib * GiB)

    def zeros(self, num_bytes: int, device: torch.device) -> torch.Tensor:
        """Zeros without touching the pages: an anonymous mapping, whose pages the kernel zeroes
        when they are first written, so memory is only committed as the cache fills (torch.zeros
        writes every page: seconds for a few GiB).

        NOTE: not numpy's zeros, which asks for transparent huge pages on large arrays: where the
        kernel compacts memory for them on first write (THP defrag "madvise"), each layer's first
        write to its cache stalled ~27 ms, and filling a cache was 2-3x slower.
        """
        return torch.from_numpy(np.frombuffer(mmap.mmap(-1, num_bytes), dtype=np.uint8))
