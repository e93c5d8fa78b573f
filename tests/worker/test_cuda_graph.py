"""CUDA graphs' dispatch and padding (worker/cuda_graph.py, the model runner's padded inputs),
checked without a GPU: a stand-in for CUDA graphs "replays" a recording by running the model
again on the tensors it recorded, as a graph reads the memory it recorded. So a step whose
inputs were not where the recording reads them would compute on stale inputs, and a padded
request that wrote or read anything would change the tokens. The engine runs the Triton
backend (under the interpreter here; compiled where there is CUDA)."""

from __future__ import annotations

import argparse

import pytest
import torch
from engine_utils import model_runner
from triton_interpret import DEVICE  # before any kernel is defined

from minivllm import LLM, SamplingParams
from minivllm.attention.backend import GraphSupport
from minivllm.config import default_capture_sizes
from minivllm.engine.arg_utils import EngineArgs
from minivllm.platforms.cpu import CpuPlatform
from minivllm.worker import cuda_graph
from minivllm.worker.cuda_graph import CudaGraphRunner
from minivllm.worker.graph_runner import BatchDescriptor, tensors_of

pytest.importorskip("triton")

CAPTURE_SIZES = (1, 2, 4, 8)


class _Rerun:
    """CUDA graphs' stand-in: replay runs the recorded forward again, on its recorded inputs,
    into its recorded output."""

    def memory_free(self) -> int:
        return 0

    def record(self, forward):
        output = forward()
        return (lambda: output.copy_(forward())), output


class _Checking:
    """The graph runner, checking that every replay finds its inputs in the buffers it recorded
    (nothing copied in), and counting the sizes replayed."""

    def __init__(self, graph_runner: CudaGraphRunner) -> None:
        self.graph_runner = graph_runner
        self.sizes: list[int] = []

    def dispatch(self, batch):
        return self.graph_runner.dispatch(batch)

    def __call__(self, batch, input_ids, positions, attn_metadata, kept_rows):
        recording = self.graph_runner.recordings[batch.num_tokens]
        given = [input_ids, positions, *tensors_of(attn_metadata)]
        assert [t.data_ptr() for t in given] == [t.data_ptr() for t in recording.inputs]
        self.sizes.append(input_ids.shape[0])
        return self.graph_runner(batch, input_ids, positions, attn_metadata, kept_rows)


def test_a_decode_step_replays_the_smallest_recorded_size_at_least_its_own():
    runner = CudaGraphRunner(model=None, graph_support=GraphSupport.UNIFORM_SINGLE_TOKEN_DECODE,
                             capture_sizes=CAPTURE_SIZES)
    padded = [runner.dispatch(BatchDescriptor(n, uniform_decode=True)) for n in range(1, 10)]
    assert [b.num_tokens if b else None for b in padded] == [1, 2, 4, 4, 8, 8, 8, 8, None]
    assert runner.dispatch(BatchDescriptor(3, uniform_decode=False)) is None  # a prompt in it
    never = CudaGraphRunner(model=None, graph_support=GraphSupport.NEVER, capture_sizes=CAPTURE_SIZES)
    assert never.dispatch(BatchDescriptor(1, uniform_decode=True)) is None


def test_capture_sizes():
    """vLLM's defaults (1, 2, 4, then every 8 to 256, every 16 after), up to the largest decode
    step, which is always one of them; given sizes sorted; sizes no step reaches refused."""
    assert default_capture_sizes(256) == (1, 2, 4, *range(8, 257, 8))
    assert default_capture_sizes(300) == (1, 2, 4, *range(8, 257, 8), 272, 288, 300)
    assert default_capture_sizes(20) == (1, 2, 4, 8, 16, 20)
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["--cudagraph-capture-sizes", "4", "1", "2", "2"]))
    assert args._create_compilation_config().cudagraph_capture_sizes == (1, 2, 4)
    with pytest.raises(ValueError, match="cudagraph_capture_sizes: 64 is over"):
        EngineArgs(model="smollm2-135m-instruct", max_num_seqs=32, cudagraph_capture_sizes=[8, 64])
    with pytest.raises(ValueError, match="cudagraph_capture_sizes: 32 is over"):
        EngineArgs(model="smollm2-135m-instruct", cudagraph_capture_sizes=[32])._create_compilation_config(max_num_batched_tokens=16)


def _generate(llm: LLM) -> list:
    """Seven requests finishing one after another (decode steps of 7 down to 1 requests), one
    prompt chunked beside running decodes."""
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(10, 1000, (n,), generator=gen).tolist()}
               for n in (5, 40, 3, 17, 9, 1, 12)]
    params = [SamplingParams(temperature=0, max_tokens=2 + 2 * i, ignore_eos=True, logprobs=2)
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def test_padded_replays_give_the_eager_tokens(make_tiny_model, make_llm, monkeypatch):
    monkeypatch.setenv("MINIVLLM_ENABLE_MULTIPROCESSING", "0")  # to reach the model runner
    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "TRITON_ATTN")
    if DEVICE == "cpu":
        monkeypatch.setattr(CpuPlatform, "graph_runner_qualname", lambda self: "minivllm.worker.cuda_graph.CudaGraphRunner")
        monkeypatch.setattr(cuda_graph, "CudaGraphs", _Rerun)
    model_dir = make_tiny_model("llama")
    common = dict(dtype="float32", device=DEVICE, max_num_batched_tokens=24, max_num_seqs=8)
    eager = _generate(make_llm(model_dir, enforce_eager=True, **common))
    llm = make_llm(model_dir, cudagraph_capture_sizes=list(CAPTURE_SIZES), **common)
    runner = model_runner(llm)
    assert sorted(runner.graph_runner.recordings) == list(CAPTURE_SIZES)
    runner.graph_runner = checking = _Checking(runner.graph_runner)
    replayed = _generate(llm)
    # The same tokens; logprobs to float32 rounding (a padded batch's matmuls may sum in
    # another order).
    assert [tokens for tokens, _ in replayed] == [tokens for tokens, _ in eager]
    for (_, logprobs), (_, expected) in zip(replayed, eager, strict=True):
        for step, expected_step in zip(logprobs, expected, strict=True):
            assert step.keys() == expected_step.keys()
            for token, logprob in step.items():
                assert logprob.logprob == pytest.approx(expected_step[token].logprob, abs=1e-4)
    # Every decode batch from 7 down to 1 ran padded: 7, 6, 5 as 8; 4, 3 as 4; 2; 1.
    assert set(checking.sizes) == set(CAPTURE_SIZES)

