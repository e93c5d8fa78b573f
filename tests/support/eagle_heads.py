"""EAGLE-1 and EAGLE-3 heads with random weights, written as their HF checkpoints are published
(config.json + model.safetensors), sized for the tiny test targets (reference.build_tiny_model:
hidden 64, 4 query / 2 KV heads of 16, MLP 128)."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, DRAFT_VOCAB = 64, 4, 2, 16, 128, 96, 48
EPS, THETA = 1e-5, 50000.0
HEAD_CONFIG = dict(
    model_type="llama", hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
    intermediate_size=INTER, vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=EPS,
    rope_theta=THETA, hidden_act="silu", torch_dtype="float32",
)


def _randn(gen: torch.Generator, *shape: int, scale: float = 0.1) -> torch.Tensor:
    return torch.randn(shape, generator=gen) * scale


def _layer_tensors(gen: torch.Generator, prefix: str, qkv_in: int, input_norm: bool) -> dict[str, torch.Tensor]:
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    out = {
        f"{prefix}self_attn.q_proj.weight": _randn(gen, q, qkv_in),
        f"{prefix}self_attn.k_proj.weight": _randn(gen, kv, qkv_in),
        f"{prefix}self_attn.v_proj.weight": _randn(gen, kv, qkv_in),
        f"{prefix}self_attn.o_proj.weight": _randn(gen, HIDDEN, q),
        f"{prefix}mlp.gate_proj.weight": _randn(gen, INTER, HIDDEN),
        f"{prefix}mlp.up_proj.weight": _randn(gen, INTER, HIDDEN),
        f"{prefix}mlp.down_proj.weight": _randn(gen, HIDDEN, INTER),
        f"{prefix}post_attention_layernorm.weight": 1 + _randn(gen, HIDDEN),
    }
    if input_norm:
        out[f"{prefix}input_layernorm.weight"] = 1 + _randn(gen, HIDDEN)
    return out


def eagle1_checkpoint(num_layers: int, fc_bias: bool, seed: int = 0, vocab: int = VOCAB) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, tensors) as EAGLE-1 heads are published: bare names, no layers.0.input_layernorm."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {"fc.weight": _randn(gen, HIDDEN, 2 * HIDDEN)}
    if fc_bias:
        tensors["fc.bias"] = _randn(gen, HIDDEN)
    for i in range(num_layers):
        tensors.update(_layer_tensors(gen, f"layers.{i}.", HIDDEN, input_norm=i > 0))
    # Copies of the target's that the head must ignore.
    tensors["embed_tokens.weight"] = _randn(gen, vocab, HIDDEN)
    tensors["lm_head.weight"] = _randn(gen, vocab, HIDDEN)
    config = dict(HEAD_CONFIG, architectures=["LlamaForCausalLM"], num_hidden_layers=num_layers, vocab_size=vocab)
    return config, tensors


def eagle3_checkpoint(seed: int = 0, vocab: int = VOCAB, draft_vocab: int = DRAFT_VOCAB) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, tensors) as EAGLE-3 heads are published: `midlayer.`, own lm_head, d2t and t2d."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {"fc.weight": _randn(gen, HIDDEN, 3 * HIDDEN), "norm.weight": 1 + _randn(gen, HIDDEN),
               "midlayer.hidden_norm.weight": 1 + _randn(gen, HIDDEN),
               "lm_head.weight": _randn(gen, draft_vocab, HIDDEN, scale=0.5)}
    tensors.update(_layer_tensors(gen, "midlayer.", 2 * HIDDEN, input_norm=True))
    target_ids = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
    tensors["d2t"] = target_ids - torch.arange(draft_vocab)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[target_ids] = True
    tensors["t2d"] = t2d
    tensors["embed_tokens.weight"] = _randn(gen, vocab, HIDDEN)
    config = dict(HEAD_CONFIG, architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1, vocab_size=vocab,
                  draft_vocab_size=draft_vocab, target_hidden_size=HIDDEN)
    return config, tensors


def write_hf(tmp_path, config: dict, tensors: dict[str, torch.Tensor]):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    return tmp_path


