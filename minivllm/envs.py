"""Every environment variable minivllm reads, in one place, with its default."""

from __future__ import annotations

import os


def _bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    return default if value is None else value.strip().lower() not in ("0", "false", "no", "off", "")


def enable_multiprocessing() -> bool:
    """MINIVLLM_ENABLE_MULTIPROCESSING (default 1): run the engine core in its own process.
    0 runs it in the caller's process (LLM) or in a thread (AsyncLLM), for debugging."""
    return _bool("MINIVLLM_ENABLE_MULTIPROCESSING", True)


def cpu_kvcache_space_gib() -> float | None:
    """MINIVLLM_CPU_KVCACHE_SPACE: KV cache size in GiB on CPU; None when unset (CacheConfig's
    default then applies)."""
    value = os.environ.get("MINIVLLM_CPU_KVCACHE_SPACE")
    return None if value is None else float(value)


def logging_level() -> str:
    """MINIVLLM_LOGGING_LEVEL (default INFO)."""
    return os.environ.get("MINIVLLM_LOGGING_LEVEL", "INFO").upper()


def engine_ready_timeout_s() -> float:
    """MINIVLLM_ENGINE_READY_TIMEOUT_S (default 600): how long to wait for the engine process to
    load the model and report ready."""
    return float(os.environ.get("MINIVLLM_ENGINE_READY_TIMEOUT_S", "600"))


def cache_root() -> str:
    """MINIVLLM_CACHE_ROOT (default ~/.cache/minivllm): where built CPU kernels and the Gemma 3
    GGUF assembled from its PyPI chunks are kept."""
    return os.path.expanduser(os.environ.get("MINIVLLM_CACHE_ROOT", "~/.cache/minivllm"))


def attention_backend() -> str:
    """MINIVLLM_ATTENTION_BACKEND (default auto): TORCH_REF or CPU_PAGED to force one; auto takes
    CPU_PAGED on CPU when its kernels are built and support the model, else TORCH_REF."""
    return os.environ.get("MINIVLLM_ATTENTION_BACKEND", "auto").upper()


def cpu_kernels() -> bool:
    """MINIVLLM_CPU_KERNELS (default 1): use the built C++ CPU kernels (minivllm/ops); 0 runs the
    torch path of every layer instead."""
    return _bool("MINIVLLM_CPU_KERNELS", True)


def cpu_packed_linear() -> bool:
    """MINIVLLM_CPU_PACKED_LINEAR (default 1): on CPU in bfloat16, keep linear weights in oneDNN's
    packed layout (model/layers/linear.py); 0 applies the plain weights with F.linear."""
    return _bool("MINIVLLM_CPU_PACKED_LINEAR", True)


def cpu_bf16_gemm() -> str:
    """MINIVLLM_CPU_BF16_GEMM (default auto): which GEMM runs bfloat16 linears on CPU, onednn
    (oneDNN's, with the CPU's bfloat16 dot product) or minivllm (ops/csrc/bf16_gemm.cpp, float32
    FMAs on the bfloat16 weight); auto times both once per process (platforms/cpu_gemm.py)."""
    value = os.environ.get("MINIVLLM_CPU_BF16_GEMM", "auto").strip().lower()
    if value not in ("auto", "onednn", "minivllm"):
        raise ValueError(f"MINIVLLM_CPU_BF16_GEMM must be auto, onednn or minivllm, got {value!r}.")
    return value
