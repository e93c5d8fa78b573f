"""Decode steps replayed from a trace: the CPU's counterpart of vLLM's CUDA graphs (a GraphRunner,
see graph_runner.py).

A decode step of a small model is a few hundred small ops. Run eagerly, each costs a Python
module call and a dispatch, ~10 us: for SmolLM2 in bfloat16 about 3 ms of a 9 ms forward at one
request. vLLM captures the decode forward as CUDA graphs and replays them. On CPU a TorchScript
trace does the same job: the ops, in order, recorded once and replayed by TorchScript's C++
interpreter, with no Python between them (the 30-layer forward at one request: 3.0-5.1 ms
against 5.2-9.9 ms eager, same results bit for bit).

A trace fixes every Python decision the forward made while it was recorded: which kernel each
Linear picked, that every request has one query token, which attention calls ran. Those
decisions are the same for every uniform decode step of at most `max_traced_rows` requests (a
Linear with GGUF codes takes them up to its own bound, the dequantized weight past it, so the
trace stops at the smallest such bound, and at MAX_TRACED_ROWS) when the attention backend's
metadata of such steps is tensors (GraphSupport.UNIFORM_SINGLE_TOKEN_DECODE),
and the sizes themselves are read from the tensors when the trace replays, so one trace serves
all of them. Any other step runs eagerly. The step's inputs (token ids, positions, the attention
metadata's tensors) are the trace's arguments; weights and KV caches are constants of the
trace, the same tensors, not copies.

Recording costs ~1 s (0.6 s to trace, ~0.4 s more over the first two replays while TorchScript
optimizes the graph) and each replayed step saves ~5 ms, so a trace only pays for itself after
~200 steps: short generations (a CLI prompt, most chat turns) would lose. So, as a ski renter
buys skis once the rent paid equals their price, the trace is recorded once TRACE_AFTER_STEPS
steps it could have replayed have run eagerly; until then, and for an engine that never runs
that many, nothing is recorded, and a long-running one pays at most twice the optimal cost.
`enforce_eager` turns it off. torch.jit.trace is deprecated in favour of torch.compile and
torch.export, which replay nothing without a compile step of minutes on a small CPU; should the
trace fail, steps stay eager.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from minivllm.attention.backend import GraphSupport
from minivllm.logger import init_logger
from minivllm.model.layers.linear import Linear
from minivllm.worker.graph_runner import BatchDescriptor, StepArgs, rebuild_with_tensors, tensors_of

logger = init_logger(__name__)

# Largest batch replayed from a trace. Past it the Python cost is a small part of the step (64
# requests, ~3 ms of ~110); up to it the trace saves 4-8 ms of SmolLM2's 20-40 ms steps of 9-16
# requests and 3-5 ms at 24-32 (2-core Zen 4, 2026-12-07).
MAX_TRACED_ROWS = 32
# Eager steps before the trace is recorded: its cost (~1 s) over what one replay saves (~5 ms).
TRACE_AFTER_STEPS = 200


def max_traced_rows(model: nn.Module) -> int:
    """The most requests one trace of `model` serves: the smallest bound of its Linears that keep
    GGUF codes (each takes them up to its bound, the dequantized weight past it), at most
    MAX_TRACED_ROWS."""
    bounds = [m.quantized.max_rows for m in model.modules() if isinstance(m, Linear) and m.quantized is not None]
    return min([*bounds, MAX_TRACED_ROWS])


class DecodeGraph:
    """Uniform decode steps of up to `max_rows` requests, replayed from one trace."""

    def __init__(self, model: nn.Module, graph_support: GraphSupport, capture_sizes: tuple[int, ...] = ()) -> None:
        """capture_sizes: unused, one trace replays every size."""
        self.model = model
        self.enabled = graph_support >= GraphSupport.UNIFORM_SINGLE_TOKEN_DECODE
        self.max_rows = max_traced_rows(model)
        self.num_eager_steps = 0  # steps it could have replayed, run eagerly before recording
        self.traced = False  # whether tracing was tried
        self.graph: torch.jit.ScriptModule | None = None  # None after a failed trace

    def capture(self, make_inputs: Callable[[int], StepArgs]) -> None:
        """Nothing at start-up: the trace is recorded once it has paid for itself."""

    def dispatch(self, batch: BatchDescriptor) -> BatchDescriptor | None:
        if not (self.enabled and batch.uniform_decode and batch.num_tokens <= self.max_rows):
            return None
        if self.traced:
            return batch if self.graph is not None else None
        self.num_eager_steps += 1
        return batch if self.num_eager_steps > TRACE_AFTER_STEPS else None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        if not self.traced:
            self.traced = True
            self.graph = self._trace(input_ids, positions, attn_metadata)
            if self.graph is None:
                return self.model(input_ids, positions, attn_metadata)
        assert self.graph is not None
        return self.graph(input_ids, positions, *tensors_of(attn_metadata))

    def _trace(self, input_ids: torch.Tensor, positions: torch.Tensor,
               attn_metadata: Any) -> torch.jit.ScriptModule | None:
        # NOTE: tracing runs the forward once: the step's K/V are written then, and again,
        # identically, when the trace replays the step.
        start = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the deprecation notice and tracer warnings
                graph = torch.jit.trace(_ForwardOfTensors(self.model, attn_metadata),
                                        (input_ids, positions, *tensors_of(attn_metadata)), check_trace=False)
        except Exception as e:  # noqa: BLE001 - any failure leaves decoding eager, never the step
            logger.warning("Tracing the decode step failed (%s); decode steps run eagerly.", e)
            return None
        logger.info("Traced the decode step in %.2f s", time.perf_counter() - start)
        return graph


class _ForwardOfTensors(nn.Module):
    """model.forward taking the attention metadata as its tensors (a trace's arguments are
    tensors); the metadata is rebuilt around them on the template's structure."""

    def __init__(self, model: nn.Module, template: Any) -> None:
        super().__init__()
        self.model = model
        self.template = template

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, *metadata: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions, rebuild_with_tensors(self.template, iter(metadata)))
