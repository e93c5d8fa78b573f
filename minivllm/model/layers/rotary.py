"""Rotary position embedding (rotate-half / GPT-NeoX style), with llama3 and linear scaling.

cos/sin are precomputed in float32 for every position up to max_position and indexed by the
flat `positions` tensor of the step, so requests at different positions share one call. The
torch path gathers the step's rows once (step_tables) for all layers; the CPU kernel reads them
by position itself and rotates q and k in place.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from minivllm.model.layers.custom_op import CustomOp
from minivllm.ops.cpu_kernels import VECTOR_ALIGN

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def get_rope_parameters(config: Any) -> dict[str, Any]:
    """rope_theta and scaling from an HF config, in both the transformers 4 and 5 forms."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None)
    if scaling:
        params = {**scaling, **params}
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths scaled, short kept, smooth between."""
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(CustomOp):
    def __init__(self, head_dim: int, max_position: int, rope_parameters: dict[str, Any]) -> None:
        super().__init__()
        self.use_cpu_kernels &= head_dim % (2 * VECTOR_ALIGN) == 0 and head_dim <= 256
        rope_type = rope_parameters["rope_type"]
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}.")
        base = float(rope_parameters["rope_theta"])
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if rope_type == "linear":
            inv_freq = inv_freq / rope_parameters["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, rope_parameters)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        # [max_position, head_dim]: cos twice, and sin with rotate-half's sign folded in, so that
        # rotating is x * cos + swap_halves(x) * sin (the same roundings as HF's
        # x * cos + rotate_half(x) * sin). persistent=False keeps them out of state_dict.
        self.register_buffer("cos_cache", torch.cat((cos, cos), dim=-1), persistent=False)
        self.register_buffer("sin_cache", torch.cat((-sin, sin), dim=-1), persistent=False)

    def step_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> Any:
        """What every layer's rotation needs for this step, computed once: the torch path's
        [T, 1, head_dim] cos and signed sin in the model dtype; the kernel's positions."""
        if self.use_cpu_kernels:
            return positions
        return self.cos_cache[positions].to(dtype).unsqueeze(1), self.sin_cache[positions].to(dtype).unsqueeze(1)

    def forward_native(
        self, tables: tuple[torch.Tensor, torch.Tensor], query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """query [T, heads, head_dim], key [T, kv_heads, head_dim] -> rotated copies."""
        cos, sin = tables
        return _rotate(query, cos, sin), _rotate(key, cos, sin)

    def forward_cpu(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotates query and key in place (views into the fused QKV output) and returns them."""
        torch.ops.minivllm_cpu.rotary_embedding(positions, query, key, self.cos_cache, self.sin_cache)
        return query, key


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x2, x1), dim=-1).mul_(signed_sin).add_(x * cos)
