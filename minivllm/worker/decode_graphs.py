"""Decode steps replayed from traces: the CPU's counterpart of vLLM's CUDA graphs.

A decode step of a small model is a few hundred small ops. Run eagerly, each costs a Python
module call and a dispatch, ~10 us: for SmolLM2 in bfloat16 about 3 ms of a 9 ms forward at one
request. vLLM captures the decode forward as CUDA graphs, one per batch size, and replays them.
On CPU a TorchScript trace does the same job: the ops, in order, recorded once per batch size and
replayed by TorchScript's C++ interpreter, with no Python between them (the 30-layer forward at
one request: 3.0-3.7 ms against 5.2-8.7 ms eager, same results bit for bit).

A trace fixes every Python decision the forward made while it was recorded: which kernel each
Linear picked for that many rows, that every request has one query token, which attention calls
ran. So a trace is keyed by the number of requests and replays only steps in which every request
decodes one token; any other step runs eagerly. The step's inputs (token ids, positions, the
attention metadata's tensors) are the trace's arguments; weights and KV caches are constants of
the trace, the same tensors, not copies.

Traces are recorded on first use (the first decode step with n requests, ~0.5-1 s each, once per
size up to MAX_TRACED_ROWS), so start-up does not pay for sizes a deployment never sees.
`enforce_eager` turns them off. torch.jit.trace is deprecated in favour of torch.compile and
torch.export, which replay nothing without a compile step of minutes on a small CPU; should a
trace fail, that size stays eager.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from minivllm.attention.cpu_paged import CpuPagedMetadata
from minivllm.logger import init_logger

logger = init_logger(__name__)

# Largest batch traced. Past it the Python cost is a small part of the step (64 requests: ~3 ms
# of ~110), and every size traced costs a trace.
MAX_TRACED_ROWS = 8


class DecodeGraphs:
    """model.forward, with decode-only steps of up to MAX_TRACED_ROWS requests replayed from
    traces."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.graphs: dict[int, torch.jit.ScriptModule | None] = {}  # None: tracing failed

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        num_tokens = input_ids.shape[0]
        if not _decode_only(attn_metadata, num_tokens):
            return self.model(input_ids, positions, attn_metadata)
        graph = self.graphs.get(num_tokens, False)
        if graph is False:
            graph = self.graphs[num_tokens] = self._trace(input_ids, positions, attn_metadata)
        if graph is None:
            return self.model(input_ids, positions, attn_metadata)
        return graph(input_ids, positions, *_tensors(attn_metadata))

    def _trace(self, input_ids: torch.Tensor, positions: torch.Tensor,
               attn_metadata: Any) -> torch.jit.ScriptModule | None:
        # NOTE: tracing runs the forward once: the step's K/V are written then, and again,
        # identically, when the trace replays the step.
        start = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the deprecation notice and tracer warnings
                graph = torch.jit.trace(_ForwardOfTensors(self.model, attn_metadata),
                                        (input_ids, positions, *_tensors(attn_metadata)), check_trace=False)
        except Exception as e:  # noqa: BLE001 - any failure leaves this size eager, never the step
            logger.warning("Tracing the decode step for %d requests failed (%s); it runs eagerly.",
                           input_ids.shape[0], e)
            return None
        logger.info("Traced the decode step for %d requests in %.2f s", input_ids.shape[0],
                    time.perf_counter() - start)
        return graph


def _decode_only(attn_metadata: Any, num_tokens: int) -> bool:
    """A step a trace may replay: the CPU paged backend's metadata, one token per request."""
    return (isinstance(attn_metadata, CpuPagedMetadata) and num_tokens <= MAX_TRACED_ROWS
            and len(attn_metadata.prefills) == 0 and len(attn_metadata.decodes) == num_tokens)


class _ForwardOfTensors(nn.Module):
    """model.forward taking the attention metadata as its tensors (a trace's arguments are
    tensors); the metadata is rebuilt around them on the template's structure."""

    def __init__(self, model: nn.Module, template: Any) -> None:
        super().__init__()
        self.model = model
        self.template = template

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, *metadata: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions, _rebuild(self.template, iter(metadata)))


def _tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors of a (nested) dataclass, in field order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if dataclasses.is_dataclass(obj):
        return [t for f in dataclasses.fields(obj) for t in _tensors(getattr(obj, f.name))]
    return []


def _rebuild(template: Any, tensors: Iterator[torch.Tensor]) -> Any:
    """template with its tensors replaced, in _tensors' order."""
    if isinstance(template, torch.Tensor):
        return next(tensors)
    if dataclasses.is_dataclass(template):
        return dataclasses.replace(template, **{f.name: _rebuild(getattr(template, f.name), tensors)
                                                for f in dataclasses.fields(template)})
    return template
