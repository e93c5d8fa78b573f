"""The Platform interface: every decision that depends on the kind of device, in one object.

A layer, the attention selector, the sampler, the worker and the model runner ask the platform
of their device instead of testing `device.type` themselves, so a new device kind is one new
subclass. What a platform names but does not own (attention backends, the forward wrapper) it
names by string, so this package imports nothing from the rest of the engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from minivllm.config import CacheConfig

GiB = 1 << 30


class Platform(ABC):
    device_type: str
    """torch's name of the device kind: "cpu", "cuda"."""

    def init_process(self) -> None:  # noqa: B027 - most devices need none
        """Process-wide settings a worker makes once, before it loads a model."""

    @abstractmethod
    def use_custom_kernels(self, dtype: torch.dtype) -> bool:
        """Whether layers built for this device in `dtype` run minivllm's kernels (CustomOp's
        forward_cpu / forward_cuda) instead of their torch reference path."""

    def use_packed_linear(self, dtype: torch.dtype) -> bool:
        """Whether Linear weights are repacked once after loading into the device library's GEMM
        layout (model/layers/linear.py)."""
        return False

    def use_gguf_quantized_linear(self, dtype: torch.dtype) -> bool:
        """Whether GGUF Q4_1 (and, where minivllm's kernels run, Q8_0 / Q5_0) layers keep their
        codes for steps of few rows (model/layers/quant.py)."""
        return False

    @abstractmethod
    def attention_backend_names(self, dtype: torch.dtype, head_size: int) -> list[str]:
        """Attention backends to try, best first (names of attention/selector.py's registry)."""

    def graph_runner_qualname(self) -> str | None:
        """The class that replays recorded forwards on this device (the CPU step traces, CUDA
        graphs), as "module.Class"; None to run every step eagerly."""
        return None

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's argmax (the first index of the maximum; NaN counts as largest)."""
        return x.argmax(dim=-1)

    def exponential_race_kernel(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """(probs [rows, vocab] float32, one int64 seed per row) -> each row's winner of an
        exponential race whose draws a counter-based generator derives from the seed; None
        where torch's exponential_ is fast enough (the sampler then races with it)."""
        return None

    def top_k_top_p_kernel(self) -> Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor | None],
                                             torch.Tensor] | None:
        """(logits [rows, vocab] float32, top_k [rows] int64 or None, top_p [rows] float32 or
        None) -> the logits with every token outside each row's top-k and then top-p at -inf;
        None where the sampler's sorting path is fast enough."""
        return None

    @abstractmethod
    def kv_cache_memory_bytes(self, cache_config: CacheConfig, profile_run: Callable[[], None]) -> int:
        """Bytes the KV cache may take on this device (kv_cache_memory_bytes, when set, wins);
        `profile_run` runs the biggest step once, for devices that size the cache from the
        memory left after it."""

    def zeros(self, num_bytes: int, device: torch.device) -> torch.Tensor:
        """A zero-filled uint8 buffer, for the KV cache.

        NOTE: the cache must hold zeros, not garbage: padded reads touch unused slots, and a NaN
        there would survive its zero attention weight (0 * NaN = NaN).
        """
        return torch.zeros(num_bytes, dtype=torch.uint8, device=device)


class UnspecifiedPlatform(Platform):
    """A device kind minivllm has no platform for: every layer takes its torch path."""

    device_type = "unspecified"

    def use_custom_kernels(self, dtype: torch.dtype) -> bool:
        return False

    def attention_backend_names(self, dtype: torch.dtype, head_size: int) -> list[str]:
        return ["TORCH_REF"]

    def kv_cache_memory_bytes(self, cache_config: CacheConfig, profile_run: Callable[[], None]) -> int:
        if cache_config.kv_cache_memory_bytes is None:
            raise ValueError("Set kv_cache_memory_bytes: this device has no platform to size the KV cache.")
        return cache_config.kv_cache_memory_bytes
