"""Steps replayed from traces: the CPU's counterpart of vLLM's CUDA graphs (a GraphRunner, see
graph_runner.py).

A step of a small model is a few hundred small ops. Run eagerly, each costs a Python module call
and a dispatch, ~10 us: for SmolLM2 in bfloat16 about 3 ms of a 9 ms forward at one request, and
the same 5-7 ms of every step, however many tokens it carries (the calls do not change with
them). vLLM captures forwards as CUDA graphs and replays them. On CPU a TorchScript trace does the
same job: the ops, in order, recorded once and replayed by TorchScript's C++ interpreter, with
no Python between them (the 30-layer forward at one request: 3.0-5.1 ms against 5.2-9.9 ms
eager; 19 decodes beside a 16- to 100-token prompt chunk, the steps a step budget makes under
load: 5-12 ms less; same results bit for bit).

A trace fixes every Python decision the forward made while it was recorded; the sizes it reads
from the tensors when it replays. The decisions a forward takes are:
- whether the last layer is pruned to the sampled positions (model/models/llama.py);
- which attention calls run: none for a backend whose metadata is tensors of one structure for
  the steps it replays (attention/backend.py: GraphSupport): uniform decode steps only, or every
  step when it makes the same calls for all (ALWAYS: the CPU paged backend).
So a step's kind (TraceKey) names the trace that replays it, and one trace replays every step of
its kind, at any size. A Linear with GGUF codes multiplies its codes for few rows and its
dequantized matrix for more, but chooses inside one op (ops/csrc/gguf_linear.cpp), which the
trace records as it is; a model whose Linears choose in Python (the C++ kernels not built) is
not traced at all. The step's inputs (token ids, positions, the pruned rows, the attention
metadata's tensors) are the trace's arguments; weights and KV caches are constants of the
trace, the same tensors, not copies.

Recording costs ~1 s (0.6 s to trace, ~0.4 s more over the first two replays while TorchScript
optimizes the graph) and each replayed step saves 4-12 ms, so a trace only pays for itself after
~200 steps: short generations (a CLI prompt, most chat turns) would lose. So, as a ski renter
buys skis once the rent paid equals their price, a kind's trace is recorded once
TRACE_AFTER_STEPS steps of that kind have run eagerly; until then, and for an engine that never
runs that many, nothing is recorded, and a long-running one pays at most twice the optimal cost.
`enforce_eager` turns it off. torch.jit.trace is deprecated in favour of torch.compile and
torch.export, which replay nothing without a compile step of minutes on a small CPU; should a
trace fail, the steps of its kind stay eager.
"""

from __future__ import annotations

import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from minivllm.attention.backend import GraphSupport
from minivllm.logger import init_logger
from minivllm.model.layers.linear import Linear
from minivllm.worker.graph_runner import BatchDescriptor, StepArgs, rebuild_with_tensors, tensors_of

logger = init_logger(__name__)

# Eager steps of a kind before its trace is recorded: the cost (~1 s) over what one replay saves (~5 ms).
TRACE_AFTER_STEPS = 200


@dataclass(frozen=True)
class TraceKey:
    """What a trace fixes of the steps it replays (the module docstring's decisions)."""

    uniform_decode: bool
    pruned: bool


def rows_choice_in_python(model: nn.Module) -> bool:
    """Whether a Linear of model picks its GGUF codes or its dense matrix in Python, a choice a
    trace would fix."""
    return any(isinstance(m, Linear) and m.quantized is not None and not m.rows_choice_in_op for m in model.modules())


class StepTraces:
    """Steps replayed from one trace per kind (TraceKey)."""

    def __init__(self, model: nn.Module, graph_support: GraphSupport, capture_sizes: tuple[int, ...] = ()) -> None:
        """capture_sizes: unused, one trace replays every size."""
        self.model = model
        self.graph_support = GraphSupport.NEVER if rows_choice_in_python(model) else graph_support
        self.num_eager_steps: Counter[TraceKey] = Counter()  # per kind, until its trace is recorded
        self.traces: dict[TraceKey, torch.jit.ScriptModule | None] = {}  # None: its recording failed

    def capture(self, make_inputs: Callable[[int], StepArgs]) -> None:
        """Nothing at start-up: a trace is recorded once it has paid for itself."""

    def key(self, batch: BatchDescriptor) -> TraceKey | None:
        """The kind of trace that replays this step; None where the backend's metadata cannot be
        replayed."""
        needed = GraphSupport.UNIFORM_SINGLE_TOKEN_DECODE if batch.uniform_decode else GraphSupport.ALWAYS
        if self.graph_support < needed:
            return None
        return TraceKey(batch.uniform_decode, batch.num_kept_rows is not None)

    def dispatch(self, batch: BatchDescriptor) -> BatchDescriptor | None:
        key = self.key(batch)
        if key is None:
            return None
        if key in self.traces:
            return batch if self.traces[key] is not None else None
        self.num_eager_steps[key] += 1
        return batch if self.num_eager_steps[key] > TRACE_AFTER_STEPS else None

    def __call__(self, batch: BatchDescriptor, input_ids: torch.Tensor, positions: torch.Tensor,
                 attn_metadata: tuple[Any, ...], kept_rows: torch.Tensor | None) -> torch.Tensor:
        key = self.key(batch)
        assert key is not None
        args = (input_ids, positions, *([] if kept_rows is None else [kept_rows]), *tensors_of(attn_metadata))
        if key not in self.traces:
            self.traces[key] = self._trace(key, _ForwardOfTensors(self.model, attn_metadata, kept_rows is not None), args)
            if self.traces[key] is None:
                return self.model(input_ids, positions, attn_metadata, kept_rows)
        trace = self.traces[key]
        assert trace is not None
        return trace(*args)

    @staticmethod
    def _trace(key: TraceKey, forward: nn.Module, args: tuple[torch.Tensor, ...]) -> torch.jit.ScriptModule | None:
        # NOTE: tracing runs the forward once: the step's K/V are written then, and again,
        # identically, when the trace replays the step.
        start = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the deprecation notice and tracer warnings
                trace = torch.jit.trace(forward, args, check_trace=False)
        except Exception as e:  # noqa: BLE001 - any failure leaves the kind eager, never the step
            logger.warning("Tracing the steps of kind %s failed (%s); they run eagerly.", key, e)
            return None
        logger.info("Traced the steps of kind %s in %.2f s", key, time.perf_counter() - start)
        return trace


class _ForwardOfTensors(nn.Module):
    """model.forward taking the pruned rows (when pruned) and the attention metadata as tensors
    (a trace's arguments are tensors); the metadata is rebuilt around them on the template's
    structure."""

    def __init__(self, model: nn.Module, template: Any, pruned: bool) -> None:
        super().__init__()
        self.model = model
        self.template = template
        self.pruned = pruned

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        kept_rows, metadata = (tensors[0], tensors[1:]) if self.pruned else (None, tensors)
        return self.model(input_ids, positions, rebuild_with_tensors(self.template, iter(metadata)), kept_rows)
