"""The periodic log line's speculative decoding figures, computed by hand from two snapshots."""

from __future__ import annotations

import logging

from minivllm.core.outputs import SchedulerStats, SpecDecodingStats
from minivllm.metrics.loggers import LoggingStatLogger
from minivllm.metrics.stats import EngineStats


def test_spec_decoding_line_is_the_difference_between_snapshots(caplog, monkeypatch):
    clock = iter([0.0, 10.0, 20.0])
    monkeypatch.setattr("minivllm.metrics.loggers.time.monotonic", lambda: next(clock))
    stat_logger = LoggingStatLogger(interval_s=10.0)
    stats = EngineStats(scheduler=SchedulerStats(spec_decoding=SpecDecodingStats(3, 4, 12, 6, [3, 2, 1])))
    with caplog.at_level(logging.INFO, logger="minivllm.metrics.loggers"):
        stat_logger.maybe_log(stats)
        # Since: 6 more drafts of 3 tokens, 9 accepted: 5 at position 0, 3 at 1, 1 at 2.
        stats.scheduler = SchedulerStats(spec_decoding=SpecDecodingStats(3, 10, 30, 15, [8, 5, 2]))
        stats.generation_tokens = 240
        stat_logger.maybe_log(stats)
    lines = [r.getMessage() for r in caplog.records if "SpecDecoding" in r.getMessage()]
    assert lines[1] == (
        "SpecDecoding metrics: Mean acceptance length: 2.50, Accepted throughput: 0.90 tokens/s, "
        "Drafted throughput: 1.80 tokens/s, Accepted: 9 tokens, Drafted: 18 tokens, "
        "Per-position acceptance rate: 0.833, 0.500, 0.167, Avg Draft acceptance rate: 50.0%")
    assert "Avg generation throughput: 24.0 tokens/s" in caplog.records[-2].getMessage()
