"""Data parallelism (`data_parallel_size=2`): two engine-core processes behind one front end.
Greedy output against transformers; requests spread evenly (each core's own stats); the merged
stats are the sums; aborts reach the core that has the request; a killed core fails every
caller within 5 s and leaves no process; the server path."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from engine_utils import MAX_NEW_TOKENS, assert_engine_idle, generate_greedy, make_prompts
from reference import check_logprobs_close, hf_greedy
from server_utils import TINY_SERVER_ARGS, RemoteServer

from minivllm import AsyncEngineArgs, AsyncLLM, EngineDeadError, RequestOutputKind, SamplingParams

DP2 = {"data_parallel_size": 2, "dtype": "float32"}


@pytest.fixture(scope="module")
def case(make_tiny_model):
    from transformers import AutoTokenizer

    model_dir = make_tiny_model("llama")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = make_prompts(tokenizer, tokenizer.vocab_size)
    return model_dir, prompts, [r.as_output() for r in hf_greedy(model_dir, prompts, MAX_NEW_TOKENS)]


def test_dp2_matches_hf_and_spreads_requests(case, make_llm):
    model_dir, prompts, reference = case
    llm = make_llm(model_dir, **DP2)
    check_logprobs_close(outputs_0=reference, outputs_1=generate_greedy(llm, prompts), name_0="hf", name_1="dp2")
    client = llm.llm_engine.engine_core
    per_core = [s.prefix_cache_requests for s in client.latest_stats]
    assert per_core == [len(prompts) // 2] * 2, per_core  # ten requests sent at once: five each
    merged = llm.llm_engine.get_scheduler_stats()
    assert merged.prefix_cache_requests == len(prompts)
    assert merged.num_computed_tokens == sum(s.num_computed_tokens for s in client.latest_stats)
    assert client.load == [0, 0] and not client.owner
    assert_engine_idle(llm)


def greedy_stream(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, output_kind=RequestOutputKind.DELTA)


async def _collect(engine: AsyncLLM, request_id: str, prompt: list[int], n: int) -> list[int]:
    ids = []
    async for out in engine.generate(prompt, greedy_stream(n), request_id):
        ids += out.outputs[0].token_ids
    return ids


@pytest.fixture
def async_dp(case, monkeypatch):
    monkeypatch.setenv("MINIVLLM_ENABLE_MULTIPROCESSING", "1")
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(case[0]), **DP2))
    yield engine
    engine.shutdown()


def test_async_dp2_streams_aborts_and_death(case, async_dp):
    """Streams on both cores give the reference tokens; an abort frees its core; then a killed
    core fails every open stream (on either core) within 5 s, and later requests too."""
    _, prompts, reference = case
    engine = async_dp

    async def main() -> float:
        results = await asyncio.gather(*(_collect(engine, f"s{i}", prompts[i], MAX_NEW_TOKENS) for i in range(4)))
        assert results == [reference[i][0] for i in range(4)]
        # An abort: its core counts it gone, and so does the core's own scheduler.
        task = asyncio.create_task(_collect(engine, "long", prompts[0], 5000))
        await asyncio.sleep(0.5)
        await engine.abort("long")
        await asyncio.sleep(0.5)
        task.cancel()
        stats = await engine.get_scheduler_stats()
        assert stats.num_running_reqs == 0 and engine.engine_core.load == [0, 0]
        # Death of one core.
        tasks = [asyncio.create_task(_collect(engine, f"k{i}", prompts[i], 5000)) for i in range(4)]
        await asyncio.sleep(1.0)
        assert engine.engine_core.load == [2, 2]
        os.kill(engine.engine_core.clients[1].resources.engine.pid, signal.SIGKILL)
        start = time.monotonic()
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=10)
        assert all(isinstance(o, EngineDeadError) for o in outcomes), outcomes
        with pytest.raises(EngineDeadError):
            await _collect(engine, "late", prompts[0], 4)
        return time.monotonic() - start

    assert asyncio.run(main()) < 5
    pids = [c.resources.engine.pid for c in engine.engine_core.clients]
    engine.shutdown()
    for pid in pids:
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # reaped: no process left


def test_server_with_data_parallel(case, make_llm):
    model_dir, prompts, _ = case
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    want = make_llm(model_dir, dtype="float32").generate([{"prompt_token_ids": p} for p in prompts[:4]], params,
                                                         use_tqdm=False)
    with RemoteServer(model_dir, [*TINY_SERVER_ARGS, "--data-parallel-size", "2"]) as server, server.client() as client:
        replies = [client.completions.create(model=server.model, prompt=p, max_tokens=MAX_NEW_TOKENS, temperature=0,
                                             extra_body={"ignore_eos": True}) for p in prompts[:4]]
        metrics = server.metrics()
    assert [r.choices[0].text for r in replies] == [w.outputs[0].text for w in want]
    assert metrics["vllm:num_requests_running"] == 0
