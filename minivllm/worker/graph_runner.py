"""Replaying recorded forwards: the interface the model runner dispatches to, whatever records them
(on CPU TorchScript traces, worker/step_traces.py; on CUDA, CUDA graphs of decode steps).

The model runner describes each step with a BatchDescriptor and asks the graph runner to
dispatch it: the graph runner answers with the recorded batch that runs it (the step padded to a
recorded size: the model runner pads its inputs with requests of no tokens) or None, and the step
runs eagerly. The platform names the graph runner class (platforms/: graph_runner_qualname) and
the attention backend says which steps its metadata lets a recording replay
(attention/backend.py: GraphSupport).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from minivllm.attention.backend import GraphSupport


@dataclass(frozen=True)
class BatchDescriptor:
    """What decides whether a recorded forward can run a step (vLLM's BatchDescriptor)."""

    num_tokens: int
    uniform_decode: bool  # every request has exactly one query token
    # The rows the last layer carries past attention when the forward prunes it to the sampled
    # positions (model/models/llama.py); None: every token's.
    num_kept_rows: int | None = None


StepArgs = tuple[torch.Tensor, torch.Tensor, tuple[Any, ...]]
"""A forward's arguments: token ids, positions, one attention metadata per KV cache group."""


class GraphRunner(Protocol):
    def __init__(self, model: nn.Module, graph_support: GraphSupport, capture_sizes: tuple[int, ...]) -> None:
        """capture_sizes: the batch sizes to record at start-up, for a runner that records one
        forward per size (CUDA graphs)."""

    def capture(self, make_inputs: Callable[[int], StepArgs]) -> None:
        """Record what is recorded at start-up; make_inputs(n) gives the inputs of an n-token
        step of n empty requests, in the buffers real steps of that size use."""

    def dispatch(self, batch: BatchDescriptor) -> BatchDescriptor | None:
        """The recorded batch that runs this step (padded to it), or None to run it eagerly."""

    def __call__(self, batch: BatchDescriptor, input_ids: torch.Tensor, positions: torch.Tensor,
                 attn_metadata: tuple[Any, ...], kept_rows: torch.Tensor | None) -> torch.Tensor:
        """The model's forward, replayed, for a step dispatch answered `batch` for: over every
        token, padding included, or pruned to kept_rows (batch.num_kept_rows of them)."""


def tensors_of(obj: Any) -> list[torch.Tensor]:
    """The tensors of (tuples of nested) dataclasses, in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, tuple):
        return [t for item in obj for t in tensors_of(item)]
    if dataclasses.is_dataclass(obj):
        return [t for f in dataclasses.fields(obj) for t in tensors_of(getattr(obj, f.name))]
    return []


def rebuild_with_tensors(template: Any, tensors: Iterator[torch.Tensor]) -> Any:
    """template with its tensors replaced, in tensors_of' order."""
    if isinstance(template, torch.Tensor):
        return next(tensors)
    if isinstance(template, tuple):
        return tuple(rebuild_with_tensors(item, tensors) for item in template)
    if dataclasses.is_dataclass(template):
        return dataclasses.replace(template, **{f.name: rebuild_with_tensors(getattr(template, f.name), tensors)
                                                for f in dataclasses.fields(template)})
    return template
