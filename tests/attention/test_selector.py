"""attention/selector.py: the backend each platform gets for each layer shape, the environment
override, the reasons given when nothing can run, and no compilation at start-up."""

from __future__ import annotations

import pytest
import torch

from minivllm.attention.backend import AttentionBackend
from minivllm.attention.cpu_paged import CpuPagedAttentionBackend
from minivllm.attention.selector import backend_class, get_attn_backend
from minivllm.attention.torch_ref import TorchRefAttentionBackend
from minivllm.attention.triton_attn import TritonAttentionBackend
from minivllm.ops import cpu_kernels
from minivllm.platforms.cpu import CpuPlatform
from minivllm.platforms.cuda import CudaPlatform

CPU, CUDA = CpuPlatform(), CudaPlatform()


@pytest.mark.parametrize(("dtype", "head_size"), [(torch.bfloat16, 64), (torch.float32, 128)])
def test_cpu_takes_the_kernels_where_they_run(cpu_kernels, dtype, head_size):
    assert type(get_attn_backend(CPU, dtype, head_size)) is CpuPagedAttentionBackend


@pytest.mark.parametrize(("dtype", "head_size"), [(torch.float32, 16), (torch.float16, 64), (torch.bfloat16, 96)])
def test_cpu_falls_back_to_the_reference_for_other_shapes(cpu_kernels, dtype, head_size):
    assert type(get_attn_backend(CPU, dtype, head_size)) is TorchRefAttentionBackend


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_cuda_takes_triton_then_the_reference(dtype, monkeypatch):
    """Triton attention where Triton is installed, else the reference; the CPU kernels never run
    on CUDA, even when forced."""
    pytest.importorskip("triton")
    assert type(get_attn_backend(CUDA, dtype, 128)) is TritonAttentionBackend
    monkeypatch.setattr(TritonAttentionBackend, "unsupported_reason", classmethod(lambda *_: "triton is not installed"))
    assert type(get_attn_backend(CUDA, dtype, 128)) is TorchRefAttentionBackend
    assert CpuPagedAttentionBackend.unsupported_reason("cuda", dtype, 128) == "runs on CPU only, not cuda"


def test_triton_runs_on_the_cpu_only_under_its_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert TritonAttentionBackend.unsupported_reason("cpu", torch.float32, 64) == (
        "runs on CUDA (or under TRITON_INTERPRET=1), not cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert TritonAttentionBackend.unsupported_reason("cpu", torch.float32, 64) is None
    assert TritonAttentionBackend.unsupported_reason("cuda", torch.float32, 512) == "head size 512 is over 256"


def test_environment_forces_a_backend(cpu_kernels, monkeypatch):
    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "TORCH_REF")
    assert type(get_attn_backend(CPU, torch.bfloat16, 64)) is TorchRefAttentionBackend
    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "CPU_PAGED")
    with pytest.raises(ValueError, match="CPU_PAGED: the CPU kernels do not support torch.float32 with head size 16"):
        get_attn_backend(CPU, torch.float32, 16)
    with pytest.raises(ValueError, match="CPU_PAGED: runs on CPU only, not cuda"):
        get_attn_backend(CUDA, torch.float32, 64)
    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "FLASH")
    with pytest.raises(ValueError, match="Unknown attention backend 'FLASH'; known: TORCH_REF, CPU_PAGED, TRITON_ATTN"):
        get_attn_backend(CPU, torch.float32, 64)


def test_kernels_switched_off(cpu_kernels, monkeypatch):
    monkeypatch.setenv("MINIVLLM_CPU_KERNELS", "0")
    assert type(get_attn_backend(CPU, torch.bfloat16, 64)) is TorchRefAttentionBackend


def test_sliding_window_skips_backends_without_it(cpu_kernels, monkeypatch):
    """A model with sliding-window layers gets a backend that has them: the next candidate when
    the best one lacks them, else an error naming each backend and why, never full attention."""
    assert type(get_attn_backend(CPU, torch.bfloat16, 64, sliding_window=512)) is CpuPagedAttentionBackend
    monkeypatch.setattr(CpuPagedAttentionBackend, "supports_sliding_window", False)
    assert type(get_attn_backend(CPU, torch.bfloat16, 64, sliding_window=512)) is TorchRefAttentionBackend
    assert type(get_attn_backend(CPU, torch.bfloat16, 64)) is CpuPagedAttentionBackend
    monkeypatch.setattr(TorchRefAttentionBackend, "supports_sliding_window", False)
    with pytest.raises(ValueError, match="CPU_PAGED: no sliding-window attention; TORCH_REF: no sliding-window"):
        get_attn_backend(CPU, torch.bfloat16, 64, sliding_window=512)


def test_registry_names_match_the_classes():
    for name in ("TORCH_REF", "CPU_PAGED", "TRITON_ATTN"):
        cls = backend_class(name)
        assert issubclass(cls, AttentionBackend) and cls.name == name


def test_unbuilt_kernels_fall_back(monkeypatch, tmp_path):
    """Without a build for this source (a fresh cache root), auto selection takes the reference
    backend rather than compiling at start-up."""
    monkeypatch.setattr(cpu_kernels, "_loaded", False)
    monkeypatch.setenv("MINIVLLM_CACHE_ROOT", str(tmp_path))
    assert not cpu_kernels.library_path().exists()
    assert type(get_attn_backend(CPU, torch.bfloat16, 64)) is TorchRefAttentionBackend
    assert not any(tmp_path.iterdir())
