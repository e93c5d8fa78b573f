"""Builds and loads the C++ CPU kernels (csrc/*.cpp) as torch.ops.minivllm_cpu.

paged_attention.cpp: decode attention through block tables and the K/V cache write;
layernorm.cpp: RMSNorm with the residual add; activation.cpp: SiLU-and-mul; pos_encoding.cpp:
rotary embedding in place; q8_0_linear.cpp and q4_1_linear.cpp: x @ W^T from GGUF Q8_0 / Q4_1
codes for a few rows (q4_1_linear only where the CPU has AVX512-BF16); gguf_linear.cpp: a GGUF
layer's choice between those and its dequantized matrix, by rows, in one op; argmax.cpp: the
sampler's row-wise argmax; exponential_race.cpp: its random draw; top_k_top_p.cpp: its
truncation without a sort. Each matches the torch reference path's roundings, or computes more
exactly (see its header); the race draws from another generator than torch's, an equally exact
draw.

The kernels are compiled once per machine, with -march=native, by `python -m
minivllm.ops.cpu_kernels` (scripts/setup.sh runs it; about 30 s on 2 cores) into
MINIVLLM_CACHE_ROOT/kernels/, under a name that hashes the sources, torch's version and the
compiler flags. Start-up only loads a finished build: it never compiles, so it stays fast, and
without a build (no compiler, or never run) every layer takes its torch path.
MINIVLLM_CPU_KERNELS=0 turns the kernels off without removing the build.

NOTE: g++ is called directly rather than through torch.utils.cpp_extension, which needs ninja on
PATH. -fopenmp makes at::parallel_for use OpenMP; the library then shares the libgomp that torch
already loaded (same soname), so kernels and torch ops run on one thread pool.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from minivllm import envs
from minivllm.logger import init_logger

logger = init_logger(__name__)

CSRC = Path(__file__).parent / "csrc"
# Sizes the elementwise kernels step over must be multiples of this (two AVX-512 vectors of
# float32, csrc/vec_utils.h's kPair); layers with other sizes take their torch path.
VECTOR_ALIGN = 32
_loaded = False


def _compile_flags() -> list[str]:
    # -ffp-contract=off: no fused multiply-adds where the reference rounds the product first.
    flags = ["-O3", "-march=native", "-std=c++20", "-fPIC", "-fopenmp", "-ffp-contract=off", "-w",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    # ATen's Vectorized<float> picks its SIMD width from CPU_CAPABILITY; torch reports the best
    # one this CPU runs.
    capability = torch.backends.cpu.get_cpu_capability()
    if capability in ("AVX512", "AVX2"):
        flags += [f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}"]
    return flags


def _sources() -> list[Path]:
    return sorted(CSRC.glob("*.cpp"))


def library_path() -> Path:
    """Where the build for this source, torch and CPU lives (whether or not it exists yet)."""
    key = hashlib.sha256()
    for path in _sources() + sorted(CSRC.glob("*.h")):
        key.update(path.name.encode() + path.read_bytes())
    key.update(torch.__version__.encode())
    key.update(" ".join(_compile_flags()).encode())
    return Path(envs.cache_root()) / "kernels" / f"minivllm_cpu_{key.hexdigest()[:16]}.so"


def build() -> Path:
    """Compile the kernels unless this exact build exists; returns the library's path."""
    target = library_path()
    if target.exists():
        return target
    from torch.utils import cpp_extension

    target.parent.mkdir(parents=True, exist_ok=True)
    includes = [arg for path in cpp_extension.include_paths() for arg in ("-I", path)]
    libs = [arg for path in cpp_extension.library_paths() for arg in ("-L", path)]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        # One compiler per source, side by side, then one link; the library is linked under a
        # temporary name and renamed, so a concurrent builder or loader never sees half of it.
        objects = [os.path.join(tmp, src.stem + ".o") for src in _sources()]
        _run_all([["g++", *_compile_flags(), *includes, "-c", str(src), "-o", obj]
                  for src, obj in zip(_sources(), objects, strict=True)])
        linked = os.path.join(tmp, target.name)
        _run_all([["g++", "-shared", "-fopenmp", *objects, "-o", linked, *libs, "-lc10", "-ltorch_cpu"]])
        os.replace(linked, target)
    logger.info("Built CPU kernels in %.1f s: %s", time.perf_counter() - start, target)
    return target


def _run_all(commands: list[list[str]]) -> None:
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for cmd in commands]
    outputs = [(proc, proc.communicate()[0]) for proc in procs]
    failed = [out for proc, out in outputs if proc.returncode != 0]
    if failed:
        raise RuntimeError("building the CPU kernels failed:\n" + "\n".join(out[-4000:] for out in failed))


def enabled() -> bool:
    """Whether the kernels are built, loaded and not turned off by MINIVLLM_CPU_KERNELS=0."""
    return envs.cpu_kernels() and load()


def load() -> bool:
    """Load the built kernels into torch.ops.minivllm_cpu; False when there is no build."""
    global _loaded
    if not _loaded:
        path = library_path()
        if not path.exists():
            return False
        torch.ops.load_library(str(path))
        _loaded = True
    return True


if __name__ == "__main__":
    print(build())
    sys.exit(0 if load() else 1)
