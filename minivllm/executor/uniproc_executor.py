"""The executor for one device: the worker lives in the engine process and is called directly."""

from __future__ import annotations

from typing import Any

from minivllm.executor.abstract import Executor
from minivllm.worker.worker import Worker


class UniProcExecutor(Executor):
    def _init_executor(self) -> None:
        self.driver_worker = Worker(self.vllm_config, local_rank=0, rank=0)
        self.driver_worker.init_device()
        self.driver_worker.load_model()

    def collective_rpc(self, method: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        return [getattr(self.driver_worker, method)(*args, **(kwargs or {}))]

    def check_health(self) -> None:
        self.driver_worker.check_health()

    def shutdown(self) -> None:
        """Nothing to stop: the worker goes with the engine process."""
