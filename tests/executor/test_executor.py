"""The executor seam: the engine core builds its executor only through Executor.get_class, the
uni executor's worker answers the V1 worker calls by name (collective_rpc), and combinations that
do not exist are refused before any engine starts."""

from __future__ import annotations

import pytest

from minivllm.config import ParallelConfig
from minivllm.core.kv_cache_interface import FullAttentionSpec
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.core import EngineCore, EngineCoreProc
from minivllm.executor.abstract import Executor
from minivllm.executor.uniproc_executor import UniProcExecutor


def _config(make_tiny_model):
    return EngineArgs(model=str(make_tiny_model("llama")), dtype="float32", kv_cache_memory_bytes=1 << 20,
                      max_model_len=256).create_engine_config()


@pytest.fixture(scope="module")
def engine_core(make_tiny_model):
    core = EngineCore(_config(make_tiny_model))
    yield core
    core.shutdown()


def test_get_class_picks_the_uni_executor(engine_core):
    assert Executor.get_class(engine_core.vllm_config) is UniProcExecutor
    assert type(engine_core.model_executor) is UniProcExecutor


def test_workers_answer_by_method_name(engine_core, make_tiny_model):
    """The tiny Llama: 2 layers, 2 KV heads of 16 dims, float32, blocks of 16 tokens."""
    executor = engine_core.model_executor
    [specs] = executor.get_kv_cache_specs()
    assert specs == {f"model.layers.{i}.self_attn.attn": FullAttentionSpec(16, 2, 16, "float32") for i in range(2)}
    assert executor.determine_available_memory() == [1 << 20]
    # 2 (K, V) * 16 tokens * 2 heads * 16 dims * 4 bytes = 4 KiB per layer and block, 2 layers.
    assert engine_core.vllm_config.cache_config.num_gpu_blocks == (1 << 20) // (2 * 4096)
    assert executor.collective_rpc("check_health") == [None]


@pytest.mark.parametrize(("fields", "backend"), [({}, "uni"), ({"tensor_parallel_size": 2}, "mp"),
                                               ({"distributed_executor_backend": "mp"}, "mp")])
def test_default_backend_follows_the_world_size(fields, backend):
    """vLLM's default: one worker in the engine process, worker processes for more."""
    assert ParallelConfig(**fields).distributed_executor_backend == backend


@pytest.mark.parametrize(("fields", "message"), [
    ({"distributed_executor_backend": "uni", "tensor_parallel_size": 2}, "'uni' runs one worker"),
    ({"distributed_executor_backend": "ray", "data_parallel_size": 2},
     "data_parallel_size > 1 with distributed_executor_backend='ray' is not supported yet"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1"),
])
def test_what_does_not_exist_is_refused_at_configuration(fields, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**fields)


def test_unknown_backend_refused():
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of uni, mp, ray, got 'gloo'"):
        ParallelConfig(distributed_executor_backend="gloo")


def test_idle_engine_checks_its_workers(make_tiny_model, monkeypatch):
    """An idle engine core wakes every second and asks the executor whether its workers live; a
    dead one ends the busy loop with the error (the front end then gets EngineDeadError)."""
    proc = EngineCoreProc(_config(make_tiny_model), "ipc://unused-input", "ipc://unused-output")

    def dead() -> None:
        raise RuntimeError("worker 0 died")

    monkeypatch.setattr(proc.model_executor, "check_health", dead)
    try:
        with pytest.raises(RuntimeError, match="worker 0 died"):
            proc._process_input_queue(parent_pid=None)
    finally:
        proc._ctx.term()  # its sockets were never opened
        EngineCore.shutdown(proc)
