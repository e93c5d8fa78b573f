"""The executor for one device: the worker lives in this process and is called directly.

The executor is the seam where tensor-parallel (one worker per device) and multi-node
executors plug in; the engine core only ever talks to this interface.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from minivllm.worker.worker import Worker

if TYPE_CHECKING:
    from minivllm.config import VllmConfig
    from minivllm.core.outputs import ModelRunnerOutput
    from minivllm.core.sched.output import SchedulerOutput


class UniProcExecutor:
    def __init__(self, vllm_config: VllmConfig) -> None:
        self.worker = Worker(vllm_config)
        self.worker.load_model()

    def determine_num_available_blocks(self) -> int:
        return self.worker.determine_num_available_blocks()

    def initialize_cache(self, num_blocks: int) -> None:
        self.worker.initialize_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)
