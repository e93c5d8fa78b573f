"""Layers with two implementations: plain torch (forward_native, any device, the reference) and a
C++ CPU kernel (forward_cpu, minivllm/ops), as vLLM's CustomOp.

The choice is made once, when the layer is built: the model is constructed under its device and
dtype as torch defaults (model/loader.py), and the platform of that device says whether its
kernels serve that dtype (platforms/: on CPU in float32 or bfloat16 when the kernels are built
and enabled; never on CUDA yet). Subclasses narrow the choice further (a hidden size the
kernel's vector width divides).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from minivllm.platforms import get_platform


class CustomOp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        platform = get_platform(torch.get_default_device().type)
        self.use_cpu_kernels = platform.use_custom_kernels(torch.get_default_dtype())

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.use_cpu_kernels:
            return self.forward_cpu(*args, **kwargs)
        return self.forward_native(*args, **kwargs)

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def forward_cpu(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError
