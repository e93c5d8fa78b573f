"""Replaying recorded forwards: the interface the model runner dispatches to, whatever records them
(on CPU a TorchScript trace of decode steps, worker/decode_graph.py; on CUDA, CUDA graphs).

The runner describes each step with a BatchDescriptor; the platform names the graph runner class
(platforms/: graph_runner_qualname) and the attention backend says which steps its metadata lets
a recording replay (attention/backend.py: GraphSupport). A step the graph runner cannot replay
runs the model eagerly.
"""

from __future__ import annotations

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


class GraphRunner(Protocol):
    def __init__(self, model: nn.Module, graph_support: GraphSupport) -> None: ...

    def can_replay(self, batch: BatchDescriptor) -> bool:
        """Whether __call__ runs this step from a recording (recording it first if need be)."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        """The model's forward over every token (no last-layer pruning), replayed."""
