"""The engine core in its own process: same outputs as in-process, streaming and abort through
AsyncLLM, prompt EngineDeadError when the process dies, and nothing left behind after close."""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from reference import build_tiny_model

from minivllm import (
    LLM,
    AsyncEngineArgs,
    AsyncLLM,
    EngineDeadError,
    RequestOutputKind,
    SamplingParams,
)
from minivllm.engine import core_client, llm_engine
from minivllm.engine.arg_utils import EngineArgs

PROMPTS = [[5, 6, 7], list(range(100, 140)), [9] * 17, list(range(300, 400))]


@pytest.fixture(scope="module")
def model(make_tiny_model) -> str:
    return str(make_tiny_model("llama"))


@pytest.fixture(scope="module")
def inproc_llm(model, make_module_llm) -> LLM:
    """The reference: the same engine with its core in this process. Greedy or seeded requests
    only, so what earlier tests ran through it changes nothing."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MINIVLLM_ENABLE_MULTIPROCESSING", "0")
        return make_module_llm(model, dtype="float32")


def greedy(n: int = 12, **kw) -> SamplingParams:
    """Greedy, streaming deltas (what `collect` concatenates)."""
    return SamplingParams(**{"temperature": 0.0, "max_tokens": n, "ignore_eos": True,
                             "output_kind": RequestOutputKind.DELTA, **kw})


def pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone for our purposes once its parent reaped it.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def test_multiprocess_outputs_equal_inprocess(model, inproc_llm, make_llm, monkeypatch):
    monkeypatch.setenv("MINIVLLM_ENABLE_MULTIPROCESSING", "1")
    mp = make_llm(model, dtype="float32")
    assert mp.llm_engine.engine_core.resources.engine.poll() is None  # a real child process
    params = greedy(16, logprobs=2)
    a = mp.generate(PROMPTS, params, use_tqdm=False)
    b = inproc_llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert [o.outputs[0].text for o in a] == [o.outputs[0].text for o in b]
    for x, y in zip(a, b, strict=True):
        for px, py in zip(x.outputs[0].logprobs, y.outputs[0].logprobs, strict=True):
            assert px.keys() == py.keys()
    assert mp.llm_engine.get_scheduler_stats().num_running_reqs == 0


@pytest.fixture
def async_llm(model, monkeypatch):
    monkeypatch.setenv("MINIVLLM_ENABLE_MULTIPROCESSING", "1")
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model, dtype="float32"))
    yield engine
    engine.shutdown()


async def collect(engine: AsyncLLM, request_id: str, prompt, params) -> tuple[str, list[int], str]:
    text, ids, final = "", [], ""
    async for out in engine.generate(prompt, params, request_id):
        text += out.outputs[0].text
        ids += out.outputs[0].token_ids
        if out.finished:
            final = out.outputs[0].finish_reason
    return text, ids, final


def test_many_concurrent_streams(inproc_llm, async_llm):
    prompts = [[7 + i, 8, 9 + i % 5] + list(range(i * 3)) for i in range(64)]
    lengths = [3 + (i * 7) % 40 for i in range(64)]
    expected = inproc_llm.generate(prompts, [greedy(n) for n in lengths], use_tqdm=False)

    async def main():
        return await asyncio.gather(*(
            collect(async_llm, f"req-{i}", p, greedy(n))
            for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
        ))

    results = asyncio.run(main())
    for (text, ids, reason), out in zip(results, expected, strict=True):
        assert ids == out.outputs[0].token_ids and text == out.outputs[0].text and reason == "length"


def test_cancelling_streams_aborts_them_in_the_engine(async_llm):
    async def main():
        idle = await async_llm.get_scheduler_stats()
        tasks = [
            asyncio.create_task(collect(async_llm, f"c{i}", PROMPTS[i % 4], greedy(300 if i % 2 else 20)))
            for i in range(16)
        ]
        await asyncio.sleep(0.3)
        for task in tasks[1::2]:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for _ in range(50):  # the aborts travel to the engine process
            stats = await async_llm.get_scheduler_stats()
            if stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0:
                break
            await asyncio.sleep(0.05)
        return idle, results, stats

    idle, results, stats = asyncio.run(main())
    assert all(isinstance(r, asyncio.CancelledError) for r in results[1::2])
    assert all(len(r[1]) == 20 for r in results[0::2])
    assert stats.num_running_reqs == idle.num_running_reqs == 0 and stats.num_waiting_reqs == 0
    assert stats.kv_cache_usage == idle.kv_cache_usage == 0.0


def test_abort_by_id(async_llm):
    async def main():
        gen = async_llm.generate(PROMPTS[1], greedy(500), "to-abort")
        first = await gen.__anext__()
        await async_llm.abort("to-abort")
        await gen.aclose()
        return first, await async_llm.get_scheduler_stats()

    first, stats = asyncio.run(main())
    assert not first.finished and stats.num_running_reqs == 0


def sampled(n: int, seed: int, **kw) -> SamplingParams:
    return SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=10, ignore_eos=True, **kw)


def test_fan_out_and_duplicate_ids_in_both_engines(model, inproc_llm, make_llm, monkeypatch):
    """n = 3 with seed s gives the samples of three n = 1 requests seeded s, s+1, s+2, through
    LLMEngine and AsyncLLM alike; the id of a request in flight is refused and changes nothing."""
    expected = [o.outputs[0].token_ids
                for o in inproc_llm.generate([PROMPTS[1]] * 3, [sampled(1, 7 + i) for i in range(3)], use_tqdm=False)]
    monkeypatch.setenv("MINIVLLM_ENABLE_MULTIPROCESSING", "1")

    engine = make_llm(model, dtype="float32").llm_engine
    engine.add_request("a", PROMPTS[1], sampled(3, 7, output_kind=RequestOutputKind.FINAL_ONLY))
    with pytest.raises(ValueError, match="'a' is already in the engine"):
        engine.add_request("a", PROMPTS[0], sampled(1, 0))
    finals = []
    while engine.has_unfinished_requests():
        finals += engine.step()
    assert [o.request_id for o in finals] == ["a"]
    assert [c.token_ids for c in finals[0].outputs] == expected
    engine.shutdown()

    async def run_async(llm: AsyncLLM) -> dict[int, list[int]]:
        queue = await llm.add_request("a", PROMPTS[1], sampled(3, 7, output_kind=RequestOutputKind.DELTA))
        with pytest.raises(ValueError, match="'a' is already in the engine"):
            await llm.add_request("a", PROMPTS[0], sampled(1, 0))
        streamed: dict[int, list[int]] = {0: [], 1: [], 2: []}
        async for out in llm.stream_outputs("a", queue):
            for completion in out.outputs:
                streamed[completion.index] += completion.token_ids
        return streamed

    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model, dtype="float32"))
    try:
        assert list(asyncio.run(run_async(llm)).values()) == expected
    finally:
        llm.shutdown()


def test_stop_string_abort_reaches_the_core_before_the_id_is_reused(model, inproc_llm, make_llm, monkeypatch):
    """A request finished by a stop string is still running in the engine core, which must hear
    of its abort before anything its caller sends next: re-adding the same id at once (a second
    ADD before the ABORT would kill the engine core) runs again, to the same text."""
    full = inproc_llm.generate(PROMPTS[1], greedy(40), use_tqdm=False)[0].outputs[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    params = greedy(200, stop=[stop])
    expected = full[: full.index(stop)]
    monkeypatch.setenv("MINIVLLM_ENABLE_MULTIPROCESSING", "1")

    engine = make_llm(model, dtype="float32").llm_engine
    texts = []
    for _ in range(2):
        engine.add_request("s", PROMPTS[1], params)
        text = ""
        while engine.has_unfinished_requests():
            for out in engine.step():
                text += out.outputs[0].text
        texts.append(text)
    assert texts == [expected, expected]
    stats = engine.get_scheduler_stats()
    assert stats.num_running_reqs == stats.num_waiting_reqs == 0 and stats.kv_cache_usage == 0.0
    engine.shutdown()

    async def run_async(llm: AsyncLLM) -> tuple[list[str], float]:
        results = []
        for _ in range(2):
            text, _, reason = await collect(llm, "s", PROMPTS[1], params)
            assert reason == "stop"
            results.append(text)
        for _ in range(50):  # the aborts travel to the engine process
            stats = await llm.get_scheduler_stats()
            if stats.num_running_reqs == 0:
                break
            await asyncio.sleep(0.05)
        return results, stats.kv_cache_usage

    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model, dtype="float32"))
    try:
        assert asyncio.run(run_async(llm)) == ([expected, expected], 0.0)
    finally:
        llm.shutdown()


def test_engine_death_fails_every_caller_fast(async_llm):
    async def main():
        tasks = [asyncio.create_task(collect(async_llm, f"k{i}", PROMPTS[i % 4], greedy(800))) for i in range(6)]
        await asyncio.sleep(0.5)
        os.kill(async_llm.engine_core.resources.engine.pid, signal.SIGKILL)
        start = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=10)
        elapsed = time.monotonic() - start
        with pytest.raises(EngineDeadError):
            await collect(async_llm, "late", PROMPTS[0], greedy())
        return results, elapsed

    results, elapsed = asyncio.run(main())
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert elapsed < 5
    with pytest.raises(EngineDeadError):
        async_llm.check_health()


def test_close_leaves_no_process_or_socket(model, make_llm, monkeypatch):
    monkeypatch.setenv("MINIVLLM_ENABLE_MULTIPROCESSING", "1")
    llm = make_llm(model, dtype="float32")
    llm.generate(PROMPTS[:1], greedy(), use_tqdm=False)
    resources = llm.llm_engine.engine_core.resources
    pid, tmpdir = resources.engine.pid, resources.tmpdir
    assert os.path.exists(os.path.join(tmpdir, "input"))
    llm.llm_engine.shutdown()
    assert not pid_exists(pid) and not os.path.exists(tmpdir)


def test_startup_error_in_the_engine_is_reported(tmp_path, tokenizer_dir, make_llm, monkeypatch):
    """The model fails to build inside the engine process: the caller gets its error, at once."""
    monkeypatch.setenv("MINIVLLM_ENABLE_MULTIPROCESSING", "1")
    bad = build_tiny_model(tmp_path / "bad", "llama", tokenizer_dir,
                           rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 512})
    with pytest.raises(ValueError, match="rope_type 'yarn' is not supported"):
        make_llm(bad, dtype="float32")


def test_config_error_ends_the_prestarted_engine_interpreter(model, make_llm, monkeypatch):
    """The engine's interpreter starts before the model's config is read; a setting that config
    refuses is the caller's ValueError, and that interpreter is stopped before the error is
    raised (no orphan)."""
    monkeypatch.setenv("MINIVLLM_ENABLE_MULTIPROCESSING", "1")
    started = []

    def start(**kwargs):
        started.append(core_client.start_engine_interpreter(**kwargs))
        return started[-1]

    monkeypatch.setattr(llm_engine, "start_engine_interpreter", start)
    with pytest.raises(ValueError, match="larger than the model's maximum context length of 1024"):
        make_llm(model, dtype="float32", max_model_len=5000)
    assert len(started) == 1
    assert started[0].poll() is not None


def test_engine_interpreter_runs_the_front_ends_package_from_any_directory(tmp_path, monkeypatch):
    """Started from a directory holding another `minivllm` (a second checkout), the engine's
    interpreter still imports this one. With `python -m`, the working directory came first on
    sys.path: the other package ran."""
    fake = tmp_path / "minivllm"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise SystemExit(17)\n")
    monkeypatch.chdir(tmp_path)
    process = core_client.start_engine_interpreter()
    process.stdin.close()  # no config: a real engine's interpreter exits cleanly
    assert process.wait(timeout=60) == 0


def test_in_thread_engine_for_debugging(model, monkeypatch):
    monkeypatch.setenv("MINIVLLM_ENABLE_MULTIPROCESSING", "0")
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model, dtype="float32"))
    try:
        text, ids, reason = asyncio.run(collect(engine, "t", PROMPTS[0], greedy(6)))
        assert len(ids) == 6 and reason == "length"
    finally:
        engine.shutdown()


@pytest.mark.parametrize("how", ["sigint", "sigkill"])
def test_no_orphan_when_the_front_end_goes(model, how):
    """Ctrl-C in the user's script shuts the engine down; a killed front end's engine exits too."""
    script = textwrap.dedent(f"""
        import signal, time
        # Ctrl-C as in a terminal, even when the suite runs with SIGINT ignored (a shell's
        # background job inherits that, and so would this script).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from minivllm import LLM
        llm = LLM({model!r}, dtype="float32")
        resources = llm.llm_engine.engine_core.resources
        print(resources.engine.pid, resources.tmpdir, flush=True)
        time.sleep(60)
    """)
    env = {**os.environ, "MINIVLLM_ENABLE_MULTIPROCESSING": "1"}
    front = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env, text=True)
    pid_text, tmpdir = front.stdout.readline().split()
    engine_pid = int(pid_text)
    assert pid_exists(engine_pid)
    front.send_signal(signal.SIGINT if how == "sigint" else signal.SIGKILL)
    front.wait(timeout=30)
    deadline = time.monotonic() + 15
    while pid_exists(engine_pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not pid_exists(engine_pid)
    assert not os.path.exists(tmpdir)  # no socket file left behind either


def test_front_end_builds_a_gguf_model_without_torch():
    """For the default GGUF model, the front end's config and tokenizer import no torch (~1.3 s),
    and the engine process unpickles that config without importing transformers (~2 s of its
    config classes): each in a fresh interpreter."""
    front_end = textwrap.dedent("""
        import pickle, sys
        from minivllm.engine.arg_utils import EngineArgs
        from minivllm.transformers_utils.tokenizer import get_tokenizer
        config = EngineArgs().create_engine_config()
        tokenizer = get_tokenizer(config.model_config.tokenizer)
        assert tokenizer.encode("The capital of France is")
        assert "torch" not in sys.modules, "torch imported"
        sys.stdout.buffer.write(pickle.dumps(config))
    """)
    done = subprocess.run([sys.executable, "-c", front_end], capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()
    engine = textwrap.dedent("""
        import pickle, sys
        config = pickle.load(sys.stdin.buffer)
        print(config.model_config.hf_config.num_hidden_layers, "transformers" in sys.modules)
    """)
    done = subprocess.run([sys.executable, "-c", engine], input=done.stdout, capture_output=True, timeout=120)
    assert done.stdout.decode().split() == ["30", "False"], done.stderr.decode()


def test_engine_interpreter_has_config_classes_before_the_config_comes(make_tiny_model):
    """For an HF directory the engine's interpreter imports transformers' config classes while the
    front end reads the config: unpickling a config of each supported architecture then imports
    nothing more from transformers (the import that took ~2 s after the config arrived)."""
    configs = [EngineArgs(model=str(make_tiny_model(arch)), dtype="float32").create_engine_config()
               for arch in ("llama", "qwen2", "qwen3")]
    script = textwrap.dedent("""
        import pickle, sys
        from minivllm.transformers_utils.config import import_config_classes
        import_config_classes()
        before = set(sys.modules)
        configs = pickle.load(sys.stdin.buffer)
        print(len(configs), sorted(m for m in set(sys.modules) - before if m.startswith("transformers")))
    """)
    done = subprocess.run([sys.executable, "-c", script], input=pickle.dumps(configs),
                          capture_output=True, timeout=120, check=True)
    assert done.stdout.decode().split(maxsplit=1) == ["3", "[]\n"]

