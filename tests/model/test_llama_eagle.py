"""EAGLE-1 and EAGLE-3 draft heads: tiny random heads written in their HF checkpoint layouts,
loaded, and run against a plain-torch reference written here (embedding, fc, RMSNorm, HF's
rotate-half RoPE, causal GQA softmax attention, SiLU MLP), on the kernel and the torch paths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from eagle_heads import (
    DRAFT_VOCAB,
    EPS,
    HEAD_CONFIG,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    KV_HEADS,
    THETA,
    VOCAB,
    eagle1_checkpoint,
    eagle3_checkpoint,
    write_hf,
)
from transformers import AutoConfig, LlamaConfig

from minivllm.attention.torch_ref import TorchRefAttentionBackend
from minivllm.model.loader import iterate_safetensors_weights
from minivllm.model.models.llama import LlamaForCausalLM
from minivllm.model.models.llama_eagle import (
    Eagle3LlamaForCausalLM,
    EagleLlamaForCausalLM,
    eagle3_aux_layers,
)

NUM_TOKENS = 7


@pytest.fixture(params=["kernels", "torch"])
def layer_path(request, monkeypatch, cpu_kernels):
    """Heads built on the C++ kernel path (RMSNorm fused add in place) and on the torch path."""
    if request.param == "torch":
        monkeypatch.setenv("MINIVLLM_CPU_KERNELS", "0")
    return request.param


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    """A 2-layer random Llama target; only its embedding and lm_head serve the heads."""
    config = LlamaConfig(**{k: v for k, v in HEAD_CONFIG.items() if k != "model_type"},
                         num_hidden_layers=2, head_dim=HEAD_DIM)
    model = LlamaForCausalLM(config, TorchRefAttentionBackend())
    gen = torch.Generator().manual_seed(1)
    for param in model.parameters():
        param.data.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    return model.eval()


def load_head(cls, model_dir, target: LlamaForCausalLM, target_hidden: int = HIDDEN):
    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("cpu"):
        head = cls(config, TorchRefAttentionBackend(), target_hidden)
    loaded = head.load_weights(iterate_safetensors_weights(str(model_dir)))
    missing = head.expected_weight_names() - loaded
    assert not missing, missing
    head.bind_target(target)
    return head.eval()


# ----------------------------------------------------------------------------------------------
# Reference: plain torch, HF Llama's formulas
# ----------------------------------------------------------------------------------------------


def ref_rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def ref_rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    inv_freq = 1.0 / THETA ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    freqs = positions[:, None].float() * inv_freq[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]  # [T, 1, head_dim]
    x1, x2 = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def ref_attention(x: torch.Tensor, w: dict, prefix: str, positions: torch.Tensor) -> torch.Tensor:
    T = x.shape[0]
    q = (x @ w[f"{prefix}self_attn.q_proj.weight"].T).view(T, HEADS, HEAD_DIM)
    k = (x @ w[f"{prefix}self_attn.k_proj.weight"].T).view(T, KV_HEADS, HEAD_DIM)
    v = (x @ w[f"{prefix}self_attn.v_proj.weight"].T).view(T, KV_HEADS, HEAD_DIM)
    q, k = ref_rope(q, positions), ref_rope(k, positions)
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) * HEAD_DIM**-0.5
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    out = torch.einsum("hts,shd->thd", probs, v).reshape(T, HEADS * HEAD_DIM)
    return out @ w[f"{prefix}self_attn.o_proj.weight"].T


def ref_mlp(x: torch.Tensor, w: dict, prefix: str) -> torch.Tensor:
    gate = F.silu(x @ w[f"{prefix}mlp.gate_proj.weight"].T)
    return (gate * (x @ w[f"{prefix}mlp.up_proj.weight"].T)) @ w[f"{prefix}mlp.down_proj.weight"].T


def ref_eagle1(w: dict, num_layers: int, embed: torch.Tensor, ids, positions, hidden) -> torch.Tensor:
    h = torch.cat((embed[ids], hidden), dim=-1) @ w["fc.weight"].T
    if "fc.bias" in w:
        h = h + w["fc.bias"]
    for i in range(num_layers):
        p = f"layers.{i}."
        attn_in = h if i == 0 else ref_rms(h, w[f"{p}input_layernorm.weight"])
        h = h + ref_attention(attn_in, w, p, positions)
        h = h + ref_mlp(ref_rms(h, w[f"{p}post_attention_layernorm.weight"]), w, p)
    return h  # no final norm


def ref_eagle3(w: dict, embed: torch.Tensor, ids, positions, hidden) -> tuple[torch.Tensor, torch.Tensor]:
    h = hidden @ w["fc.weight"].T if hidden.shape[-1] == 3 * HIDDEN else hidden
    p = "midlayer."
    x = torch.cat((ref_rms(embed[ids], w[f"{p}input_layernorm.weight"]),
                   ref_rms(h, w[f"{p}hidden_norm.weight"])), dim=-1)
    h = h + ref_attention(x, w, p, positions)
    h = h + ref_mlp(ref_rms(h, w[f"{p}post_attention_layernorm.weight"]), w, p)
    return ref_rms(h, w["norm.weight"]), h


def _inputs(width: int, seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (NUM_TOKENS,), generator=gen)
    positions = torch.arange(5, 5 + NUM_TOKENS)  # not from 0: the rotation is checked too
    return ids, positions, torch.randn(NUM_TOKENS, width, generator=gen)


# ----------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_layers, fc_bias", [(1, False), (2, True)])
def test_eagle1_matches_reference(tmp_path, target, layer_path, num_layers, fc_bias):
    """Embedding first, then the target hidden; layer 0 without input norm; no final norm; an
    fc.bias found in the checkpoint (with no config key) is used; logits are the target's."""
    config, tensors = eagle1_checkpoint(num_layers, fc_bias)
    head = load_head(EagleLlamaForCausalLM, write_hf(tmp_path, config, tensors), target)
    assert head.layers[0].input_layernorm is None and head.embed_tokens is target.model.embed_tokens
    ids, positions, hidden = _inputs(HIDDEN)
    given = hidden.clone()
    with torch.no_grad():
        out, feed = head(ids, positions, hidden, None)
        logits = head.compute_draft_logits(out)
    expected = ref_eagle1(tensors, num_layers, target.model.embed_tokens.weight.detach(), ids, positions, hidden)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(feed, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(hidden, given)
    assert logits.dtype == torch.float32 and logits.shape == (NUM_TOKENS, VOCAB)
    torch.testing.assert_close(logits, out @ target.lm_head.weight.detach().T, atol=1e-5, rtol=1e-5)


def test_eagle3_matches_reference(tmp_path, target, layer_path):
    """Raw aux states [T, 3H] are combined by fc; the fed-back pre-norm hidden [T, H] is taken
    as is (and not modified); both outputs match the reference."""
    config, tensors = eagle3_checkpoint()
    head = load_head(Eagle3LlamaForCausalLM, write_hf(tmp_path, config, tensors), target)
    embed = target.model.embed_tokens.weight.detach()
    ids, positions, aux = _inputs(3 * HIDDEN)
    with torch.no_grad():
        normed, prenorm = head(ids, positions, aux, None)
        expected_normed, expected_prenorm = ref_eagle3(tensors, embed, ids, positions, aux)
        torch.testing.assert_close(normed, expected_normed, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(prenorm, expected_prenorm, atol=1e-5, rtol=1e-5)
        fed_back = prenorm.clone()
        normed2, prenorm2 = head(ids, positions + 1, fed_back, None)
    assert torch.equal(fed_back, prenorm)
    expected_normed2, expected_prenorm2 = ref_eagle3(tensors, embed, ids, positions + 1, prenorm)
    torch.testing.assert_close(normed2, expected_normed2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(prenorm2, expected_prenorm2, atol=1e-5, rtol=1e-5)


def test_eagle3_draft_logits_map_through_d2t(tmp_path, target):
    config, tensors = eagle3_checkpoint()
    head = load_head(Eagle3LlamaForCausalLM, write_hf(tmp_path, config, tensors), target)
    d2t = tensors["d2t"]
    target_ids = torch.arange(DRAFT_VOCAB) + d2t
    hidden = torch.randn(NUM_TOKENS, HIDDEN, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits = head.compute_draft_logits(hidden)
    draft_logits = hidden @ tensors["lm_head.weight"].T  # [T, draft_vocab]
    assert logits.dtype == torch.float32 and logits.shape == (NUM_TOKENS, VOCAB)
    draft_argmax = draft_logits.argmax(-1)
    assert torch.equal(logits.argmax(-1), draft_argmax + d2t[draft_argmax])
    torch.testing.assert_close(logits[:, target_ids], draft_logits, atol=1e-5, rtol=1e-5)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[target_ids] = False
    assert outside.sum() == VOCAB - DRAFT_VOCAB
    assert torch.isneginf(logits[:, outside]).all() and torch.isfinite(logits[:, target_ids]).all()


@pytest.mark.parametrize("eagle3", [False, True])
def test_model_prefixed_names_load(tmp_path, target, eagle3):
    """`model.`-prefixed names (and vLLM's layers.0 for midlayer) load to the same head."""
    config, tensors = eagle3_checkpoint() if eagle3 else eagle1_checkpoint(2, False)
    cls = Eagle3LlamaForCausalLM if eagle3 else EagleLlamaForCausalLM
    bare = load_head(cls, write_hf(tmp_path / "bare", config, tensors), target)
    unshared = ("lm_head.weight", "d2t", "t2d")
    prefixed = {name if name in unshared else "model." + name.replace("midlayer.", "layers.0."): tensor
                for name, tensor in tensors.items()}
    assert any(name.startswith("model.layers.0.") for name in prefixed)
    head = load_head(cls, write_hf(tmp_path / "prefixed", config, prefixed), target)
    for (name, a), (_, b) in zip(bare.state_dict().items(), head.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("cls, dropped, missing", [
    (EagleLlamaForCausalLM, "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.qkv_proj.weight[k]"),
    (Eagle3LlamaForCausalLM, "midlayer.hidden_norm.weight", "midlayer.hidden_norm.weight"),
    (Eagle3LlamaForCausalLM, "d2t", "d2t"),
])
def test_missing_tensor_is_reported(tmp_path, cls, dropped, missing):
    config, tensors = eagle3_checkpoint() if cls is Eagle3LlamaForCausalLM else eagle1_checkpoint(1, False)
    del tensors[dropped]
    write_hf(tmp_path, config, tensors)
    head = cls(AutoConfig.from_pretrained(str(tmp_path)), TorchRefAttentionBackend(), HIDDEN)
    loaded = head.load_weights(iterate_safetensors_weights(str(tmp_path)))
    assert head.expected_weight_names() - loaded == {missing}


def test_unexpected_tensor_is_an_error(tmp_path):
    """EAGLE-1's first layer has no input norm: a checkpoint that has one is not an EAGLE-1 head."""
    config, tensors = eagle1_checkpoint(1, False)
    tensors["layers.0.input_layernorm.weight"] = torch.ones(HIDDEN)
    write_hf(tmp_path, config, tensors)
    head = EagleLlamaForCausalLM(AutoConfig.from_pretrained(str(tmp_path)), TorchRefAttentionBackend(), HIDDEN)
    with pytest.raises(ValueError, match="layers.0.input_layernorm.weight"):
        head.load_weights(iterate_safetensors_weights(str(tmp_path)))


def test_size_mismatch_is_a_value_error():
    eagle1 = LlamaConfig(**eagle1_checkpoint(1, False)[0])
    with pytest.raises(ValueError, match=r"hidden_size 64 .* hidden size 32"):
        EagleLlamaForCausalLM(eagle1, TorchRefAttentionBackend(), 32)
    eagle3 = LlamaConfig(**eagle3_checkpoint()[0])
    with pytest.raises(ValueError, match=r"fc input size 192 .* hidden size 48 = 144"):
        Eagle3LlamaForCausalLM(eagle3, TorchRefAttentionBackend(), 48)


def test_eagle3_aux_layers():
    assert eagle3_aux_layers(32) == (2, 16, 29)
    assert eagle3_aux_layers(3) == (2, 1, 0)
    with pytest.raises(ValueError):
        eagle3_aux_layers(2)
