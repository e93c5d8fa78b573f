"""A request's structured-output state inside the engine core: its grammar, compiled in the
manager's thread pool, and ready once the compile has finished."""

from __future__ import annotations

from concurrent.futures import Future

from minivllm.sampling_params import StructuredOutputsParams
from minivllm.structured_output.backend_types import StructuredOutputGrammar


class StructuredOutputRequest:
    def __init__(self, params: StructuredOutputsParams) -> None:
        self.params = params
        self.future: Future[StructuredOutputGrammar] | None = None
        self.grammar: StructuredOutputGrammar | None = None
        self.error: str | None = None  # why the grammar could not be built

    def check_ready(self) -> bool:
        """Whether the compile has finished (successfully: `grammar`; or not: `error`)."""
        if self.grammar is not None or self.error is not None:
            return True
        assert self.future is not None
        if not self.future.done():
            return False
        try:
            self.grammar = self.future.result()
        except Exception as e:  # the compile's own error, reported to the caller
            self.error = f"{type(e).__name__}: {e}"
        return True
