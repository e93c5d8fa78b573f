"""Which class implements which `config.architectures` entry.

Importable without torch: the engine checks the architecture while building its config, before
any model code is loaded.
"""

from __future__ import annotations

import importlib

# architecture name -> (module under minivllm.model.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def check_architecture(architectures: list[str] | None) -> str:
    """The first supported name in `architectures`, or a ValueError naming the supported ones."""
    for arch in architectures or ():
        if arch in _MODELS:
            return arch
    raise ValueError(
        f"Model architecture(s) {architectures} are not supported. "
        f"Supported architectures: {', '.join(supported_architectures())}."
    )


def get_model_class(architectures: list[str] | None) -> type:
    module_name, class_name = _MODELS[check_architecture(architectures)]
    module = importlib.import_module(f"minivllm.model.models.{module_name}")
    return getattr(module, class_name)
