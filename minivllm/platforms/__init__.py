"""Platforms: one object per device kind (cpu, cuda) that answers every device question in one
place — which device, which kernels, which attention backends, which forward wrapper, how much
memory the KV cache gets.

This module itself imports no torch: the front end resolves `device="auto"` here while the
engine process is still importing torch and the model code, and the platform objects (which do
import torch) are only built where a model runs.
"""

from __future__ import annotations

import ast
import ctypes
import importlib.util
import os
from functools import cache, lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minivllm.platforms.interface import Platform


def resolve_device(device: str) -> str:
    """"auto" -> "cuda" when a CUDA device can run this torch, else "cpu"; "cpu", "cuda" and
    "cuda:N" are checked and kept; anything else is a ValueError."""
    if device == "auto":
        return "cuda" if cuda_available() else "cpu"
    if device.startswith("cuda"):
        if not cuda_available():
            raise ValueError(f"device={device!r} but CUDA is not available.")
        return device
    if device != "cpu":
        raise ValueError(f"Unsupported device {device!r}; use cpu, cuda or auto.")
    return device


@lru_cache(maxsize=1)
def cuda_available() -> bool:
    """Whether torch.cuda.is_available() says yes, without importing torch (~2 s) where that
    can be told: a CPU build of torch never has CUDA; for a CUDA build the driver's NVML counts
    the visible devices, and only without NVML is torch asked."""
    if _torch_cuda_version() is None:
        return False
    num_devices = _visible_cuda_devices()
    if num_devices is None:
        import torch

        return torch.cuda.is_available()
    return num_devices > 0


def _torch_cuda_version() -> str | None:
    """`torch.version.cuda`, read from torch/version.py's source (None for CPU builds)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return None
    try:
        tree = ast.parse((Path(spec.origin).parent / "version.py").read_text())
    except (OSError, SyntaxError):
        return None
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else (node.targets[0] if isinstance(node, ast.Assign) else None)
        if isinstance(target, ast.Name) and target.id == "cuda" and isinstance(node.value, ast.Constant):
            return node.value.value
    return None


def _visible_cuda_devices() -> int | None:
    """Devices the NVIDIA driver reports (through NVML: no CUDA context), after
    CUDA_VISIBLE_DEVICES; None when NVML cannot be loaded."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return 0
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    count = ctypes.c_uint(0)
    if nvml.nvmlInit_v2() != 0:  # a driver library without a working driver
        return 0
    try:
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return 0
    finally:
        nvml.nvmlShutdown()
    if visible is not None:
        return min(count.value, len([d for d in visible.split(",") if d.strip()]))
    return count.value


_PLATFORMS = {"cpu": ("minivllm.platforms.cpu", "CpuPlatform"), "cuda": ("minivllm.platforms.cuda", "CudaPlatform")}


@cache
def get_platform(device_type: str) -> Platform:
    """The platform object of a device kind ("cpu", "cuda"); imports torch. Other kinds (meta,
    where layers are built only for their shapes) get the UnspecifiedPlatform: torch's reference
    paths, nothing else. Which devices an engine may run on is resolve_device's decision."""
    module_name, class_name = _PLATFORMS.get(device_type, ("minivllm.platforms.interface", "UnspecifiedPlatform"))
    return getattr(importlib.import_module(module_name), class_name)()
