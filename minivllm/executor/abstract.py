"""The executor interface: how the engine core runs its workers, whichever way they run.

EngineCore talks only to this class. It chooses the implementation by name
(`parallel_config.distributed_executor_backend`, vLLM's names): "uni", one worker in the engine
process; "mp", one worker process per tensor-parallel rank on this machine; "ray", workers as
Ray actors, on the machines of a Ray cluster. Every call to the workers is a collective_rpc: a method of
the Worker by name, run on every worker, the results in rank order.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from minivllm.config import VllmConfig
    from minivllm.core.kv_cache_interface import KVCacheConfig, KVCacheSpec
    from minivllm.core.outputs import ModelRunnerOutput
    from minivllm.core.sched.output import SchedulerOutput

# backend name -> "module.Class"
_EXECUTORS = {
    "uni": "minivllm.executor.uniproc_executor.UniProcExecutor",
    "mp": "minivllm.executor.multiproc_executor.MultiprocExecutor",
    "ray": "minivllm.executor.ray_executor.RayDistributedExecutor",
}


class ExecutorFailedError(RuntimeError):
    """A worker died; the executor cannot run another step."""


class Executor(ABC):
    @staticmethod
    def get_class(vllm_config: VllmConfig) -> type[Executor]:
        backend = vllm_config.parallel_config.distributed_executor_backend
        if backend not in _EXECUTORS:
            raise ValueError(f"No executor {backend!r}; available: {', '.join(_EXECUTORS)}.")
        module_name, class_name = _EXECUTORS[backend].rsplit(".", 1)
        return getattr(importlib.import_module(module_name), class_name)

    def __init__(self, vllm_config: VllmConfig) -> None:
        """Start the workers: each has its device and the model loaded when this returns."""
        self.vllm_config = vllm_config
        self._init_executor()

    @abstractmethod
    def _init_executor(self) -> None: ...

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Run a Worker method on every worker; their results, by rank."""

    def get_kv_cache_specs(self) -> list[dict[str, KVCacheSpec]]:
        return self.collective_rpc("get_kv_cache_spec")

    def determine_available_memory(self) -> list[int]:
        """Bytes each worker's KV cache may take."""
        return self.collective_rpc("determine_available_memory")

    def initialize_from_config(self, kv_cache_configs: list[KVCacheConfig]) -> None:
        """Allocate each worker's KV cache (one config per worker, by rank)."""
        self.collective_rpc("initialize_from_config", args=(kv_cache_configs,))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every worker; the driver worker's (rank 0's) output."""
        return self.collective_rpc("execute_model", args=(scheduler_output,))[0]

    @abstractmethod
    def check_health(self) -> None:
        """Raise if a worker is gone."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and release what they hold; idempotent."""
