"""oneDNN's per-shape caches stay bounded (platforms/cpu_env.py): bfloat16 linears of 600 row
counts, each a new shape, in a fresh interpreter, counting the C heap's bytes in use
(glibc's mallinfo2). With the bound, the heap stops growing once ONEDNN_CACHE_ENTRIES shapes are
cached; with oneDNN's own 1024 entries it keeps growing with every new shape."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from minivllm.platforms.cpu_env import ONEDNN_CACHE_ENTRIES, ONEDNN_CACHE_VARIABLES

SCRIPT = """
import ctypes, torch
from minivllm.platforms.cpu_env import bound_onednn_caches

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
bound_onednn_caches()
torch.set_num_threads(1)
weight = torch.randn(1536, 576, dtype=torch.bfloat16)
in_use = []
for rows in range(16, 616):
    torch.nn.functional.linear(torch.randn(rows, 576, dtype=torch.bfloat16), weight)
    if rows in (315, 615):
        in_use.append(libc.mallinfo2().uordblks)
print(*in_use)
"""


def _heap_after(env: dict[str, str]) -> tuple[int, int]:
    """Bytes in use after 300 and after 600 shapes."""
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    first, second = map(int, out.stdout.split())
    return first, second


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallinfo2 is glibc's")
def test_onednn_caches_stop_growing_at_the_bound():
    assert ONEDNN_CACHE_ENTRIES < 300  # the caches are full at the first count
    env = {k: v for k, v in os.environ.items() if k not in ONEDNN_CACHE_VARIABLES}
    bounded = _heap_after(env)
    unbounded = _heap_after({**env, **dict.fromkeys(ONEDNN_CACHE_VARIABLES, "1024")})
    growth_bounded, growth_unbounded = bounded[1] - bounded[0], unbounded[1] - unbounded[0]
    # oneDNN's default: 300 more shapes cached, hundreds of KiB each.
    assert growth_unbounded > 50 << 20, unbounded
    assert growth_bounded < growth_unbounded / 10, (bounded, unbounded)
