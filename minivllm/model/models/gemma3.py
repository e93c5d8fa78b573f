"""Gemma 3 (text): the Llama decoder with Gemma's changes, as HF's Gemma3ForCausalLM computes them.

- Local and global layers: most layers attend within a sliding window (`layer_types`), with
  their own rotary base (rope_parameters per layer type: 10k local, 1M global); the KV cache
  keeps only a window's blocks for them (core/single_type_kv_cache_manager.py).
- The embedding is scaled by sqrt(hidden_size) (rounded to the model dtype, as HF does); the
  lm_head is the unscaled embedding.
- Every norm is GemmaRMSNorm (scale by 1 + w), four per layer: before and after attention,
  before and after the MLP; q and k are normed per head before the rotation.
- The MLP's activation is GELU (tanh approximation); scores are scaled by
  query_pre_attn_scalar ** -0.5; the logits are soft-capped when final_logit_softcapping is set.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from minivllm.attention.backend import AttentionBackend
from minivllm.config import get_head_size, get_sliding_windows
from minivllm.model.layers.layernorm import GemmaRMSNorm
from minivllm.model.layers.rotary import RotaryEmbedding
from minivllm.model.layers.vocab_parallel_embedding import VocabParallelEmbedding
from minivllm.model.models.llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    attention_sublayer,
)

LOCAL, GLOBAL = "sliding_attention", "full_attention"


def gemma3_rope_parameters(config: Any) -> dict[str, dict[str, Any]]:
    """Rotary parameters per layer type. transformers 5 nests them by type; older configs have
    rope_theta (global) and rope_local_base_freq."""
    params = getattr(config, "rope_parameters", None) or {}
    if LOCAL in params and GLOBAL in params:
        return {kind: {"rope_type": "default", **params[kind]} for kind in (LOCAL, GLOBAL)}
    scaling = getattr(config, "rope_scaling", None) or {"rope_type": "default"}
    return {
        LOCAL: {"rope_type": "default", "rope_theta": getattr(config, "rope_local_base_freq", 10000.0)},
        GLOBAL: {**scaling, "rope_theta": getattr(config, "rope_theta", 1000000.0)},
    }


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: Any, backend: AttentionBackend, rotary_emb: RotaryEmbedding,
                 sliding_window: int | None) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        if getattr(config, "attn_logit_softcapping", None) is not None:
            raise ValueError("Attention logit soft-capping (Gemma 2) is not supported.")
        self.is_local = sliding_window is not None
        self.self_attn = LlamaAttention(
            config, backend, rotary_emb, bool(getattr(config, "attention_bias", False)), qk_norm=True,
            sliding_window=sliding_window, norm_cls=GemmaRMSNorm, scale=config.query_pre_attn_scalar**-0.5,
        )
        self.mlp = LlamaMLP(config)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(
        self,
        rope_tables: Any,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        attn_metadata: Any,
        logits_indices: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MLP's normed output, the residual stream before it): the next layer's input norm
        adds them, as in LlamaDecoderLayer. logits_indices: the rows carried past attention."""
        hidden_states, residual = attention_sublayer(
            self.input_layernorm, self.self_attn, rope_tables, hidden_states, residual, attn_metadata, logits_indices)
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        hidden_states = self.post_feedforward_layernorm(self.mlp(hidden_states))
        return hidden_states, residual


class Gemma3Model(nn.Module):
    def __init__(self, config: Any, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embed_scale = config.hidden_size**0.5
        head_dim, max_positions = get_head_size(config), config.max_position_embeddings
        self.rotary_embs = nn.ModuleDict({
            kind: RotaryEmbedding(head_dim, max_positions, params)
            for kind, params in gemma3_rope_parameters(config).items()
        })
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, backend, self.rotary_embs[LOCAL if window else GLOBAL], window)
            for window in get_sliding_windows(config)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.aux_hidden_state_layers: tuple[int, ...] = ()  # no EAGLE-3 heads for Gemma

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states of every token, or of the rows logits_indices names (the last
        layer runs o_proj and the MLP for those only, as LlamaModel)."""
        hidden_states = self.embed_tokens(input_ids)
        hidden_states = hidden_states * torch.tensor(self.embed_scale, dtype=hidden_states.dtype)
        tables = {kind: rope.step_tables(positions, hidden_states.dtype) for kind, rope in self.rotary_embs.items()}
        residual = None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            hidden_states, residual = layer(
                tables[LOCAL if layer.is_local else GLOBAL], hidden_states, residual, attn_metadata,
                logits_indices if i == last else None,
            )
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Weights, the tied lm_head (and its GGUF Q8_0 codes) and loading as LlamaForCausalLM."""

    def make_model(self, config: Any, backend: AttentionBackend) -> nn.Module:
        return Gemma3Model(config, backend)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden_states)
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
