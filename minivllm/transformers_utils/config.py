"""A model's path and HF config, as EngineArgs resolves them into a ModelConfig.

A GGUF model's config is read from its metadata without torch or transformers' config classes
(gguf_utils.py); an HF directory's through transformers' AutoConfig.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from minivllm.transformers_utils.gguf_utils import (
    default_model_path,
    gemma3_model_path,
    load_gguf_config,
)

# Models that ship as PyPI packages, by the name `--model` accepts for them.
PACKAGED_MODELS: dict[str, Callable[[], str]] = {
    "smollm2-135m-instruct": default_model_path,
    "gemma-3-270m": gemma3_model_path,
}


def resolve_model_path(model: str | None) -> str:
    """The local path of `model` (the default model when None), or a ValueError saying why not."""
    if model is None:
        return default_model_path()
    if model in PACKAGED_MODELS and not os.path.exists(model):
        return PACKAGED_MODELS[model]()
    path = os.path.expanduser(model)
    if not os.path.exists(path):
        raise ValueError(
            f"Model path {model!r} does not exist. minivllm loads local models only: give an HF "
            "model directory (config.json + *.safetensors + tokenizer files), a .gguf file, or "
            f"a packaged model's name ({', '.join(PACKAGED_MODELS)})."
        )
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"Model directory {model!r} has no config.json.")
    if os.path.isfile(path) and not path.endswith(".gguf"):
        raise ValueError(f"Model file {model!r} is not a .gguf file.")
    return path


def get_config(model_path: str) -> Any:
    if model_path.endswith(".gguf"):
        return load_gguf_config(model_path)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path, local_files_only=True)


def import_config_classes() -> None:
    """Import transformers' config classes for the supported architectures.

    For a process about to unpickle an HF directory's config: the first config class costs ~2 s
    to import (the rest of transformers it pulls in), the others almost nothing.
    """
    import transformers

    from minivllm.model.registry import supported_architectures

    for arch in supported_architectures():
        getattr(transformers, arch.replace("ForCausalLM", "Config"))
