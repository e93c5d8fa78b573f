"""Decode steps replayed from traces (worker/decode_graphs.py): the same tokens and logprobs as the
eager forward, bit for bit, for every batch size traced, with prefills, chunked prompts and
larger batches still eager around them; a failed trace leaves its size eager; enforce_eager and
non-decode steps never trace. (tests/engine/test_greedy_vs_hf.py's head_dim-64 llama checks the
traced path against transformers too.)"""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.attention.cpu_paged import CpuPagedMetadata, PagedRows
from minivllm.worker import decode_graphs
from minivllm.worker.decode_graphs import MAX_TRACED_ROWS, DecodeGraphs


@pytest.fixture(autouse=True)
def in_process(monkeypatch):
    monkeypatch.setenv("MINIVLLM_ENABLE_MULTIPROCESSING", "0")  # to reach the model runner


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.engine_core.model_executor.worker.model_runner


def _generate(llm: LLM) -> list:
    """Ten requests finishing one after another, so decode steps run every batch size from 10
    down to 1; one long prompt is chunked (max_num_batched_tokens) beside running decodes."""
    gen = torch.Generator().manual_seed(0)
    lengths = (5, 17, 200, 9, 33, 3, 64, 12, 1, 40)
    prompts = [{"prompt_token_ids": torch.randint(10, 40000, (n,), generator=gen).tolist()} for n in lengths]
    params = [SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True, logprobs=3)
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize(("arch", "dtype"), [("llama", "bfloat16"), ("llama", "float32"),
                                             ("qwen2", "bfloat16"), ("qwen3", "bfloat16")])
def test_traced_decode_equals_eager(make_tiny_model, arch, dtype):
    model_dir = str(make_tiny_model(arch, head_dim=64))  # head_dim 64: the CPU paged backend
    eager = _generate(LLM(model_dir, dtype=dtype, enforce_eager=True, max_num_batched_tokens=96))
    llm = LLM(model_dir, dtype=dtype, max_num_batched_tokens=96)
    traced = _generate(llm)
    assert traced == eager
    graphs = _runner(llm).forward.graphs
    assert sorted(graphs) == list(range(1, MAX_TRACED_ROWS + 1))
    assert all(isinstance(g, torch.jit.ScriptModule) for g in graphs.values())


def test_enforce_eager_runs_the_model(make_tiny_model):
    llm = LLM(str(make_tiny_model("llama", head_dim=64)), dtype="bfloat16", enforce_eager=True)
    runner = _runner(llm)
    assert runner.forward is runner.model


def test_failed_trace_leaves_the_size_eager(make_tiny_model, monkeypatch):
    model_dir = str(make_tiny_model("llama", head_dim=64))
    eager = _generate(LLM(model_dir, dtype="bfloat16", enforce_eager=True, max_num_batched_tokens=96))

    def broken_trace(*args, **kwargs):
        raise RuntimeError("cannot trace")

    monkeypatch.setattr(decode_graphs.torch.jit, "trace", broken_trace)
    llm = LLM(model_dir, dtype="bfloat16", max_num_batched_tokens=96)
    assert _generate(llm) == eager
    graphs = _runner(llm).forward.graphs
    assert sorted(graphs) == list(range(1, MAX_TRACED_ROWS + 1))
    assert all(g is None for g in graphs.values())  # tried once per size, then eager


def _metadata(num_decodes: int, num_prefills: int) -> CpuPagedMetadata:
    def rows(n: int) -> PagedRows:
        return PagedRows(torch.zeros(n, dtype=torch.int64), torch.ones(n, dtype=torch.int32),
                         torch.ones(n, dtype=torch.int32), torch.zeros(n, 1, dtype=torch.int32))
    return CpuPagedMetadata(torch.zeros(num_decodes + num_prefills, dtype=torch.int64),
                            rows(num_decodes), rows(num_prefills))


def test_only_small_decode_only_steps_are_traced():
    calls = []

    def model(input_ids, positions, attn_metadata):
        calls.append(input_ids.shape[0])
        return input_ids

    graphs = DecodeGraphs(model)
    graphs(torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long), _metadata(2, 1))
    graphs(torch.zeros(9, dtype=torch.long), torch.zeros(9, dtype=torch.long), _metadata(9, 0))
    graphs(torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long), None)
    assert graphs.graphs == {}  # mixed, too large, profiling run (no metadata): no trace tried
    assert calls == [3, 9, 4]
