"""`python -m minivllm.engine.launch`: the engine process's main.

The front end starts the engine core as a fresh interpreter (spawn semantics, but without
multiprocessing's re-import of the user's main module, so scripts need no `__main__` guard) and
writes the pickled (input address, output address, parent pid, VllmConfig) to its stdin.
"""

from __future__ import annotations

import os
import pickle
import sys


def main() -> None:
    from minivllm.engine.core import run_engine_core

    input_address, output_address, parent_pid, vllm_config = pickle.load(sys.stdin.buffer)
    run_engine_core(vllm_config, input_address, output_address, parent_pid)
    # The core has closed its sockets and flushed its outputs: nothing is left to release, and
    # the interpreter's teardown (torch's modules and allocations, ~0.7 s) would only delay the
    # front end, which waits for this process to exit when it shuts the engine down.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
