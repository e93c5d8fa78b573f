"""The C++ CPU kernels of the layers (RMSNorm, fused add + RMSNorm, SiLU-and-mul, rotary) against
each layer's torch path: bit for bit in bfloat16 (same roundings as transformers' formulas),
and against float64 formulas in float32; plus when a layer takes its kernel."""

from __future__ import annotations

import pytest
import torch

from minivllm.model.layers.activation import SiluAndMul
from minivllm.model.layers.layernorm import GemmaRMSNorm, RMSNorm
from minivllm.model.layers.rotary import RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16]


pytestmark = pytest.mark.usefixtures("cpu_kernels")


def build(layer_cls, dtype, *args):
    with torch.device("cpu"):
        old = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            return layer_cls(*args)
        finally:
            torch.set_default_dtype(old)


def assert_same(kernel: torch.Tensor, native: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16:
        assert torch.equal(kernel, native)
    else:  # float32 sums of squares may add in another order
        torch.testing.assert_close(kernel, native, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(dtype):
    gen = torch.Generator().manual_seed(0)
    norm = build(RMSNorm, dtype, 576, 1e-5)
    assert norm.use_cpu_kernels
    norm.weight.copy_(torch.randn(576, generator=gen))
    x = (torch.randn(37, 576, generator=gen) * 3).to(dtype)
    out = norm.forward_cpu(x.clone())
    assert_same(out, norm.forward_native(x.clone()), dtype)
    x64 = x.double()
    formula = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), formula, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_updates_both_in_place(dtype):
    gen = torch.Generator().manual_seed(1)
    norm = build(RMSNorm, dtype, 576, 1e-6)
    norm.weight.copy_(torch.randn(576, generator=gen))
    x, residual = (torch.randn(2, 9, 576, generator=gen) * 2).to(dtype)
    native_out, native_residual = norm.forward_native(x.clone(), residual.clone())
    x_k, residual_k = x.clone(), residual.clone()
    out, new_residual = norm.forward_cpu(x_k, residual_k)
    assert out.data_ptr() == x_k.data_ptr() and new_residual.data_ptr() == residual_k.data_ptr()
    assert torch.equal(new_residual, native_residual)  # the sum, rounded once
    assert_same(out, native_out, dtype)


def test_rms_norm_on_strided_heads():
    """Qwen3's per-head norm runs on [tokens, heads, head_dim] views into the fused QKV output."""
    gen = torch.Generator().manual_seed(2)
    norm = build(RMSNorm, torch.bfloat16, 128)
    norm.weight.copy_(torch.randn(128, generator=gen))
    qkv = torch.randn(5, 24 * 128, generator=gen).to(torch.bfloat16)
    q = qkv[:, : 16 * 128].view(5, 16, 128)
    assert torch.equal(norm.forward_cpu(q), norm.forward_native(q))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    gen = torch.Generator().manual_seed(3)
    act = build(SiluAndMul, dtype, 1536)
    assert act.use_cpu_kernels
    x = (torch.randn(21, 3072, generator=gen) * 4).to(dtype)
    out = act.forward_cpu(x)
    assert torch.equal(out, act.forward_native(x))  # the same exp and roundings as torch's silu
    gate, up = x.double().chunk(2, dim=-1)
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), gate * torch.sigmoid(gate) * up, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 128)])
def test_rotary_in_place_on_fused_qkv_views(dtype, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(4)
    rope = build(RotaryEmbedding, dtype, head_dim, 4096, {"rope_type": "default", "rope_theta": 1e5})
    rope.cos_cache, rope.sin_cache = rope.cos_cache.float(), rope.sin_cache.float()  # as the loader
    assert rope.use_cpu_kernels
    num_tokens = 33
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q = qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(num_tokens, kv_heads, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen)
    rope.use_cpu_kernels = False
    q_native, k_native = rope.forward_native(rope.step_tables(positions, dtype), q, k)
    rope.use_cpu_kernels = True
    q_out, k_out = rope.forward_cpu(rope.step_tables(positions, dtype), q, k)
    assert q_out.data_ptr() == q.data_ptr()
    assert torch.equal(q_out, q_native) and torch.equal(k_out, k_native)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)  # V untouched


def test_rotary_matches_the_formula():
    """float32 rotation of one head against cos/sin in float64 (positions below 512, where the
    float32 angle table is accurate to ~3e-5)."""
    gen = torch.Generator().manual_seed(5)
    head_dim, num_tokens = 64, 40
    rope = build(RotaryEmbedding, torch.float32, head_dim, 512, {"rope_type": "default", "rope_theta": 1e5})
    positions = torch.randint(0, 512, (num_tokens,), generator=gen)
    x = torch.randn(num_tokens, 1, head_dim, generator=gen)
    x1, x2 = x[:, 0].double().chunk(2, dim=-1)
    inv_freq = 1.0 / (1e5 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angle = positions.double()[:, None] * inv_freq
    expected = torch.cat((x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()), -1)
    rope.forward_cpu(positions, x, x.clone())
    torch.testing.assert_close(x[:, 0].double(), expected, rtol=1e-4, atol=1e-4)


def test_rotary_rejects_positions_outside_the_table():
    rope = build(RotaryEmbedding, torch.float32, 64, 128, {"rope_type": "default", "rope_theta": 1e4})
    q = torch.zeros(1, 2, 64)
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        rope.forward_cpu(torch.tensor([128]), q, q.clone())


def test_which_layers_take_kernels(monkeypatch):
    assert build(RMSNorm, torch.bfloat16, 576).use_cpu_kernels
    assert not build(RMSNorm, torch.bfloat16, 100).use_cpu_kernels  # not a multiple of 32
    assert not build(RMSNorm, torch.float16, 576).use_cpu_kernels
    assert not build(RotaryEmbedding, torch.float32, 16, 64, {"rope_type": "default", "rope_theta": 1e4}).use_cpu_kernels
    with torch.device("meta"):
        assert not RMSNorm(576).use_cpu_kernels  # built for another device
    monkeypatch.setenv("MINIVLLM_CPU_KERNELS", "0")
    assert not build(SiluAndMul, torch.float32, 1536).use_cpu_kernels


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_rms_norm_matches_transformers(dtype):
    """Gemma's (1 + w) scale, rounded once: the kernel and the torch path give transformers'
    Gemma3RMSNorm exactly in bfloat16, alone, after the residual add, and on [tokens, heads,
    256] views (the q/k norms)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    gen = torch.Generator().manual_seed(3)
    for shape, hidden in (((19, 640), 640), ((7, 4, 256), 256)):
        norm = build(GemmaRMSNorm, dtype, hidden, 1e-6)
        assert norm.use_cpu_kernels
        norm.weight.copy_(torch.randn(hidden, generator=gen) * 0.3)
        hf = Gemma3RMSNorm(hidden, eps=1e-6).to(dtype)
        hf.weight.data.copy_(norm.weight)
        x = (torch.randn(shape, generator=gen) * 3).to(dtype)
        expected = hf(x)
        assert_same(norm.forward_cpu(x.clone()), expected, dtype)
        assert_same(norm.forward_native(x.clone()), expected, dtype)
    residual = (torch.randn(19, 640, generator=gen)).to(dtype)
    x = (torch.randn(19, 640, generator=gen)).to(dtype)
    norm = build(GemmaRMSNorm, dtype, 640, 1e-6)
    norm.weight.copy_(torch.randn(640, generator=gen) * 0.3)
    out, new_residual = norm.forward_cpu(x.clone(), residual.clone())
    native_out, native_residual = norm.forward_native(x.clone(), residual.clone())
    assert torch.equal(new_residual, native_residual)
    assert_same(out, native_out, dtype)
