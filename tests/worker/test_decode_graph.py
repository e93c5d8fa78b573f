"""Decode steps replayed from a trace (worker/decode_graph.py): the same tokens and logprobs as the
eager forward, bit for bit, for every batch size the one trace serves, with prefills, chunked
prompts and larger batches still eager around it; a failed trace leaves decoding eager;
enforce_eager, other steps and backends whose metadata cannot be replayed never trace; the trace
is recorded only after TRACE_AFTER_STEPS steps it could replay (0 here unless the test says)."""

from __future__ import annotations

import pytest
import torch
from engine_utils import model_runner
from torch import nn

from minivllm import LLM, SamplingParams
from minivllm.attention.backend import GraphSupport
from minivllm.model.layers.linear import Linear
from minivllm.model.layers.quant import Q4_1_MAX_ROWS, Q8_0_MAX_ROWS, Q4_1Tiles, Q8_0Weight
from minivllm.worker import decode_graph
from minivllm.worker.decode_graph import MAX_TRACED_ROWS, DecodeGraph, max_traced_rows
from minivllm.worker.graph_runner import BatchDescriptor


@pytest.fixture(autouse=True)
def in_process(monkeypatch):
    monkeypatch.setenv("MINIVLLM_ENABLE_MULTIPROCESSING", "0")  # to reach the model runner
    monkeypatch.setattr(decode_graph, "TRACE_AFTER_STEPS", 0)  # record at the first step it applies to


class _Counting:
    """A graph runner that records the sizes it replays, and those of every uniform decode step."""

    def __init__(self, graph_runner: DecodeGraph) -> None:
        self.graph_runner = graph_runner
        self.sizes: list[int] = []
        self.decode_sizes: set[int] = set()

    def dispatch(self, batch: BatchDescriptor) -> BatchDescriptor | None:
        if batch.uniform_decode:
            self.decode_sizes.add(batch.num_tokens)
        return self.graph_runner.dispatch(batch)

    def __call__(self, input_ids, positions, attn_metadata):
        self.sizes.append(input_ids.shape[0])
        return self.graph_runner(input_ids, positions, attn_metadata)


def _generate(llm: LLM) -> list:
    """Ten requests finishing one after another, so decode steps run every batch size from 10
    down to 1; one long prompt is chunked (max_num_batched_tokens) beside running decodes."""
    runner = model_runner(llm)
    graph_runner = runner.graph_runner
    if graph_runner is not None:
        runner.graph_runner = counting = _Counting(graph_runner)
    gen = torch.Generator().manual_seed(0)
    lengths = (5, 17, 200, 9, 33, 3, 64, 12, 1, 40)
    prompts = [{"prompt_token_ids": torch.randint(10, 40000, (n,), generator=gen).tolist()} for n in lengths]
    params = [SamplingParams(temperature=0, max_tokens=8 + 2 * i, ignore_eos=True, logprobs=3)
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    if graph_runner is not None:
        runner.graph_runner = graph_runner
        if graph_runner.graph is not None:  # every decode step up to the bound replayed (9 and 10 too)
            assert set(counting.sizes) == {n for n in counting.decode_sizes if n <= graph_runner.max_rows}
            assert max(counting.sizes) > 8
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def check_traced_equals_eager(make_llm, model_dir, dtype: str) -> None:
    eager = _generate(make_llm(model_dir, dtype=dtype, enforce_eager=True, max_num_batched_tokens=96))
    llm = make_llm(model_dir, dtype=dtype, max_num_batched_tokens=96)
    traced = _generate(llm)
    assert traced == eager
    assert isinstance(model_runner(llm).graph_runner.graph, torch.jit.ScriptModule)


@pytest.mark.parametrize(("arch", "dtype"), [("llama", "bfloat16"), ("llama", "float32"),
                                             ("qwen2", "bfloat16"), ("qwen3", "bfloat16")])
def test_traced_decode_equals_eager(make_tiny_model, make_llm, arch, dtype):
    # head_dim 64: the CPU paged backend
    check_traced_equals_eager(make_llm, make_tiny_model(arch, head_dim=64), dtype)


def test_traced_decode_equals_eager_smollm2(smollm2_gguf, make_llm):
    """Its Linears take their Q4_1 codes (up to Q4_1_MAX_ROWS rows) in the trace as eagerly."""
    check_traced_equals_eager(make_llm, smollm2_gguf, "bfloat16")


def test_enforce_eager_runs_the_model(make_tiny_model, make_llm):
    llm = make_llm(make_tiny_model("llama", head_dim=64), dtype="bfloat16", enforce_eager=True)
    assert model_runner(llm).graph_runner is None


def test_reference_backend_steps_stay_eager(make_tiny_model, make_llm):
    """head_dim 16: the torch reference backend, whose metadata is per-step Python structure; no
    step may replay a recording (GraphSupport.NEVER)."""
    llm = make_llm(make_tiny_model("llama"), dtype="float32")
    runner = model_runner(llm)
    assert runner.attn_backend.graph_support == GraphSupport.NEVER
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert not runner.graph_runner.traced


def test_failed_trace_leaves_the_size_eager(make_tiny_model, make_llm, monkeypatch):
    model_dir = str(make_tiny_model("llama", head_dim=64))
    eager = _generate(make_llm(model_dir, dtype="bfloat16", enforce_eager=True, max_num_batched_tokens=96))

    def broken_trace():
        raise RuntimeError("cannot trace")

    calls = []
    monkeypatch.setattr(decode_graph.torch.jit, "trace", lambda *a, **k: calls.append(1) or broken_trace())
    llm = make_llm(model_dir, dtype="bfloat16", max_num_batched_tokens=96)
    assert _generate(llm) == eager
    assert model_runner(llm).graph_runner.graph is None and calls == [1]  # tried once, then eager


def test_recorded_after_the_steps_it_would_have_saved(monkeypatch):
    """Steps that could replay run eagerly TRACE_AFTER_STEPS times; the next one records (the
    ski-rental rule); steps that could never replay do not count."""
    monkeypatch.setattr(decode_graph, "TRACE_AFTER_STEPS", 3)
    graph = DecodeGraph(model=nn.Module(), graph_support=GraphSupport.UNIFORM_SINGLE_TOKEN_DECODE)
    decode, mixed = BatchDescriptor(num_tokens=2, uniform_decode=True), BatchDescriptor(num_tokens=9, uniform_decode=False)
    assert [graph.dispatch(decode) for _ in range(3)] == [None] * 3
    assert graph.dispatch(mixed) is None and graph.num_eager_steps == 3
    assert graph.dispatch(decode) == decode  # unpadded: one trace replays every size
    graph.traced, graph.graph = True, None  # a failed recording: eager from then on
    assert graph.dispatch(decode) is None


def test_the_trace_stops_where_a_linear_changes_kernel():
    """A model whose Linears keep no codes traces up to MAX_TRACED_ROWS; one with codes up to the
    smallest of their bounds (Q8_0 and torch's int4: 8 rows; minivllm's Q4_1: Q4_1_MAX_ROWS)."""
    def linear_with(quantized) -> Linear:
        layer = Linear(32, 16)
        layer.quantized = quantized
        return layer

    q4_1 = Q4_1Tiles(torch.zeros(1, 1, 320, dtype=torch.uint8))
    q8_0 = Q8_0Weight(torch.zeros(16, 32, dtype=torch.int8), torch.zeros(16, 1, dtype=torch.float16))
    assert max_traced_rows(nn.Sequential(Linear(32, 16))) == MAX_TRACED_ROWS
    assert max_traced_rows(nn.Sequential(linear_with(q4_1))) == min(Q4_1_MAX_ROWS, MAX_TRACED_ROWS)
    assert max_traced_rows(nn.Sequential(linear_with(q4_1), linear_with(q8_0))) == Q8_0_MAX_ROWS
    graph = DecodeGraph(model=nn.Sequential(linear_with(q8_0)), graph_support=GraphSupport.UNIFORM_SINGLE_TOKEN_DECODE)
    assert graph.dispatch(BatchDescriptor(num_tokens=Q8_0_MAX_ROWS + 1, uniform_decode=True)) is None


def test_only_small_uniform_decode_steps_replay():
    graph = DecodeGraph(model=nn.Module(), graph_support=GraphSupport.UNIFORM_SINGLE_TOKEN_DECODE)
    for n in (1, MAX_TRACED_ROWS):
        assert graph.dispatch(BatchDescriptor(num_tokens=n, uniform_decode=True)).num_tokens == n
    assert graph.dispatch(BatchDescriptor(num_tokens=MAX_TRACED_ROWS + 1, uniform_decode=True)) is None
    assert graph.dispatch(BatchDescriptor(num_tokens=3, uniform_decode=False)) is None  # a prefill in it
    never = DecodeGraph(model=nn.Module(), graph_support=GraphSupport.NEVER)
    assert never.dispatch(BatchDescriptor(num_tokens=1, uniform_decode=True)) is None
