"""Checks on a running minivllm engine that work whether its core is in-process or not."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from minivllm import LLM, SamplingParams

MAX_NEW_TOKENS = 32
TEXT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village at the edge of the forest, there lived",
    "1, 2, 3, 4,",
]


def make_prompts(tokenizer, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Four text prompts and six random-token prompts, 1 to 300 tokens long."""
    rng = random.Random(seed)
    prompts = [tokenizer.encode(text) for text in TEXT_PROMPTS]
    for length in (1, 7, 33, 120, 250, 300):
        prompts.append([rng.randrange(3, vocab_size) for _ in range(length)])
    return prompts


def generate_greedy(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[dict]]]:
    """MAX_NEW_TOKENS greedy tokens per prompt, with the top-5 logprobs check_logprobs_close reads."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


def assert_engine_idle(llm: LLM) -> None:
    """No request left anywhere, and every KV block back in the pool (cached ones count as free)."""
    stats = llm.llm_engine.get_scheduler_stats()
    assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0, stats
    assert stats.kv_cache_usage == 0.0, stats
    assert not llm.llm_engine.has_unfinished_requests()


IDLE_TIMEOUT_S = 10.0  # aborts travel to an engine process asynchronously


def assert_engines_idle(fixture_values: Iterable[Any]) -> None:
    """After a test: every engine it used (LLMs, the LLMs of an LLM factory, AsyncLLMs, servers)
    holds no request, running or waiting, and no KV block (cached-free ones count as free).
    Engines the test shut down or killed are skipped: a dead engine holds nothing."""
    from minivllm.engine.async_llm import AsyncLLM
    from minivllm.engine.exceptions import EngineDeadError

    for value in fixture_values:
        engines = getattr(value, "_built", [value])  # an LLMFactory: what it built
        for engine in engines:
            if isinstance(engine, LLM):
                stats = lambda llm=engine: llm.llm_engine.get_scheduler_stats()  # noqa: E731
            elif isinstance(engine, AsyncLLM):
                stats = lambda llm=engine: asyncio.run(llm.get_scheduler_stats())  # noqa: E731
            elif type(engine).__name__ == "RemoteServer":
                _assert_server_idle(engine)
                continue
            else:
                continue
            try:
                idle = _wait_for_idle(stats)
            except EngineDeadError:
                continue
            assert idle is None, f"the test left its engine busy: {idle}"


def _wait_for_idle(stats: Callable[[], Any]) -> Any:
    """None once the engine is idle, else its last stats after IDLE_TIMEOUT_S."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        current = stats()
        if current.num_running_reqs == 0 and current.num_waiting_reqs == 0 and current.kv_cache_usage == 0.0:
            return None
        if time.monotonic() > deadline:
            return current
        time.sleep(0.05)


def _assert_server_idle(server: Any) -> None:
    from server_utils import wait_until_idle

    if server.proc.poll() is not None:
        return
    idle, metrics = wait_until_idle(server, timeout=IDLE_TIMEOUT_S)
    assert idle, f"the test left its server busy: {metrics}"


def num_preemptions(llm: LLM) -> int:
    return llm.llm_engine.get_scheduler_stats().num_preemptions


def model_runner(llm: LLM):
    """The ModelRunner of an engine whose core runs in this process
    (MINIVLLM_ENABLE_MULTIPROCESSING=0)."""
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner


def engine_core(llm: LLM):
    """The EngineCore of an engine whose core runs in this process
    (MINIVLLM_ENABLE_MULTIPROCESSING=0)."""
    return llm.llm_engine.engine_core.engine_core


def held_blocks_per_group(llm: LLM) -> list[tuple[int, int]]:
    """(blocks held by running requests, layers in the group) for each KV cache group of an
    in-process engine; the null entries a sliding window leaves are not blocks."""
    managers = engine_core(llm).scheduler.kv_cache_manager.coordinator.single_type_managers
    layers = Counter(layer.kv_cache_group_id for layer in model_runner(llm).attention_layers.values())
    return [
        (sum(b is not m.block_pool.null_block for blocks in m.req_to_blocks.values() for b in blocks), layers[g])
        for g, m in enumerate(managers)
    ]


def trace_held_blocks(llm: LLM, prompt: list[int], max_tokens: int) -> list[tuple[int, list[tuple[int, int]]]]:
    """Run one request alone on an in-process engine: (its computed tokens, held_blocks_per_group)
    after every step it is still running."""
    engine = llm.llm_engine
    engine.add_request("traced", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    trace = []
    while engine.has_unfinished_requests():
        engine.step()
        running = engine_core(llm).scheduler.running
        if running:
            trace.append((running[0].num_computed_tokens, held_blocks_per_group(llm)))
    return trace
