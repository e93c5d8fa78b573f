"""Persistent step buffers: allocated once, filled in place every step, so a step allocates no
input tensors and their addresses never change (what replaying a recorded forward needs).

A CpuGpuBuffer is a host tensor with a numpy view (filled by vectorised numpy) and its device
copy; on CPU the two are one tensor (vLLM's CpuGpuBuffer).
"""

from __future__ import annotations

import torch


class CpuGpuBuffer:
    def __init__(self, size: int | tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        on_host = device.type == "cpu"
        self.cpu = torch.zeros(size, dtype=dtype, pin_memory=not on_host)
        self.np = self.cpu.numpy()
        self.gpu = self.cpu if on_host else torch.zeros_like(self.cpu, device=device)

    def copy_to_gpu(self, n: int) -> torch.Tensor:
        """The first n entries (rows) on the device (no copy on CPU)."""
        if self.gpu is self.cpu:
            return self.cpu[:n]
        return self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)
