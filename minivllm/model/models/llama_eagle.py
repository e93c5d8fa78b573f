"""EAGLE-1 and EAGLE-3 draft heads for Llama-family targets, loaded from their HF checkpoints.

A head proposes the next tokens from the target's hidden states: each draft step reads the
sampled token's embedding (shared with the target) and a hidden state (the target's at the first
step, the head's own afterwards), runs a decoder layer or a few, and gives logits over the
target's vocabulary. Parameter names are the checkpoint's, with q/k/v and gate/up fused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from minivllm.attention.backend import AttentionBackend
from minivllm.config import get_head_size
from minivllm.model.layers.layernorm import RMSNorm
from minivllm.model.layers.linear import Linear, default_weight_loader
from minivllm.model.layers.rotary import RotaryEmbedding, get_rope_parameters
from minivllm.model.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    expected_stacked_names,
    load_stacked_weights,
)


def eagle3_aux_layers(num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose INPUT residual stream (hidden_states + residual before the layer
    runs) EAGLE-3 reads, in the order fc expects them concatenated: (2, L // 2, L - 3)."""
    if num_target_layers < 3:
        raise ValueError(f"EAGLE-3 needs a target with at least 3 layers, not {num_target_layers}.")
    return 2, num_target_layers // 2, num_target_layers - 3


class _LlamaDraftHead(nn.Module):
    """What both heads share: the target's embedding, one rotary table, checkpoint name mapping."""

    # Checkpoint names (after dropping a "model." prefix) that are not the head's to load.
    skipped_prefixes: tuple[str, ...] = ("embed_tokens.",)
    # Checkpoint name prefix -> parameter name prefix.
    renamed_prefixes: dict[str, str] = {}

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        # The target's embedding, set by bind_target (shared: the head stores none of its own).
        self.embed_tokens: nn.Embedding | None = None
        self.rotary_emb = RotaryEmbedding(
            get_head_size(config), config.max_position_embeddings, get_rope_parameters(config)
        )

    def bind_target(self, target: LlamaForCausalLM) -> None:
        """Share the target's token embedding (its width must be the head's hidden size)."""
        embed = target.model.embed_tokens
        if embed.embedding_dim != self.config.hidden_size:
            raise ValueError(f"{type(self).__name__}: the target's embedding width {embed.embedding_dim} "
                             f"is not the head's hidden_size {self.config.hidden_size}.")
        self.embed_tokens = embed

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is None:
            raise RuntimeError(f"{type(self).__name__}: call bind_target(target) before running the head.")
        return self.embed_tokens(input_ids)  # [num_tokens, hidden]

    def _param_name(self, name: str) -> str | None:
        """The parameter a checkpoint tensor fills (q/k/v, gate/up still unfused), None to skip."""
        name = name.removeprefix("model.")
        if "rotary_emb.inv_freq" in name or name.startswith(self.skipped_prefixes):
            return None
        for ckpt_prefix, param_prefix in self.renamed_prefixes.items():
            if name.startswith(ckpt_prefix):
                return param_prefix + name[len(ckpt_prefix):]
        return name

    def _load_special(self, name: str, tensor: torch.Tensor) -> bool:
        """Load a tensor load_stacked_weights cannot (returns True when it did)."""
        return False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (HF names, bare or "model."-prefixed) in; returns the names loaded."""
        special: set[str] = set()

        def stacked() -> Iterator[tuple[str, torch.Tensor]]:
            for ckpt_name, tensor in weights:
                name = self._param_name(ckpt_name)
                if name is None:
                    continue
                if self._load_special(name, tensor):
                    special.add(name)
                else:
                    yield name, tensor

        loaded = load_stacked_weights(self, stacked())
        return loaded | special

    def expected_weight_names(self) -> set[str]:
        """What load_weights must have loaded for the head to be complete."""
        return {name for name in expected_stacked_names(self) if not name.startswith("embed_tokens.")}


class EagleLlamaForCausalLM(_LlamaDraftHead):
    """EAGLE-1: fc(cat(embed(token), hidden)) -> Llama decoder layers, the first without its input
    RMSNorm -> hidden + residual (no final norm); logits through the target's lm_head."""

    skipped_prefixes = ("embed_tokens.", "lm_head.")

    def __init__(self, config: Any, backend: AttentionBackend, target_hidden_size: int) -> None:
        super().__init__(config)
        hidden = config.hidden_size
        if hidden != target_hidden_size:
            raise ValueError(f"EAGLE-1 head hidden_size {hidden} does not match the target's hidden "
                             f"size {target_hidden_size}.")
        # Some conversions have a bias: said by the config, or found in the checkpoint (_load_special).
        self.fc = Linear(2 * hidden, hidden, bias=bool(getattr(config, "eagle_fc_bias", False)))
        qkv_bias = bool(getattr(config, "attention_bias", False))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, backend, self.rotary_emb, qkv_bias, False, input_layernorm=i > 0)
            for i in range(config.num_hidden_layers)
        )
        self._target_logits: Callable[[torch.Tensor], torch.Tensor] | None = None

    def bind_target(self, target: LlamaForCausalLM) -> None:
        """Share the target's embedding and lm_head."""
        super().bind_target(target)
        self._target_logits = target.compute_logits

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor,
                attn_metadata: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids, positions [T]; hidden_states [T, H] (the target's final ones, or the head's
        own) -> (hidden for logits, hidden to feed back), one [T, H] tensor both."""
        embeds = self._embed(input_ids)
        hidden_states = self.fc(torch.cat((embeds, hidden_states), dim=-1))  # [T, H]
        rope_tables = self.rotary_emb.step_tables(positions, hidden_states.dtype)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(rope_tables, hidden_states, residual, attn_metadata)
        hidden_states = hidden_states + residual
        return hidden_states, hidden_states

    def compute_draft_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[T, H] -> [T, target vocab] float32, through the bound target's lm_head."""
        if self._target_logits is None:
            raise RuntimeError("EagleLlamaForCausalLM: call bind_target(target) before computing logits.")
        return self._target_logits(hidden_states)

    def _load_special(self, name: str, tensor: torch.Tensor) -> bool:
        if name != "fc.bias" or self.fc.bias is not None:
            return False
        weight = self.fc.weight
        self.fc.bias = nn.Parameter(torch.empty(self.fc.output_size, dtype=weight.dtype, device=weight.device),
                                    requires_grad=False)
        default_weight_loader(self.fc.bias, tensor)
        return True


class Eagle3DecoderLayer(nn.Module):
    """EAGLE-3's one layer: attention reads [norm(embeds), norm(hidden)], 2H wide; the residual
    stream is the incoming hidden state (its normed form with config.norm_before_residual)."""

    def __init__(self, config: Any, backend: AttentionBackend, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        qkv_bias = bool(getattr(config, "attention_bias", False))
        self.self_attn = LlamaAttention(config, backend, rotary_emb, qkv_bias, False, input_size=2 * hidden)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def forward(self, rope_tables: Any, embeds: torch.Tensor, hidden_states: torch.Tensor,
                attn_metadata: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds, hidden_states [T, H] -> (MLP output, residual), [T, H] each.
        NOTE: the residual may be updated in place (the fused add-RMSNorm kernel): hidden_states
        must be the caller's to give away."""
        residual = hidden_states
        hidden_states = self.hidden_norm(hidden_states)
        if self.norm_before_residual:
            residual = hidden_states
        x = torch.cat((self.input_layernorm(embeds), hidden_states), dim=-1)  # [T, 2H]
        x = self.self_attn(rope_tables, x, attn_metadata)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Eagle3LlamaForCausalLM(_LlamaDraftHead):
    """EAGLE-3: fc combines three target layers' hidden states (eagle3_aux_layers) into one; one
    decoder layer (`midlayer`) and a final norm; its own lm_head over a draft vocabulary that d2t
    maps into the target's (target id = draft id + d2t[draft id])."""

    skipped_prefixes = ("embed_tokens.", "t2d")
    renamed_prefixes = {"layers.0.": "midlayer."}  # converted checkpoints that use vLLM's name

    def __init__(self, config: Any, backend: AttentionBackend, target_hidden_size: int) -> None:
        super().__init__(config)
        hidden = config.hidden_size
        eagle_config = getattr(config, "eagle_config", None) or {}
        if not eagle_config.get("use_aux_hidden_state", True):
            raise ValueError("EAGLE-3 heads without auxiliary hidden states are not supported.")
        fc_input = 3 * (getattr(config, "target_hidden_size", None) or hidden)
        if fc_input != 3 * target_hidden_size:
            raise ValueError(f"EAGLE-3 head fc input size {fc_input} does not match 3 x the target's "
                             f"hidden size {target_hidden_size} = {3 * target_hidden_size}.")
        self.fc = Linear(fc_input, hidden)
        self.midlayer = Eagle3DecoderLayer(config, backend, self.rotary_emb)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.draft_vocab_size = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.lm_head = Linear(hidden, self.draft_vocab_size)
        # [draft_vocab]: target id - draft id; zeros (the identity) unless the checkpoint has one.
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64))

    def bind_target(self, target: LlamaForCausalLM) -> None:
        """Share the target's embedding; its vocabulary must be the one d2t maps into."""
        if target.config.vocab_size != self.config.vocab_size:
            raise ValueError(f"EAGLE-3 head vocab_size {self.config.vocab_size} does not match the "
                             f"target's {target.config.vocab_size}.")
        super().bind_target(target)

    def combine_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[T, 3 * H_target] (the aux states concatenated in eagle3_aux_layers order) -> [T, H]."""
        return self.fc(hidden_states)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor,
                attn_metadata: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids, positions [T]; hidden_states either the target's aux states, raw
        [T, 3 * H_target] (combined here) or already combined [T, H], or the head's own fed-back
        [T, H] -> (normed hidden for logits, pre-norm hidden to feed back), [T, H] each."""
        width = hidden_states.shape[-1]
        if width == self.fc.input_size:
            hidden_states = self.combine_hidden_states(hidden_states)
        elif width == self.config.hidden_size:
            hidden_states = hidden_states.clone()  # the layer may update its residual in place
        else:
            raise ValueError(f"EAGLE-3 head: hidden_states width {width} is neither "
                             f"{self.fc.input_size} (aux states) nor {self.config.hidden_size}.")
        embeds = self._embed(input_ids)
        rope_tables = self.rotary_emb.step_tables(positions, hidden_states.dtype)
        hidden_states, residual = self.midlayer(rope_tables, embeds, hidden_states, attn_metadata)
        return self.norm(hidden_states, residual)

    def compute_draft_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[T, H] -> [T, target vocab] float32: the draft vocabulary's logits at their target ids
        (draft id + d2t), -inf at every target id outside the draft vocabulary."""
        draft_logits = self.lm_head(hidden_states).float()  # [T, draft_vocab]
        target_ids = torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t
        logits = draft_logits.new_full((hidden_states.shape[0], self.config.vocab_size), float("-inf"))
        return logits.index_copy_(1, target_ids, draft_logits)

    def _load_special(self, name: str, tensor: torch.Tensor) -> bool:
        if name != "d2t":
            return False
        if tensor.shape != self.d2t.shape:
            raise ValueError(f"d2t has shape {tuple(tensor.shape)}, not ({self.draft_vocab_size},).")
        target_ids = torch.arange(self.draft_vocab_size) + tensor.cpu()
        if bool((target_ids < 0).any()) or bool((target_ids >= self.config.vocab_size).any()):
            raise ValueError(f"d2t maps draft ids outside the target vocabulary of {self.config.vocab_size}.")
        self.d2t.copy_(tensor)
        return True

    def expected_weight_names(self) -> set[str]:
        """The parameters, and d2t unless the draft vocabulary is the target's."""
        names = super().expected_weight_names()
        if self.draft_vocab_size != self.config.vocab_size:
            names.add("d2t")
        return names
