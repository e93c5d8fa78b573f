"""`python -m minivllm.engine.launch`: the engine process's main.

The front end starts the engine core as a fresh interpreter (spawn semantics, but without
multiprocessing's re-import of the user's main module, so scripts need no `__main__` guard),
possibly before it has a config: the model code and transformers' config classes are imported
first, then the pickled (input address, output address, parent pid, VllmConfig) is read from
stdin.
"""

from __future__ import annotations

import pickle
import sys


def main() -> None:
    from minivllm.engine.core import run_engine_core
    from minivllm.transformers_utils import import_config_classes

    # The config comes pickled with a transformers config object inside. Importing its class
    # now overlaps the front end's reading of the config, instead of following it (~2 s).
    import_config_classes()

    try:
        input_address, output_address, parent_pid, vllm_config = pickle.load(sys.stdin.buffer)
    except EOFError:
        return  # the front end gave up before it had a config (a bad argument, say)
    run_engine_core(vllm_config, input_address, output_address, parent_pid)


if __name__ == "__main__":
    main()
