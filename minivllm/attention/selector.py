"""Which attention backend runs a model: chosen once, at start-up, from a registry.

The platform lists the backends that can run on its device, best first; the first one that
supports the model's layers wins. MINIVLLM_ATTENTION_BACKEND forces one by name (an error if it
cannot run). Backends are registered by module path, as model/registry.py registers model
classes, so selecting one imports only that one.
"""

from __future__ import annotations

import importlib

import torch

from minivllm import envs
from minivllm.attention.backend import AttentionBackend
from minivllm.logger import init_logger
from minivllm.platforms.interface import Platform

logger = init_logger(__name__)

# name -> (module under minivllm.attention, class name)
_BACKENDS: dict[str, tuple[str, str]] = {
    "TORCH_REF": ("torch_ref", "TorchRefAttentionBackend"),
    "CPU_PAGED": ("cpu_paged", "CpuPagedAttentionBackend"),
    "TRITON_ATTN": ("triton_attn", "TritonAttentionBackend"),
}


def backend_class(name: str) -> type[AttentionBackend]:
    if name not in _BACKENDS:
        raise ValueError(f"Unknown attention backend {name!r}; known: {', '.join(_BACKENDS)}.")
    module_name, class_name = _BACKENDS[name]
    return getattr(importlib.import_module(f"minivllm.attention.{module_name}"), class_name)


def get_attn_backend(
    platform: Platform, dtype: torch.dtype, head_size: int, sliding_window: int | None = None
) -> AttentionBackend:
    """The backend for attention layers of this shape on `platform`'s device."""
    forced = envs.attention_backend()
    candidates = platform.attention_backend_names(dtype, head_size) if forced == "AUTO" else [forced]
    reasons = []
    for name in candidates:
        cls = backend_class(name)
        reason = cls.unsupported_reason(platform.device_type, dtype, head_size)
        if reason is None and sliding_window is not None and not cls.supports_sliding_window:
            reason = "no sliding-window attention"
        if reason is None:
            if reasons:
                logger.info("Attention backend %s (%s).", name, "; ".join(reasons))
            return cls()
        reasons.append(f"{name}: {reason}")
    where = f"{platform.device_type}, {dtype}, head size {head_size}"
    raise ValueError(f"No attention backend can run this model ({where}): {'; '.join(reasons)}.")
