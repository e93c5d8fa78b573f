"""The Llama decoder family: Llama 2/3, Mistral, SmolLM2, TinyLlama — and, through two flags,
Qwen2 (bias on q/k/v) and Qwen3 (RMSNorm on each q/k head).

One forward runs every scheduled token of the step as one flat sequence [num_tokens, hidden]:
requests are not padded to a common length, the attention backend keeps them apart.
Parameter names mirror the HF checkpoint, except that q/k/v and gate/up are fused.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from minivllm.attention.backend import AttentionBackend
from minivllm.config import get_head_size, get_sliding_windows
from minivllm.model.layers.activation import get_act_and_mul
from minivllm.model.layers.attention import Attention
from minivllm.model.layers.layernorm import RMSNorm
from minivllm.model.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
    linear,
    pack_linear_weight,
)
from minivllm.model.layers.quant import Q8_0_MAX_ROWS, GroupQuantized, Q8_0Weight
from minivllm.model.layers.rotary import RotaryEmbedding, get_rope_parameters
from minivllm.model.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

# checkpoint name fragment -> (fused parameter fragment, shard id)
STACKED_PARAMS = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


class LlamaAttention(nn.Module):
    def __init__(
        self, config: Any, backend: AttentionBackend, rotary_emb: RotaryEmbedding, qkv_bias: bool, qk_norm: bool,
        input_size: int | None = None, sliding_window: int | None = None, norm_cls: type[nn.Module] = RMSNorm,
        scale: float | None = None,
    ) -> None:
        """input_size: the width q/k/v read, hidden_size when None (EAGLE-3's layer reads 2x).
        sliding_window: this layer's (Mistral, Qwen2 past max_window_layers, Gemma's local
        layers), None for full attention. norm_cls: of the q/k norms. scale: of the scores,
        head_dim ** -0.5 when None."""
        super().__init__()
        hidden = config.hidden_size
        total_heads = config.num_attention_heads
        self.head_dim = get_head_size(config)
        self.qkv_proj = QKVParallelLinear(
            input_size or hidden, self.head_dim, total_heads,
            getattr(config, "num_key_value_heads", None) or total_heads, qkv_bias,
        )
        # This rank's heads (all of them without tensor parallelism).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        q_start = self.qkv_proj.shard_slices["q"][1]
        o_bias = bool(getattr(config, "attention_bias", False))
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hidden, bias=o_bias,
                                        input_slice=(q_start, self.qkv_proj.q_size))
        self.rotary_emb = rotary_emb
        self.q_norm = norm_cls(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = norm_cls(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, backend, sliding_window, scale)

    def forward(
        self,
        rope_tables: Any,
        hidden_states: torch.Tensor,
        attn_metadata: Any,
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(rope_tables, q, k)
        out = self.attn(q.reshape(num_tokens, q_size), k.reshape(num_tokens, kv_size), v, attn_metadata)
        if logits_indices is not None:
            out = out[logits_indices]
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        bias = bool(getattr(config, "mlp_bias", False))
        # Gemma names it hidden_activation.
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
        self.gate_up_proj = MergedColumnParallelLinear(hidden, {0: inter, 1: inter}, bias=bias)
        local_inter = self.gate_up_proj.shard_offsets[1][1]
        self.act_fn = get_act_and_mul(act, local_inter)
        self.down_proj = RowParallelLinear(
            inter, hidden, bias=bias, input_slice=self.gate_up_proj.shard_slices[1][1:]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: Any, backend: AttentionBackend, rotary_emb: RotaryEmbedding, qkv_bias: bool, qk_norm: bool,
        input_layernorm: bool = True, sliding_window: int | None = None,
    ) -> None:
        """input_layernorm=False: attention reads the layer's input as is (EAGLE-1's first layer).
        NOTE: such a layer must be a first one (called with residual None)."""
        super().__init__()
        self.self_attn = LlamaAttention(config, backend, rotary_emb, qkv_bias, qk_norm, sliding_window=sliding_window)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps) if input_layernorm else None
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        rope_tables: Any,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        attn_metadata: Any,
        logits_indices: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """logits_indices: the rows to carry past attention (all when None). Every row's K/V is
        written and attended; only these go through o_proj and the MLP."""
        hidden_states, residual = attention_sublayer(
            self.input_layernorm, self.self_attn, rope_tables, hidden_states, residual, attn_metadata, logits_indices)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


def attention_sublayer(
    input_layernorm: nn.Module | None,
    self_attn: LlamaAttention,
    rope_tables: Any,
    hidden_states: torch.Tensor,
    residual: torch.Tensor | None,
    attn_metadata: Any,
    logits_indices: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's first half: the input norm (adding the previous layer's output to the
    residual stream, or starting it at the first layer), then attention; returns attention's
    output and the residual stream, both cut to `logits_indices` when given."""
    if residual is None:
        residual = hidden_states
        if input_layernorm is not None:
            hidden_states = input_layernorm(hidden_states)
    else:
        hidden_states, residual = input_layernorm(hidden_states, residual)
    hidden_states = self_attn(rope_tables, hidden_states, attn_metadata, logits_indices)
    if logits_indices is not None:
        residual = residual[logits_indices]
    return hidden_states, residual


class LlamaModel(nn.Module):
    def __init__(self, config: Any, backend: AttentionBackend, qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # One rotary table for all layers (4 MiB per copy at 8k positions).
        self.rotary_emb = RotaryEmbedding(
            get_head_size(config), config.max_position_embeddings, get_rope_parameters(config)
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, backend, self.rotary_emb, qkv_bias, qk_norm, sliding_window=window)
            for window in get_sliding_windows(config)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # EAGLE-3 drafts from the residual stream at the input of these layers (set by its proposer).
        self.aux_hidden_state_layers: tuple[int, ...] = ()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Final hidden states of every token, or of the rows logits_indices names (in its order).

        Given logits_indices, the last layer writes and attends every token's K/V but runs
        o_proj and the MLP for those rows only: nothing else reads the other rows' final states
        (~3% of a prefill's matmuls for a 30-layer model; llama.cpp prunes its last layer alike).
        """
        hidden_states = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        rope_tables = self.rotary_emb.step_tables(positions, hidden_states.dtype)
        residual = None
        last = len(self.layers) - 1
        aux_hidden_states = {}
        for i, layer in enumerate(self.layers):
            if i in self.aux_hidden_state_layers:
                aux_hidden_states[i] = hidden_states if residual is None else hidden_states + residual
            hidden_states, residual = layer(
                rope_tables, hidden_states, residual, attn_metadata, logits_indices if i == last else None
            )
        hidden_states, _ = self.norm(hidden_states, residual)
        if aux_hidden_states:
            # NOTE: then the caller wants every token's states: no pruning (logits_indices None).
            return hidden_states, torch.cat([aux_hidden_states[i] for i in self.aux_hidden_state_layers], dim=-1)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    qkv_bias = False
    qk_norm = False

    def __init__(self, config: Any, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.model = self.make_model(config, backend)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        # The lm_head's GGUF Q8_0 codes, for steps sampling few rows (set by the loader).
        self.lm_head_q8_0: Q8_0Weight | None = None
        # The lm_head's weight packed for oneDNN (a tied one: the embedding keeps the plain one).
        self.lm_head_packed: torch.Tensor | None = None

    def make_model(self, config: Any, backend: AttentionBackend) -> nn.Module:
        """The decoder stack under the lm_head (what the subclasses of other families change)."""
        qkv_bias = self.qkv_bias or bool(getattr(config, "attention_bias", False))
        return LlamaModel(config, backend, qkv_bias, self.qk_norm)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Final hidden states (see LlamaModel.forward), with the EAGLE-3 aux states
        [num_tokens, 3 * hidden] concatenated when aux_hidden_state_layers is set."""
        return self.model(input_ids, positions, attn_metadata, logits_indices)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits for the rows that are sampled only: [num_sampled, vocab], float32, on every rank."""
        if self.lm_head_q8_0 is not None and hidden_states.shape[0] <= Q8_0_MAX_ROWS:
            logits = self.lm_head_q8_0.matmul(hidden_states)
        else:
            weight = self.lm_head_packed if self.lm_head_packed is not None else self.lm_head.weight
            logits = linear(hidden_states, weight).float()
        return self.lm_head.gather_logits(logits)

    def set_lm_head_q8_0(self, weight: Q8_0Weight) -> None:
        """The lm_head's Q8_0 codes as the GGUF file stores them (every row)."""
        self.lm_head_q8_0 = self.lm_head.rank_rows(weight)

    def process_weights_after_loading(self) -> None:
        """Pack the lm_head for oneDNN; the embedding keeps the plain weight for lookups."""
        self.lm_head_packed = pack_linear_weight(self.lm_head.weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (HF names) into the parameters; returns the names loaded."""
        return load_stacked_weights(self, (
            (name, tensor) for name, tensor in weights
            if "rotary_emb.inv_freq" not in name
            # some checkpoints store the tied copy too
            and not (name == "lm_head.weight" and self.tie_word_embeddings)
        ))

    def expected_weight_names(self) -> set[str]:
        """What load_weights must have loaded for the model to be complete."""
        return expected_stacked_names(self)


def load_stacked_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Copy tensors named as the model's parameters but with q/k/v and gate/up unfused (HF names)
    into them; returns the names loaded, a fused shard as "name[shard]"."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        shard_id = None
        for ckpt_part, (param_part, shard) in STACKED_PARAMS.items():
            if ckpt_part in name:
                name, shard_id = name.replace(ckpt_part, param_part), shard
                break
        param = params.get(name)
        if param is None:
            raise ValueError(f"Checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}.")
        loader = getattr(param, "weight_loader", None)
        if isinstance(tensor, GroupQuantized):  # GGUF codes kept beside the dequantized weight
            model.get_submodule(name.rpartition(".")[0]).load_quantized(tensor, shard_id)
        elif loader is not None:
            loader(param, tensor, shard_id)
        else:
            default_weight_loader(param, tensor)
        loaded.add(name if shard_id is None else f"{name}[{shard_id}]")
    return loaded


def expected_stacked_names(model: nn.Module) -> set[str]:
    """Every parameter of the model as load_stacked_weights names it once loaded."""
    names: set[str] = set()
    for name, _ in model.named_parameters():
        module = model.get_submodule(name.rpartition(".")[0])
        offsets = getattr(module, "shard_offsets", None)
        if offsets:
            names.update(f"{name}[{shard}]" for shard in offsets)
        else:
            names.add(name)
    return names
