"""Decode steps replayed from CUDA graphs (a GraphRunner, see graph_runner.py; vLLM's
CUDAGraphWrapper in FULL mode for uniform decode batches).

A decode step launches a few hundred kernels; for a model of a few billion parameters on a GPU
each runs in microseconds, about as long as the CPU takes to launch it, so an eager step is
bound by Python and the launch queue, not by the GPU. A CUDA graph records the launches once
and replays them with one call. Kernels in a graph keep their arguments: the same pointers,
the same grid. So each graph is recorded for one batch size, reading its inputs from the model
runner's persistent buffers (worker/buffers.py: ids, positions, slot mappings, sequence lengths,
query offsets, block tables, at addresses that never change), and a replay reads whatever the
step wrote there. What varies inside a size (the lengths, which blocks) is data the kernels read
(attention/triton_kernels.py sizes its grid from shapes alone).

Recorded at start-up for each size of cudagraph_capture_sizes, largest first and sharing one
memory pool (the activations of the smaller graphs fit in the largest one's), after an eager
warm-up run (Triton compiles and cuBLAS picks its kernels outside the recording). A decode step
of n requests replays the smallest size >= n; the model runner pads it with requests of no
tokens, which write and read nothing. Steps with prompt tokens, and decode steps larger than
the largest size, run eagerly: they are bound by the GPU's arithmetic, where launches cost
little (vLLM records those piecewise, around attention; not done here).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from minivllm.attention.backend import GraphSupport
from minivllm.logger import init_logger
from minivllm.platforms.interface import GiB
from minivllm.worker.graph_runner import BatchDescriptor, StepArgs, tensors_of

logger = init_logger(__name__)


class CudaGraphs:
    """What CudaGraphRunner records with: CUDA graphs on the current device, sharing one memory
    pool (a stand-in replaces it in the tests that run without a GPU)."""

    def __init__(self) -> None:
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.pool = torch.cuda.graph_pool_handle()

    def memory_free(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.mem_get_info(self.device)[0]

    def record(self, forward: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        """forward's launches recorded as a graph: its replay, and where it leaves its output."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = forward()
        return graph.replay, output


@dataclass
class _Recording:
    replay: Callable[[], None]
    inputs: list[torch.Tensor]  # what the graph reads: ids, positions, the metadata's tensors
    output: torch.Tensor  # where it leaves the hidden states


class CudaGraphRunner:
    def __init__(self, model: nn.Module, graph_support: GraphSupport, capture_sizes: tuple[int, ...]) -> None:
        self.model = model
        self.capture_sizes = capture_sizes if graph_support >= GraphSupport.UNIFORM_SINGLE_TOKEN_DECODE else ()
        self.recordings: dict[int, _Recording] = {}

    def capture(self, make_inputs: Callable[[int], StepArgs]) -> None:
        if not self.capture_sizes:
            return
        graphs = CudaGraphs()
        free_before = graphs.memory_free()
        start = time.perf_counter()
        for size in reversed(self.capture_sizes):
            input_ids, positions, attn_metadata = make_inputs(size)

            def forward(input_ids=input_ids, positions=positions, attn_metadata=attn_metadata) -> torch.Tensor:
                return self.model(input_ids, positions, attn_metadata)

            forward()  # warm-up, outside the recording
            replay, output = graphs.record(forward)
            self.recordings[size] = _Recording(replay, [input_ids, positions, *tensors_of(attn_metadata)], output)
        logger.info("Captured %d CUDA graphs (decode batches of %s requests) in %.1f s, %.2f GiB",
                    len(self.recordings), _ranges(self.capture_sizes), time.perf_counter() - start,
                    (free_before - graphs.memory_free()) / GiB)

    def dispatch(self, batch: BatchDescriptor) -> BatchDescriptor | None:
        if not batch.uniform_decode:
            return None
        i = bisect.bisect_left(self.capture_sizes, batch.num_tokens)
        if i == len(self.capture_sizes):
            return None
        return BatchDescriptor(num_tokens=self.capture_sizes[i], uniform_decode=True)

    def __call__(self, batch: BatchDescriptor, input_ids: torch.Tensor, positions: torch.Tensor,
                 attn_metadata: tuple[Any, ...], kept_rows: torch.Tensor | None) -> torch.Tensor:
        assert kept_rows is None  # uniform decode steps sample every token
        recording = self.recordings[batch.num_tokens]
        given = [input_ids, positions, *tensors_of(attn_metadata)]
        for recorded, tensor in zip(recording.inputs, given, strict=True):
            # NOTE: the model runner's buffers are the recorded ones; anything else is copied in.
            if tensor.data_ptr() != recorded.data_ptr():
                recorded.copy_(tensor)
        recording.replay()
        return recording.output


def _ranges(sizes: tuple[int, ...]) -> str:
    return f"{sizes[0]}" if len(sizes) == 1 else f"{sizes[0]}..{sizes[-1]} ({len(sizes)} sizes)"
