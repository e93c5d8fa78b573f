"""Tensor parallelism end to end (`tensor_parallel_size=2`, the mp executor: two worker processes,
one core each): greedy output against transformers in float32 with vLLM's logprob criterion, for
tiny models of each family whose head counts split unevenly (3 KV heads on 2 ranks) or replicate
(1 KV head on both), with tied and untied vocabularies; against the same engine at TP=1; with
chunked prefill, prefix caching, preemption, each proposer and structured output; through
the engine process and the server; and a worker killed mid-stream.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import psutil
import pytest
from eagle_heads import eagle1_checkpoint, eagle3_checkpoint, write_hf
from engine_utils import (
    MAX_NEW_TOKENS,
    assert_engine_idle,
    generate_greedy,
    make_prompts,
    num_preemptions,
)
from reference import check_logprobs_close, hf_greedy
from server_utils import TINY_SERVER_ARGS, RemoteServer

from minivllm import AsyncEngineArgs, AsyncLLM, EngineDeadError, SamplingParams
from minivllm.sampling_params import StructuredOutputsParams

TP2 = {"tensor_parallel_size": 2, "dtype": "float32"}

TINY_CASES = {
    # 3 KV heads on 2 ranks: 2 and 1, each with its 2 query heads per KV head; untied lm_head.
    "llama_kv3": ("llama", {"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 96}),
    # 1 KV head on both ranks, 2 query heads each; embedding and lm_head tied, split by vocabulary.
    "llama_kv1_tied": ("llama", {"num_attention_heads": 4, "num_key_value_heads": 1, "tie_word_embeddings": True}),
    "qwen2": ("qwen2", {}),  # q/k/v biases split with their rows
    "qwen3": ("qwen3", {}),  # per-head q/k norms
    "llama_head_dim_64": ("llama", {"head_dim": 64}),  # the C++ CPU attention kernels
}


@pytest.fixture(scope="module")
def cases(make_tiny_model):
    """name -> (model dir, prompts, transformers' greedy output)."""
    from transformers import AutoTokenizer

    built = {}
    for name, (arch, kw) in TINY_CASES.items():
        model_dir = make_tiny_model(arch, **kw)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        prompts = make_prompts(tokenizer, tokenizer.vocab_size)
        built[name] = model_dir, prompts, [r.as_output() for r in hf_greedy(model_dir, prompts, MAX_NEW_TOKENS)]
    return built


@pytest.mark.parametrize("name", list(TINY_CASES))
def test_tp2_matches_hf(cases, make_llm, name):
    model_dir, prompts, reference = cases[name]
    llm = make_llm(model_dir, **TP2)
    check_logprobs_close(outputs_0=reference, outputs_1=generate_greedy(llm, prompts), name_0="hf", name_1="tp2")
    assert_engine_idle(llm)


def test_tp4_replicates_kv_heads(make_tiny_model, make_llm):
    """4 ranks over 2 KV heads (each on two ranks, one query head per rank) and 4 ranks of
    vocabulary, on 2 cores: ranks share cores, one thread each."""
    model_dir = make_tiny_model("llama")
    prompts = [[5, 6, 7, 8] * 4, list(range(100, 160))]
    reference = [r.as_output() for r in hf_greedy(model_dir, prompts, 16)]
    llm = make_llm(model_dir, dtype="float32", tensor_parallel_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)
    outputs = [(o.outputs[0].token_ids, o.outputs[0].logprobs)
               for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    check_logprobs_close(outputs_0=reference, outputs_1=outputs, name_0="hf", name_1="tp4")


def test_tp2_decode_trace_records_the_collectives(cases, make_llm, capfd):
    """Past TRACE_AFTER_STEPS decode steps each rank records its forward (worker/step_traces.py)
    with the all-reduces in it as ops, and replays it: the output stays the TP=1 engine's."""
    model_dir = cases["llama_head_dim_64"][0]  # the CPU kernels' attention, which traces
    prompts = [[5, 6, 7, 8, 9], list(range(200, 240))]
    params = SamplingParams(temperature=0.0, max_tokens=260, ignore_eos=True, logprobs=5)

    def run(llm):
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs)
                for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]

    tp1 = run(make_llm(model_dir, dtype="float32"))
    capfd.readouterr()
    tp2 = run(make_llm(model_dir, **TP2))
    assert capfd.readouterr().err.count("Traced the steps of kind TraceKey(uniform_decode=True") == 2  # one per rank
    check_logprobs_close(outputs_0=tp1, outputs_1=tp2, name_0="tp1", name_1="tp2 traced")


def test_tp2_requests_that_come_and_go_at_different_steps(cases, make_llm):
    """Four requests start two steps before the other six and finish two steps earlier: every
    rank must move the remaining rows alike when they leave (a rank that laid out its batch by
    its own set order summed other requests' partial products: garbage from then on)."""
    model_dir, prompts, reference = cases["llama_kv3"]
    engine = make_llm(model_dir, **TP2).llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=5)
    outputs = {}
    for step in range(10_000):
        if step in (0, 2):
            for i in range(0, 4) if step == 0 else range(4, len(prompts)):
                engine.add_request(str(i), {"prompt_token_ids": prompts[i]}, params)
        outputs |= {int(o.request_id): (o.outputs[0].token_ids, o.outputs[0].logprobs) for o in engine.step() if o.finished}
        if step > 2 and not engine.has_unfinished_requests():
            break
    check_logprobs_close(outputs_0=reference, outputs_1=[outputs[i] for i in range(len(prompts))],
                         name_0="hf", name_1="tp2")


def test_tp2_chunked_prefill_prefix_caching_and_preemption(cases, make_llm):
    """Chunks of at most 48 tokens; 30 usable blocks of 16 tokens, so the ten prompts cannot all
    run at once and some are preempted; the second round finds the prompts' blocks cached."""
    model_dir, prompts, reference = cases["llama_kv3"]
    llm = make_llm(model_dir, **TP2, max_num_batched_tokens=48, long_prefill_token_threshold=20,
                   num_gpu_blocks_override=31, max_model_len=400, enable_prefix_caching=True)
    for _ in range(2):
        check_logprobs_close(outputs_0=reference, outputs_1=generate_greedy(llm, prompts), name_0="hf", name_1="tp2")
    stats = llm.llm_engine.get_scheduler_stats()
    assert num_preemptions(llm) > 0 and stats.prefix_cache_hits > 0, stats
    assert_engine_idle(llm)


def test_tp2_speculative_decoding_and_structured_output(cases, make_llm):
    """n-gram drafts verified on both ranks leave greedy output as it was; a JSON schema holds."""
    model_dir, prompts, reference = cases["llama_kv3"]
    llm = make_llm(model_dir, **TP2, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                          "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    check_logprobs_close(outputs_0=reference, outputs_1=generate_greedy(llm, prompts), name_0="hf", name_1="tp2+ngram")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema))
    text = llm.generate(["Give me a number as JSON:"], params, use_tqdm=False)[0].outputs[0].text
    assert isinstance(json.loads(text)["n"], int)
    assert llm.llm_engine.get_scheduler_stats().spec_decoding.num_drafts > 0
    assert_engine_idle(llm)


@pytest.fixture(scope="module")
def vocab128(make_tiny_model, make_module_llm):
    """A 4-layer target of 128 tokens (EAGLE-3 reads three of its layers) and its TP=1 output."""
    target = make_tiny_model("llama", vocab_size=128, num_hidden_layers=4)
    prompts = [[5, 6, 7, 8] * 6, list(range(3, 60)), [9, 10, 11] * 10 + [4, 5]]
    return target, prompts, generate_greedy(make_module_llm(target, dtype="float32"), prompts)


@pytest.mark.parametrize("method", ["draft_model", "eagle", "eagle3"])
def test_tp2_model_proposers_keep_greedy_output(vocab128, make_llm, tmp_path, method):
    """The drafter's layers are sharded like the target's, its KV pages in each rank's blocks; an
    EAGLE head reads the target's (all-reduced) hidden states. Random heads: exactness is what
    this checks."""
    target, prompts, expected = vocab128
    if method == "draft_model":
        drafter = target
    else:
        drafter = write_hf(tmp_path / method, *(eagle1_checkpoint(num_layers=1, fc_bias=False, vocab=128)
                                                if method == "eagle" else eagle3_checkpoint(vocab=128, draft_vocab=64)))
    llm = make_llm(target, **TP2, speculative_config={"method": method, "model": str(drafter),
                                                      "num_speculative_tokens": 3})
    check_logprobs_close(outputs_0=expected, outputs_1=generate_greedy(llm, prompts), name_0="tp1", name_1=f"tp2+{method}")
    assert llm.llm_engine.get_scheduler_stats().spec_decoding.num_accepted_tokens > 0
    assert_engine_idle(llm)


def _workers(backend: str, engine_pid: int) -> list[psutil.Process]:
    """The worker processes: the engine's spawned children (mp), or Ray's actors (ray)."""
    if backend == "mp":
        candidates = psutil.Process(engine_pid).children(recursive=True)
        return [p for p in candidates if "spawn_main" in _cmdline(p) and "resource_tracker" not in _cmdline(p)]
    return [p for p in psutil.process_iter() if "RayWorkerWrapper" in _cmdline(p)]


def _ray_processes() -> list[psutil.Process]:
    return [p for p in psutil.process_iter() if any(k in _cmdline(p) for k in ("raylet", "gcs_server", "ray::"))]


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return ""


def _gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _minivllm_shm() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith(("minivllm", "psm_"))}


@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_killed_worker_fails_every_caller_and_leaves_nothing(cases, monkeypatch, backend):
    """SIGKILL one worker while four streams decode: every caller gets EngineDeadError within 5 s,
    and after shutdown no engine, worker, Ray process or shared-memory segment is left."""
    monkeypatch.setenv("MINIVLLM_ENABLE_MULTIPROCESSING", "1")
    shm_before = _minivllm_shm()
    model_dir = cases["llama_kv3"][0]
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(model_dir), tensor_parallel_size=2, dtype="float32",
                                                       distributed_executor_backend=backend))
    try:
        engine_process = psutil.Process(engine.engine_core.resources.engine.pid)
        workers = _workers(backend, engine_process.pid)
        assert len(workers) == 2

        async def stream(i: int) -> None:
            params = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
            async for _ in engine.generate([5 + i, 6, 7], params, f"r{i}"):
                pass

        async def main() -> float:
            tasks = [asyncio.create_task(stream(i)) for i in range(4)]
            await asyncio.sleep(1.0)
            workers[1].send_signal(signal.SIGKILL)
            start = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=10)
            assert all(isinstance(r, EngineDeadError) for r in results), results
            return time.monotonic() - start

        assert asyncio.run(main()) < 5
        with pytest.raises(EngineDeadError):
            engine.check_health()
    finally:
        engine.shutdown()
    leftovers = lambda: [p for p in [engine_process, *workers, *_ray_processes()] if not _gone(p)]  # noqa: E731
    deadline = time.monotonic() + 15
    while leftovers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not leftovers()
    assert _minivllm_shm() <= shm_before


def test_ray_tp2_matches_hf_with_chunking_and_preemption(cases, make_llm):
    """The same engine as above with its workers as Ray actors (a local Ray cluster, started and
    stopped by the executor)."""
    model_dir, prompts, reference = cases["llama_kv3"]
    llm = make_llm(model_dir, **TP2, distributed_executor_backend="ray", max_num_batched_tokens=48,
                   long_prefill_token_threshold=20, num_gpu_blocks_override=31, max_model_len=400)
    check_logprobs_close(outputs_0=reference, outputs_1=generate_greedy(llm, prompts), name_0="hf", name_1="ray")
    assert num_preemptions(llm) > 0
    assert_engine_idle(llm)


def test_server_with_tensor_parallel(cases, make_llm):
    """The same text as the offline TP=1 engine's, through `minivllm serve --tensor-parallel-size 2`."""
    model_dir, prompts, _ = cases["llama_kv3"]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    want = make_llm(model_dir, dtype="float32").generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    with RemoteServer(model_dir, [*TINY_SERVER_ARGS, "--tensor-parallel-size", "2"]) as server, server.client() as client:
        reply = client.completions.create(model=server.model, prompt=prompts[0], max_tokens=MAX_NEW_TOKENS,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert reply.choices[0].text == want[0].outputs[0].text
