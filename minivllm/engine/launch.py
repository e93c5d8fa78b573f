"""The engine process's main (`main`, with `--hf-config` in argv or not), run by
engine/core_client.py: start_engine_interpreter.

The front end starts the engine core as a fresh interpreter (spawn semantics, but without
multiprocessing's re-import of the user's main module, so scripts need no `__main__` guard),
possibly before it has a config: the model code is imported first, then the pickled (input
address, output address, parent pid, VllmConfig) is read from stdin. With --hf-config (an HF
directory's config, read through transformers) its config classes are imported meanwhile too.
"""

from __future__ import annotations

import os
import pickle
import sys


def main() -> None:
    from minivllm.engine.core import run_engine_core

    if "--hf-config" in sys.argv[1:]:
        # The config comes pickled with a transformers config object inside. Importing its class
        # now overlaps the front end's reading of the config, instead of following it (~2 s).
        from minivllm.transformers_utils.config import import_config_classes

        import_config_classes()
    try:
        input_address, output_address, parent_pid, vllm_config = pickle.load(sys.stdin.buffer)
    except EOFError:
        return  # the front end gave up before it had a config (the model's refused a setting)
    run_engine_core(vllm_config, input_address, output_address, parent_pid)
    # The core has closed its sockets and flushed its outputs: nothing is left to release, and
    # the interpreter's teardown (torch's modules and allocations, ~0.7 s) would only delay the
    # front end, which waits for this process to exit when it shuts the engine down.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

