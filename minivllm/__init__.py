"""minivllm: a compact, readable LLM inference engine implementing the vLLM V1 architecture.

The public names are imported lazily, so that `import minivllm.core...` (pure Python, no torch)
stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "minivllm.entrypoints.llm",
    "SamplingParams": "minivllm.sampling_params",
    "RequestOutput": "minivllm.outputs",
    "CompletionOutput": "minivllm.outputs",
    "Logprob": "minivllm.outputs",
    "EngineArgs": "minivllm.engine.arg_utils",
    "LLMEngine": "minivllm.engine.llm_engine",
    "AsyncLLM": "minivllm.engine.async_llm",
    "AsyncEngineArgs": "minivllm.engine.arg_utils",
    "EngineDeadError": "minivllm.engine.exceptions",
    "RequestOutputKind": "minivllm.sampling_params",
}

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "EngineArgs",
    "LLMEngine",
    "AsyncLLM",
    "AsyncEngineArgs",
    "EngineDeadError",
    "RequestOutputKind",
]

if TYPE_CHECKING:
    from minivllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
    from minivllm.engine.async_llm import AsyncLLM
    from minivllm.engine.exceptions import EngineDeadError
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.entrypoints.llm import LLM
    from minivllm.outputs import CompletionOutput, Logprob, RequestOutput
    from minivllm.sampling_params import RequestOutputKind, SamplingParams


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'minivllm' has no attribute {name!r}")
