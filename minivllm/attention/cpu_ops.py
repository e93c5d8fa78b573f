"""Builds and loads the C++ CPU kernels (csrc/paged_attention_cpu.cpp) as torch.ops.minivllm_cpu.

The kernels are compiled once per machine, with -march=native, by `python -m
minivllm.attention.cpu_ops` (scripts/setup.sh runs it; about 15 s on 2 cores) into
MINIVLLM_CACHE_ROOT/kernels/, under a name that hashes the source, torch's version and the
compiler flags. Start-up only loads a finished build: it never compiles, so it stays fast, and
without a build (no compiler, or never run) the engine uses the torch reference backend.

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

SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"
_loaded = False


def _compile_flags() -> list[str]:
    flags = ["-O3", "-march=native", "-std=c++20", "-fPIC", "-shared", "-fopenmp", "-w",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    # ATen's Vectorized<float> picks its SIMD width from CPU_CAPABILITY; torch reports the best
    # one this CPU runs.
    capability = torch.backends.cpu.get_cpu_capability()
    if capability in ("AVX512", "AVX2"):
        flags += [f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}"]
    return flags


def library_path() -> Path:
    """Where the build for this source, torch and CPU lives (whether or not it exists yet)."""
    key = hashlib.sha256()
    key.update(SOURCE.read_bytes())
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
    # Built under a temporary name and renamed, so a concurrent builder or loader never sees a
    # half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = ["g++", *_compile_flags(), *includes, str(SOURCE), "-o", tmp, *libs, "-lc10", "-ltorch_cpu"]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        os.replace(tmp, target)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"building the CPU kernels failed:\n{e.stderr[-4000:]}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("Built CPU kernels in %.1f s: %s", time.perf_counter() - start, target)
    return target


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
