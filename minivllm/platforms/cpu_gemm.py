"""Which GEMM runs a bfloat16 model's linears on this CPU: oneDNN's or minivllm's.

oneDNN multiplies bfloat16 with the CPU's bfloat16 dot product (vdpbf16ps); minivllm's
(ops/csrc/bf16_gemm.cpp) widens the weight to float32 in registers and uses float32 FMAs. Which
is faster depends on the core, not on a feature flag: on Zen 4 the dot product does twice the
work of an FMA, while on Intel's AVX-512 cores without AMX it issues on one port where FMAs issue
on two, and minivllm's GEMM ran 1.2-1.9x faster than oneDNN's at every row count (2-core Xeon,
docs/PERFORMANCE.md). So each process times both once, on a projection of a small model at a
decode step's and a prompt's row count, and keeps oneDNN unless minivllm's wins both.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch

from minivllm import envs
from minivllm.logger import init_logger
from minivllm.ops import cpu_kernels

logger = init_logger(__name__)

# Output columns per panel of minivllm's packed weight: layers with other sizes keep oneDNN.
PANEL = 32
# What is timed: [rows, K] x [K, N], rows of a decode step and of a prompt chunk.
PROBE_ROWS = (16, 256)
PROBE_K, PROBE_N = 1024, 1024
PROBE_REPEATS = 5


def minivllm_gemm_built() -> bool:
    """Whether the kernels are built and on (MINIVLLM_CPU_KERNELS) and hold the GEMM, which is
    compiled for AVX-512 CPUs only."""
    return cpu_kernels.enabled() and hasattr(torch.ops.minivllm_cpu, "bf16_gemm")


@functools.cache
def use_minivllm_gemm() -> bool:
    """Whether bfloat16 linears run minivllm's GEMM in this process (MINIVLLM_CPU_BF16_GEMM, or
    timed once)."""
    choice = envs.cpu_bf16_gemm()
    if choice == "minivllm" and not minivllm_gemm_built():
        raise ValueError("MINIVLLM_CPU_BF16_GEMM=minivllm needs minivllm's CPU kernels, built and on, on an AVX-512 CPU.")
    if choice != "auto":
        return choice == "minivllm"
    if not minivllm_gemm_built():
        return False
    onednn, ours = _time_both()
    chosen = all(o < d for o, d in zip(ours, onednn, strict=True))
    logger.info("bfloat16 linears: %s's GEMM (%s ms at %s rows; oneDNN's: %s ms)", "minivllm" if chosen else "oneDNN",
                "/".join(f"{t * 1e3:.2f}" for t in ours), "/".join(map(str, PROBE_ROWS)),
                "/".join(f"{t * 1e3:.2f}" for t in onednn))
    return chosen


def _time_both() -> tuple[list[float], list[float]]:
    """Best-of-PROBE_REPEATS seconds per row count: (oneDNN's, minivllm's)."""
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(PROBE_N, PROBE_K, generator=generator) * 0.05).bfloat16()
    onednn_weight = torch.ops.mkldnn._reorder_linear_weight(weight)
    minivllm_weight = torch.ops.minivllm_cpu.bf16_pack_weight(weight)
    inputs = [torch.randn(rows, PROBE_K, generator=generator).bfloat16() for rows in PROBE_ROWS]
    return ([_best_time(torch.ops.minivllm_cpu.packed_linear, x, onednn_weight) for x in inputs],
            [_best_time(torch.ops.minivllm_cpu.bf16_gemm, x, minivllm_weight) for x in inputs])


def _best_time(gemm: Callable[..., torch.Tensor], x: torch.Tensor, weight: torch.Tensor) -> float:
    gemm(x, weight, None)  # first call: oneDNN builds its kernel for the shape
    best = float("inf")
    for _ in range(PROBE_REPEATS):
        start = time.perf_counter()
        gemm(x, weight, None)
        best = min(best, time.perf_counter() - start)
    return best
