"""Checks on a running minivllm engine that work whether its core is in-process or not."""

from __future__ import annotations

from minivllm import LLM


def assert_engine_idle(llm: LLM) -> None:
    """No request left anywhere, and every KV block back in the pool (cached ones count as free)."""
    stats = llm.llm_engine.get_scheduler_stats()
    assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0, stats
    assert stats.kv_cache_usage == 0.0, stats
    assert not llm.llm_engine.has_unfinished_requests()


def num_preemptions(llm: LLM) -> int:
    return llm.llm_engine.get_scheduler_stats().num_preemptions


def model_runner(llm: LLM):
    """The ModelRunner of an engine whose core runs in this process
    (MINIVLLM_ENABLE_MULTIPROCESSING=0)."""
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner
