"""platforms/: device="auto" resolved like torch would, without importing torch; each platform's
answers (kernels, packed weights, attention backends, graph runner, KV cache memory)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from minivllm.config import CacheConfig
from minivllm.platforms import _torch_cuda_version, cuda_available, get_platform, resolve_device
from minivllm.platforms.cpu import CpuPlatform
from minivllm.platforms.cuda import CudaPlatform
from minivllm.platforms.interface import GiB, UnspecifiedPlatform


def test_auto_device_agrees_with_torch():
    assert _torch_cuda_version() == torch.version.cuda
    assert cuda_available() == torch.cuda.is_available()
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_refused_without_cuda():
    with pytest.raises(ValueError, match="device='cuda:1' but CUDA is not available"):
        resolve_device("cuda:1")


def test_unknown_devices_refused_but_their_layers_built():
    """An engine cannot run on a device without a platform; a layer built there (meta, for its
    shapes) takes the torch path."""
    with pytest.raises(ValueError, match="Unsupported device 'tpu'"):
        resolve_device("tpu")
    meta = get_platform("meta")
    assert isinstance(meta, UnspecifiedPlatform) and not meta.use_custom_kernels(torch.float32)
    assert meta.attention_backend_names(torch.float32, 64) == ["TORCH_REF"]


def test_resolving_the_device_imports_no_torch():
    code = "import sys; from minivllm.platforms import resolve_device; resolve_device('auto'); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_cpu_platform_decisions(cpu_kernels, monkeypatch):
    cpu = get_platform("cpu")
    assert isinstance(cpu, CpuPlatform) and cpu is get_platform("cpu")
    assert cpu.use_custom_kernels(torch.float32) and cpu.use_custom_kernels(torch.bfloat16)
    assert not cpu.use_custom_kernels(torch.float16)
    caps = torch.cpu.get_capabilities()
    bf16_packing = caps["avx_ne_convert"] or all(caps[f] for f in ("avx512_bw", "avx512_vl", "avx512_dq"))
    assert cpu.use_packed_linear(torch.bfloat16) == (bf16_packing and torch.backends.mkldnn.is_available())
    assert not cpu.use_packed_linear(torch.float32)  # float32 keeps the reference's F.linear
    assert cpu.use_gguf_quantized_linear(torch.bfloat16) and not cpu.use_gguf_quantized_linear(torch.float32)
    assert cpu.attention_backend_names(torch.bfloat16, 64) == ["CPU_PAGED", "TORCH_REF"]
    assert cpu.graph_runner_qualname() == "minivllm.worker.step_traces.StepTraces"
    monkeypatch.setenv("MINIVLLM_CPU_KERNELS", "0")
    assert not cpu.use_custom_kernels(torch.float32) and not cpu.use_packed_linear(torch.bfloat16)


def test_cpu_kv_cache_memory_is_the_configured_space():
    cpu = get_platform("cpu")
    never = lambda: pytest.fail("the CPU cache is not sized by a profiling run")  # noqa: E731
    assert cpu.kv_cache_memory_bytes(CacheConfig(cpu_kvcache_space_gib=1.5), never) == int(1.5 * GiB)
    assert cpu.kv_cache_memory_bytes(CacheConfig(kv_cache_memory_bytes=12345), never) == 12345
    zeros = cpu.zeros(1 << 20, torch.device("cpu"))
    assert zeros.dtype == torch.uint8 and zeros.numel() == 1 << 20 and not zeros.any()


def test_cuda_platform_decisions():
    """What the CUDA platform answers needs no device: Triton attention then the reference, no CPU
    kernels, decode steps replayed from CUDA graphs."""
    cuda = CudaPlatform()
    assert not cuda.use_custom_kernels(torch.bfloat16) and not cuda.use_packed_linear(torch.bfloat16)
    assert cuda.attention_backend_names(torch.bfloat16, 128) == ["TRITON_ATTN", "TORCH_REF"]
    assert cuda.graph_runner_qualname() == "minivllm.worker.cuda_graph.CudaGraphRunner"
    assert cuda.kv_cache_memory_bytes(CacheConfig(kv_cache_memory_bytes=77), lambda: None) == 77
