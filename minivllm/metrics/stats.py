"""Engine statistics as the front end sees them: the scheduler's latest snapshot plus counters
kept while processing outputs. One place, read by LLM.get_metrics (and the server's /metrics)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from minivllm.core.outputs import SchedulerStats


@dataclass
class EngineStats:
    scheduler: SchedulerStats = field(default_factory=SchedulerStats)
    prompt_tokens: int = 0  # prompt lengths of requests that produced their first token
    generation_tokens: int = 0
    finished_requests: Counter[str] = field(default_factory=Counter)  # by finish reason

    def record_scheduler_stats(self, stats: SchedulerStats | None) -> None:
        if stats is not None:
            self.scheduler = stats

    def record_first_token(self, prompt_len: int) -> None:
        self.prompt_tokens += prompt_len

    def record_new_tokens(self, num_tokens: int) -> None:
        self.generation_tokens += num_tokens

    def record_finished(self, finish_reason: str) -> None:
        self.finished_requests[finish_reason] += 1
