"""Small torch helpers shared by the worker and the samplers."""

from __future__ import annotations

import numpy as np
import torch


def to_device(array: np.ndarray | list[int], device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host array on the device without waiting for it: a copy from pageable memory first waits
    for everything queued on the stream (the forward in flight), so the array goes through pinned
    memory and is copied non-blocking (torch's pinned allocator keeps it until the copy is done).
    On CPU the array itself."""
    tensor = torch.as_tensor(array, dtype=dtype)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
