"""`python -m minivllm.engine.launch INPUT OUTPUT PARENT_PID`: the engine process's main.

The front end starts the engine core as a fresh interpreter (spawn semantics, but without
multiprocessing's re-import of the user's main module, so scripts need no `__main__` guard)
and writes the pickled VllmConfig to its stdin.
"""

from __future__ import annotations

import pickle
import sys


def main() -> None:
    input_address, output_address, parent_pid = sys.argv[1], sys.argv[2], int(sys.argv[3])
    vllm_config = pickle.load(sys.stdin.buffer)
    from minivllm.engine.core import run_engine_core

    run_engine_core(vllm_config, input_address, output_address, parent_pid)


if __name__ == "__main__":
    main()
