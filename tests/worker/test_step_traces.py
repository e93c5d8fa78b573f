"""Steps replayed from traces (worker/step_traces.py): the same tokens and logprobs as the eager
forward, bit for bit, for every kind of step (decodes, prompts, chunks beside decodes, pruned or
not), each kind from its own trace at every size, on either side of a GGUF model's row bounds;
a failed trace leaves its kind eager; enforce_eager, backends whose metadata cannot be replayed
and Linears that choose their weight in Python never trace; a kind's trace is recorded only
after TRACE_AFTER_STEPS steps of it (0 here unless the test says)."""

from __future__ import annotations

import pytest
import torch
from engine_utils import model_runner
from torch import nn

from minivllm import LLM, SamplingParams
from minivllm.attention.backend import GraphSupport
from minivllm.model.layers.linear import Linear
from minivllm.model.layers.quant import Q4_1_MAX_ROWS, Q4_1Tiles
from minivllm.worker import step_traces
from minivllm.worker.graph_runner import BatchDescriptor
from minivllm.worker.step_traces import StepTraces, TraceKey


@pytest.fixture(autouse=True)
def in_process(monkeypatch):
    monkeypatch.setenv("MINIVLLM_ENABLE_MULTIPROCESSING", "0")  # to reach the model runner
    monkeypatch.setattr(step_traces, "TRACE_AFTER_STEPS", 0)  # record at the first step of a kind


class _Counting:
    """A graph runner that counts the steps it was asked about and the kinds it replayed."""

    def __init__(self, graph_runner: StepTraces) -> None:
        self.graph_runner = graph_runner
        self.num_steps = 0
        self.replayed: list[TraceKey] = []
        self.rows: list[tuple[TraceKey, int]] = []  # a replayed step's kind and tokens

    def dispatch(self, batch: BatchDescriptor) -> BatchDescriptor | None:
        self.num_steps += 1
        return self.graph_runner.dispatch(batch)

    def __call__(self, batch, input_ids, positions, attn_metadata, kept_rows):
        assert input_ids.shape[0] == batch.num_tokens  # unpadded
        assert (kept_rows is None) == (batch.num_kept_rows is None)
        self.replayed.append(self.graph_runner.key(batch))
        self.rows.append((self.replayed[-1], batch.num_tokens))
        return self.graph_runner(batch, input_ids, positions, attn_metadata, kept_rows)


def _generate(llm: LLM) -> tuple[list, _Counting | None]:
    """Ten requests finishing one after another, so decode steps run every batch size from 10
    down to 1; prompts chunked (max_num_batched_tokens) beside running decodes; one request asks
    for prompt logprobs, which keeps the steps it is in unpruned. Returns the outputs and what
    the graph runner was asked and replayed."""
    runner = model_runner(llm)
    graph_runner = runner.graph_runner
    counting = None
    if graph_runner is not None:
        runner.graph_runner = counting = _Counting(graph_runner)
    gen = torch.Generator().manual_seed(0)
    lengths = (5, 17, 200, 9, 33, 3, 64, 12, 1, 40)
    prompts = [{"prompt_token_ids": torch.randint(10, 40000, (n,), generator=gen).tolist()} for n in lengths]
    params = [SamplingParams(temperature=0, max_tokens=8 + 2 * i, ignore_eos=True, logprobs=3,
                             prompt_logprobs=2 if i == 4 else None) for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    runner.graph_runner = graph_runner
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outs], counting


KINDS = {TraceKey(uniform_decode=True, pruned=False), TraceKey(False, True), TraceKey(False, False)}


def check_traced_equals_eager(make_llm, model_dir, dtype: str) -> _Counting:
    """Every step replayed, each kind from its own trace; returns what was replayed."""
    eager, _ = _generate(make_llm(model_dir, dtype=dtype, enforce_eager=True, max_num_batched_tokens=96))
    llm = make_llm(model_dir, dtype=dtype, max_num_batched_tokens=96)
    traced, counting = _generate(llm)
    assert traced == eager
    assert counting is not None and len(counting.replayed) == counting.num_steps
    traces = model_runner(llm).graph_runner.traces
    assert set(traces) == set(counting.replayed)
    assert all(isinstance(t, torch.jit.ScriptModule) for t in traces.values())
    assert set(traces) == KINDS
    return counting


@pytest.mark.parametrize(("arch", "dtype"), [("llama", "bfloat16"), ("llama", "float32"),
                                             ("qwen2", "bfloat16"), ("qwen3", "bfloat16"),
                                             ("gemma3", "bfloat16")])
def test_traced_steps_equal_eager(make_tiny_model, make_llm, arch, dtype):
    # head_dim 64: the CPU paged backend. Gemma 3's sliding window layers are a second KV
    # cache group: two metadata in each trace's arguments.
    check_traced_equals_eager(make_llm, make_tiny_model(arch, head_dim=64), dtype)


def test_traced_steps_equal_eager_smollm2(smollm2_gguf, make_llm):
    """Its Linears take their Q4_1 codes up to Q4_1_MAX_ROWS rows and the dequantized matrix
    past them, choosing inside one op: a trace of steps with prompt tokens recorded on one side
    of the bound replays the other side as the eager forward does."""
    counting = check_traced_equals_eager(make_llm, smollm2_gguf, "bfloat16")
    mixed_rows = {tokens for key, tokens in counting.rows if not key.uniform_decode}
    assert min(mixed_rows) <= Q4_1_MAX_ROWS < max(mixed_rows)


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
    assert not runner.graph_runner.traces and not runner.graph_runner.num_eager_steps


def test_failed_trace_leaves_its_kind_eager(make_tiny_model, make_llm, monkeypatch):
    model_dir = str(make_tiny_model("llama", head_dim=64))
    eager, _ = _generate(make_llm(model_dir, dtype="bfloat16", enforce_eager=True, max_num_batched_tokens=96))

    def broken_trace():
        raise RuntimeError("cannot trace")

    calls = []
    monkeypatch.setattr(step_traces.torch.jit, "trace", lambda *a, **k: calls.append(1) or broken_trace())
    llm = make_llm(model_dir, dtype="bfloat16", max_num_batched_tokens=96)
    outputs, counting = _generate(llm)
    assert outputs == eager
    traces = model_runner(llm).graph_runner.traces
    assert len(traces) == 3 and all(t is None for t in traces.values())
    assert len(calls) == 3 == len(counting.replayed)  # tried once a kind, then eager


def test_recorded_after_the_steps_it_would_have_saved(monkeypatch):
    """Steps of a kind run eagerly TRACE_AFTER_STEPS times; the next one records (the ski-rental
    rule), each kind counted on its own; steps that could never replay do not count."""
    monkeypatch.setattr(step_traces, "TRACE_AFTER_STEPS", 3)
    traces = StepTraces(model=nn.Module(), graph_support=GraphSupport.UNIFORM_SINGLE_TOKEN_DECODE)
    decode, other_decode = BatchDescriptor(2, True), BatchDescriptor(7, True)
    mixed = BatchDescriptor(9, False, num_kept_rows=2)
    assert [traces.dispatch(decode) for _ in range(3)] == [None] * 3
    assert traces.dispatch(mixed) is None and traces.num_eager_steps == {TraceKey(True, False): 3}
    assert traces.dispatch(other_decode) == other_decode  # the same kind: unpadded, at any size
    traces.traces[TraceKey(True, False)] = None  # a failed recording: eager from then on
    assert traces.dispatch(decode) is None

    always = StepTraces(model=nn.Module(), graph_support=GraphSupport.ALWAYS)
    unpruned = BatchDescriptor(9, False)
    assert [always.dispatch(mixed) for _ in range(3)] + [always.dispatch(unpruned)] == [None] * 4
    assert always.dispatch(mixed) == mixed and always.dispatch(unpruned) is None
    assert always.num_eager_steps == {TraceKey(False, True): 4, TraceKey(False, False): 2}


Q4_1 = Q4_1Tiles(torch.zeros(1, 1, 320, dtype=torch.uint8))


def _linear_with(quantized, rows_choice_in_op: bool) -> Linear:
    layer = Linear(32, 16)
    layer.quantized, layer.rows_choice_in_op = quantized, rows_choice_in_op
    return layer


def test_a_kind_is_what_the_forward_decides():
    """Rows decide nothing a trace fixes (GGUF Linears choose inside their op): a kind is
    whether the step is a uniform decode and whether its last layer is pruned."""
    traces = StepTraces(nn.Sequential(_linear_with(Q4_1, True), Linear(32, 16)), GraphSupport.ALWAYS)
    key = traces.key
    assert key(BatchDescriptor(1, True)) == key(BatchDescriptor(Q4_1_MAX_ROWS + 1, True)) == TraceKey(True, False)
    assert key(BatchDescriptor(500, False, num_kept_rows=3)) == key(BatchDescriptor(20, False, num_kept_rows=0)) \
        == key(BatchDescriptor(20, False, num_kept_rows=20)) == TraceKey(False, True)  # 0: nobody samples
    assert key(BatchDescriptor(20, False)) == TraceKey(False, False)


def test_linears_choosing_in_python_are_never_traced():
    """Without the C++ kernels a GGUF Linear picks its weight in Python, which a trace would fix
    to the branch it was recorded on: such a model runs every step eagerly."""
    traces = StepTraces(nn.Sequential(_linear_with(Q4_1, False)), GraphSupport.ALWAYS)
    assert traces.key(BatchDescriptor(1, True)) is None
    assert traces.dispatch(BatchDescriptor(1, True)) is None and not traces.num_eager_steps


def test_mixed_steps_replay_only_where_the_backend_says():
    """A backend whose metadata is tensors for uniform decode steps only (Triton's) keeps every
    other step eager; one whose metadata is never tensors (the reference) keeps them all."""
    decode_only = StepTraces(nn.Module(), GraphSupport.UNIFORM_SINGLE_TOKEN_DECODE)
    assert decode_only.key(BatchDescriptor(64, True)) == TraceKey(True, False)
    assert decode_only.key(BatchDescriptor(3, False, num_kept_rows=1)) is None
    never = StepTraces(nn.Module(), GraphSupport.NEVER)
    assert never.key(BatchDescriptor(1, True)) is None and never.dispatch(BatchDescriptor(1, True)) is None
