"""Decode steps replayed from a trace (worker/decode_graph.py): the same tokens and logprobs as the
eager forward, bit for bit, for every batch size the one trace serves, with prefills, chunked
prompts and larger batches still eager around it; a failed trace leaves decoding eager;
enforce_eager and other steps never trace. (tests/engine/test_greedy_vs_hf.py's head_dim-64 llama
checks the traced path against transformers too.)"""

from __future__ import annotations

import pytest
import torch
from reference import smollm2_gguf_path

from minivllm import LLM, SamplingParams
from minivllm.attention.cpu_paged import CpuPagedMetadata, PagedRows
from minivllm.worker import decode_graph
from minivllm.worker.decode_graph import MAX_TRACED_ROWS, DecodeGraph


@pytest.fixture(autouse=True)
def in_process(monkeypatch):
    monkeypatch.setenv("MINIVLLM_ENABLE_MULTIPROCESSING", "0")  # to reach the model runner


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.engine_core.model_executor.worker.model_runner


def _generate(llm: LLM) -> list:
    """Ten requests finishing one after another, so decode steps run every batch size from 10
    down to 1; one long prompt is chunked (max_num_batched_tokens) beside running decodes."""
    sizes = []
    runner = _runner(llm)
    forward = runner.forward

    def counting(input_ids, positions, attn_metadata, logits_indices=None):
        if decode_graph._decode_only(attn_metadata, input_ids.shape[0]):
            sizes.append(input_ids.shape[0])
        return forward(input_ids, positions, attn_metadata, logits_indices)

    runner.forward = counting
    gen = torch.Generator().manual_seed(0)
    lengths = (5, 17, 200, 9, 33, 3, 64, 12, 1, 40)
    prompts = [{"prompt_token_ids": torch.randint(10, 40000, (n,), generator=gen).tolist()} for n in lengths]
    params = [SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True, logprobs=3)
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    runner.forward = forward
    if not runner.model_config.enforce_eager:  # the replayed steps took every size up to the bound
        assert set(sizes) == set(range(1, MAX_TRACED_ROWS + 1))
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize(("arch", "dtype"), [("llama", "bfloat16"), ("llama", "float32"),
                                             ("qwen2", "bfloat16"), ("qwen3", "bfloat16"),
                                             ("smollm2-gguf", "bfloat16")])
def test_traced_decode_equals_eager(make_tiny_model, arch, dtype):
    """The real SmolLM2 GGUF too: its Linears pick Q4_1 codes up to 8 rows, the dense weights above."""
    if arch == "smollm2-gguf":
        model_dir = str(smollm2_gguf_path())
    else:
        model_dir = str(make_tiny_model(arch, head_dim=64))  # head_dim 64: the CPU paged backend
    eager = _generate(LLM(model_dir, dtype=dtype, enforce_eager=True, max_num_batched_tokens=96))
    llm = LLM(model_dir, dtype=dtype, max_num_batched_tokens=96)
    traced = _generate(llm)
    assert traced == eager
    assert isinstance(_runner(llm).forward.graph, torch.jit.ScriptModule)


def test_enforce_eager_runs_the_model(make_tiny_model):
    llm = LLM(str(make_tiny_model("llama", head_dim=64)), dtype="bfloat16", enforce_eager=True)
    runner = _runner(llm)
    assert runner.forward is runner.model


def test_failed_trace_leaves_the_size_eager(make_tiny_model, monkeypatch):
    model_dir = str(make_tiny_model("llama", head_dim=64))
    eager = _generate(LLM(model_dir, dtype="bfloat16", enforce_eager=True, max_num_batched_tokens=96))

    def broken_trace():
        raise RuntimeError("cannot trace")

    calls = []
    monkeypatch.setattr(decode_graph.torch.jit, "trace", lambda *a, **k: calls.append(1) or broken_trace())
    llm = LLM(model_dir, dtype="bfloat16", max_num_batched_tokens=96)
    assert _generate(llm) == eager
    assert _runner(llm).forward.graph is None and calls == [1]  # tried once, then eager


def _metadata(num_decodes: int, num_prefills: int) -> CpuPagedMetadata:
    def rows(n: int) -> PagedRows:
        return PagedRows(torch.zeros(n, dtype=torch.int64), torch.ones(n, dtype=torch.int32),
                         torch.ones(n, dtype=torch.int32), torch.zeros(n, 1, dtype=torch.int32))
    return CpuPagedMetadata(torch.zeros(num_decodes + num_prefills, dtype=torch.int64),
                            rows(num_decodes), rows(num_prefills))


def test_only_small_decode_only_steps_are_traced():
    calls = []

    def model(input_ids, positions, attn_metadata, logits_indices=None):
        calls.append(input_ids.shape[0])
        return input_ids

    graph = DecodeGraph(model)
    graph(torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long), _metadata(2, 1))
    n = MAX_TRACED_ROWS + 1
    graph(torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long), _metadata(n, 0))
    graph(torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long), None)
    assert not graph.traced  # mixed, too large, profiling run (no metadata): no trace tried
    assert calls == [3, n, 4]
