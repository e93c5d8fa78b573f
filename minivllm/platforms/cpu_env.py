"""Process settings for CPU inference: how the C allocator treats big temporaries, and how much
oneDNN may keep per matrix shape.

glibc serves allocations above its mmap threshold (128 KiB at first, adapting up to 32 MiB) with
fresh mmap'd pages and unmaps them on free, so every step's large temporaries (gathered K/V,
MLP activations, logits) fault in new zeroed pages again. Measured on a 2-core CPU, that made
the decode attention of 64 requests up to 3x slower and its time erratic. Raising the mmap and
trim thresholds keeps those buffers in the heap and reuses them; the KV cache (GiBs) is still
mmap'd, so it costs no start-up time and no page is touched before it is used.

oneDNN, which runs the bfloat16 matmuls, keeps what it built for each matrix shape in two caches
of 1024 entries (its primitive cache, and ideep's above it). A linear's row count is the step's
token count, which takes hundreds of values under load, and a new count cost ~2.4 MiB of heap
for SmolLM2-135M's five linear shapes: a server's memory grew for minutes (500 MiB or more)
before the caches were full. Bounded to ONEDNN_CACHE_ENTRIES (~50 token counts, ~120 MiB), the
caches fill within the first minute of load; a shape built again costs ~0.05 ms per linear.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

from minivllm.logger import init_logger

logger = init_logger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 64 << 20  # above the largest per-step temporary of a small model
TRIM_THRESHOLD_BYTES = 1 << 30
ONEDNN_CACHE_ENTRIES = 256
ONEDNN_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")  # oneDNN's, ideep's


def bound_onednn_caches() -> None:
    """Before this process's first bfloat16 matmul (the caches read their size once); a size set
    in the environment is kept."""
    for name in ONEDNN_CACHE_VARIABLES:
        os.environ.setdefault(name, str(ONEDNN_CACHE_ENTRIES))


def configure_allocator() -> bool:
    """Raise glibc's mmap/trim thresholds for this process; False where that does not apply."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    if not ok:
        logger.debug("mallopt refused the allocator thresholds; keeping the defaults")
    return ok
