"""Structured output (vLLM V1's design): the engine core's StructuredOutputManager compiles each
request's constraint in a thread pool, off the step loop (the request waits in WAITING_FOR_FSM
meanwhile, and others keep running), caches compiled constraints by (backend, kind, spec,
options), and each step fills the token bitmask of the scheduled requests that sample, which
travels in SchedulerOutput to the worker; the worker masks the logits with it before the
sampler; the scheduler advances each grammar with the sampled tokens.

Backends: xgrammar (backend_xgrammar.py) and llguidance (backend_guidance.py); "auto" is
xgrammar, or llguidance for a constraint xgrammar refuses (the front end decides, once per
request: engine/processor.py).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from minivllm.sampling_params import StructuredOutputsParams
from minivllm.structured_output.backend_types import (
    StructuredOutputBackend,
    StructuredOutputGrammar,
    cache_key,
)

if TYPE_CHECKING:
    from minivllm.config import VllmConfig
    from minivllm.core.request import Request

BACKENDS = ("auto", "xgrammar", "guidance")


def resolve_backend(params: StructuredOutputsParams, engine_backend: str) -> str:
    """The backend for one constraint: the engine's, or under "auto" xgrammar unless it refuses
    the constraint (then llguidance); a ValueError if the chosen one refuses it. The check
    needs no tokenizer, so the front end runs it before the request reaches the engine."""
    from minivllm.structured_output import backend_guidance, backend_xgrammar

    if engine_backend == "guidance":
        backend_guidance.build_grammar(params)
        return "guidance"
    try:
        backend_xgrammar.build_grammar(params)
        return "xgrammar"
    except ValueError as xgrammar_error:
        if engine_backend == "xgrammar" or params.kind == "structural_tag":
            raise
        try:
            backend_guidance.build_grammar(params)
        except ValueError:
            raise xgrammar_error from None
        return "guidance"


class StructuredOutputManager:
    def __init__(self, vllm_config: VllmConfig) -> None:
        self.model_config = vllm_config.model_config
        spec = vllm_config.speculative_config
        # Bitmask rows a step can need: one per sampled position (a request verifying k drafts
        # samples at k + 1 positions).
        self.max_num_rows = vllm_config.scheduler_config.max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0))
        self._backends: dict[str, StructuredOutputBackend] = {}
        self._compiled: dict[tuple[Any, ...], Any] = {}
        self._lock = threading.Lock()  # backends and the cache, shared by the compile threads
        self._tokenizer: Any = None
        self.executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")
        self._bitmask: Any = None  # one buffer, max_num_seqs rows, reused every step

    def grammar_init(self, request: Request) -> None:
        """Start compiling the request's grammar; it waits (WAITING_FOR_FSM) until it is done."""
        so_request = request.structured_output_request
        assert so_request is not None
        so_request.future = self.executor.submit(self._create_grammar, so_request.params)

    def _create_grammar(self, params: StructuredOutputsParams) -> StructuredOutputGrammar:
        backend = self._backend(params.backend or "xgrammar")
        key = cache_key(params)
        with self._lock:
            compiled = self._compiled.get(key)
        if compiled is None:
            compiled = backend.compile(params)
            with self._lock:
                self._compiled[key] = compiled
        return backend.new_grammar(compiled)

    def _backend(self, name: str) -> StructuredOutputBackend:
        with self._lock:
            backend = self._backends.get(name)
            if backend is None:
                backend = self._backends[name] = self._make_backend(name)
            return backend

    def _make_backend(self, name: str) -> StructuredOutputBackend:
        """Built on first use: the tokenizer and the vocabulary tables cost ~1 s, and an engine
        without structured requests never pays it."""
        from minivllm.transformers_utils.tokenizer import get_tokenizer

        if self._tokenizer is None:
            self._tokenizer = get_tokenizer(self.model_config.tokenizer)
        vocab_size = self.model_config.hf_config.vocab_size
        if name == "guidance":
            from minivllm.structured_output.backend_guidance import GuidanceBackend

            return GuidanceBackend(self._tokenizer, vocab_size)
        from minivllm.structured_output.backend_xgrammar import XgrammarBackend

        return XgrammarBackend(self._tokenizer, vocab_size)

    def grammar_bitmask(self, requests: list[Request], spec_tokens: dict[str, list[int]]) -> Any:
        """The allowed next tokens of each request at each position it samples (rows in the
        given order; a request with drafts d1..dk gets k + 1 rows: before d1, after d1, ...,
        after dk, its grammar advanced over the drafts and rolled back), as a numpy int32 array
        [rows, ceil(vocab / 32)] (cheap to send to the worker)."""
        if self._bitmask is None:
            self._bitmask = next(iter(self._backends.values())).allocate_token_bitmask(self.max_num_rows)
        row = 0
        for request in requests:
            grammar = request.structured_output_request.grammar  # type: ignore[union-attr]
            assert grammar is not None
            drafts = spec_tokens.get(request.request_id, ())
            num_advanced = 0
            for i, token_id in enumerate(drafts):
                grammar.fill_bitmask(self._bitmask, row + i)
                # A draft the grammar rejects is masked out in its own row, so the target
                # rejects it: later rows are never reached.
                if num_advanced == i and not grammar.is_terminated() and grammar.accept_tokens([token_id]):
                    num_advanced += 1
            grammar.fill_bitmask(self._bitmask, row + len(drafts))
            if num_advanced:
                grammar.rollback(num_advanced)
            row += 1 + len(drafts)
        return self._bitmask[:row].numpy().copy()

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
