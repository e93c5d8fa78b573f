"""Build the model on its device and fill it from a checkpoint (HF safetensors or GGUF).

Parameters are created uninitialised in the target dtype directly on the target device, then
each checkpoint tensor is streamed in once; a missing or unexpected tensor is an error, never a
silently random weight. Random weights are only ever asked for (load_format "dummy": a model's
speed measured without its checkpoint).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from minivllm.attention.backend import AttentionBackend
from minivllm.config import ModelConfig
from minivllm.logger import init_logger
from minivllm.model.registry import get_model_class
from minivllm.platforms import get_platform
from minivllm.platforms.interface import Platform

logger = init_logger(__name__)


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def iterate_safetensors_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"No *.safetensors files in {model_dir!r}; only safetensors checkpoints are supported.")
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def get_model(model_config: ModelConfig, device: torch.device, backend: AttentionBackend) -> nn.Module:
    dtype = getattr(torch, model_config.dtype)
    platform = get_platform(device.type)
    model_cls = get_model_class(model_config.hf_config.architectures)
    with default_dtype(dtype), torch.device(device):
        model = model_cls(model_config.hf_config, backend)
    # RoPE tables stay float32 whatever the model dtype (HF computes them in float32 too).
    for module in model.modules():
        if hasattr(module, "cos_cache"):
            module.cos_cache = module.cos_cache.float()
            module.sin_cache = module.sin_cache.float()
    if model_config.load_format == "dummy":
        initialize_dummy_weights(model)
    else:
        load_checkpoint(model, model_config, platform, dtype)
    if platform.use_packed_linear(dtype):
        process_weights_after_loading(model)
    return model.eval()


def load_checkpoint(model: nn.Module, model_config: ModelConfig, platform: Platform, dtype: torch.dtype) -> None:
    """Every weight from the checkpoint (and, for GGUF where the platform runs them, the
    quantized codes beside the dequantized weights)."""
    if model_config.is_gguf:
        from minivllm.model.gguf_loader import iterate_gguf_weights

        weights = iterate_gguf_weights(model_config.model, dtype)
    else:
        weights = iterate_safetensors_weights(model_config.model)
    loaded = model.load_weights(weights)
    missing = model.expected_weight_names() - loaded
    if missing:
        raise ValueError(f"Checkpoint {model_config.model!r} lacks weights: {sorted(missing)[:8]}...")
    quantized_linears = model_config.is_gguf and model_config.gguf_int4_decode and platform.use_gguf_quantized_linear(dtype)
    if quantized_linears:
        from minivllm.model.gguf_loader import iterate_gguf_q4_1

        model.load_weights(iterate_gguf_q4_1(model_config.model))
    if model_config.is_gguf and platform.use_custom_kernels(dtype):  # q8_0_linear: the kernel is ours
        from minivllm.model.gguf_loader import gguf_lm_head_q8_0, iterate_gguf_q8_0

        if quantized_linears:
            model.load_weights(iterate_gguf_q8_0(model_config.model))
        q8_0 = gguf_lm_head_q8_0(model_config.model)
        if q8_0 is not None:
            model.set_lm_head_q8_0(q8_0)


def initialize_dummy_weights(model: nn.Module, low: float = -1e-3, high: float = 1e-3) -> None:
    """Every parameter uniform in [low, high] (vLLM's dummy weights): the model's shapes and
    speed without its checkpoint. Small values keep activations finite through any depth."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(0)
    for param in model.parameters():
        if param.is_floating_point():
            param.data.uniform_(low, high, generator=generator)


def process_weights_after_loading(model: nn.Module) -> None:
    """Give every module that keeps a weight in a faster runtime layout the chance to convert it,
    once every checkpoint tensor is in (vLLM's hook of the same name)."""
    for module in model.modules():
        hook = getattr(module, "process_weights_after_loading", None)
        if hook is not None:
            hook()
