"""The server's periodic log line (vLLM's LoggingStatLogger): every interval, what the engine did
since the last line, read from the front end's EngineStats."""

from __future__ import annotations

import time

from minivllm.core.outputs import SpecDecodingStats
from minivllm.logger import init_logger
from minivllm.metrics.stats import EngineStats

logger = init_logger(__name__)


class LoggingStatLogger:
    def __init__(self, interval_s: float = 10.0) -> None:
        self.interval_s = interval_s
        self._last_time = time.monotonic()
        self._last_prompt_tokens = 0
        self._last_generation_tokens = 0
        self._last_spec: SpecDecodingStats | None = None

    def maybe_log(self, stats: EngineStats) -> None:
        now = time.monotonic()
        elapsed = now - self._last_time
        if elapsed < self.interval_s:
            return
        s = stats.scheduler
        hit_rate = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: %d reqs, "
            "Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
            (stats.prompt_tokens - self._last_prompt_tokens) / elapsed,
            (stats.generation_tokens - self._last_generation_tokens) / elapsed,
            s.num_running_reqs, s.num_waiting_reqs, 100 * s.kv_cache_usage, 100 * hit_rate)
        if s.spec_decoding is not None:
            self._log_spec_decoding(s.spec_decoding, elapsed)
            self._last_spec = s.spec_decoding
        self._last_time = now
        self._last_prompt_tokens = stats.prompt_tokens
        self._last_generation_tokens = stats.generation_tokens

    def _log_spec_decoding(self, spec: SpecDecodingStats, elapsed: float) -> None:
        last = self._last_spec or SpecDecodingStats(spec.num_spec_tokens)
        drafts = spec.num_drafts - last.num_drafts
        if drafts == 0:
            return
        draft_tokens = spec.num_draft_tokens - last.num_draft_tokens
        accepted = spec.num_accepted_tokens - last.num_accepted_tokens
        per_pos = [(a - b) / drafts for a, b in zip(spec.num_accepted_tokens_per_pos,
                                                     last.num_accepted_tokens_per_pos, strict=True)]
        logger.info(
            "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f tokens/s, "
            "Drafted throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d tokens, "
            "Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%",
            1 + accepted / drafts, accepted / elapsed, draft_tokens / elapsed, accepted, draft_tokens,
            ", ".join(f"{rate:.3f}" for rate in per_pos), 100 * accepted / max(draft_tokens, 1))
