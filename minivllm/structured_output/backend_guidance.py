"""The llguidance backend: constraints become llguidance grammar strings (checked against the
real vocabulary in the engine, without one in the front end), one LLMatcher per request. It
takes what xgrammar refuses (the JSON-schema keywords xgrammar ignores, whitespace_pattern)."""

from __future__ import annotations

import json
from typing import Any

from minivllm.sampling_params import StructuredOutputsParams
from minivllm.structured_output.backend_types import (
    MAX_JSON_WHITESPACE,
    StructuredOutputBackend,
    StructuredOutputGrammar,
    json_schema,
)


def build_grammar(params: StructuredOutputsParams, tokenizer: Any = None) -> str:
    """The constraint as an llguidance grammar; a ValueError saying what is wrong if it cannot
    be (checked against `tokenizer`, an LLTokenizer, when given)."""
    import llguidance as llg

    kind = params.kind
    if kind in ("json", "json_object"):
        schema = json_schema(params)
        options: dict[str, Any] = {"whitespace_flexible": not params.disable_any_whitespace}
        if not params.disable_any_whitespace:
            options["whitespace_pattern"] = params.whitespace_pattern or rf"[\x20\x0A\x0D\x09]{{0,{MAX_JSON_WHITESPACE}}}"
        grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=options)
    elif kind == "regex":
        grammar = llg.grammar_from("regex", params.regex)
    elif kind == "choice":
        grammar = llg.grammar_from("choice", json.dumps(params.choice))
    elif kind == "grammar":
        grammar = llg.grammar_from("grammar", params.grammar)
    else:
        raise ValueError("structural_tag is an xgrammar feature; use backend xgrammar or auto.")
    error = llg.LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        raise ValueError(f"Invalid {kind} for structured outputs (llguidance): {error.strip()}")
    return grammar


class GuidanceGrammar(StructuredOutputGrammar):
    """llguidance stops as soon as nothing can follow; its mask then allows only the stop token.
    The grammar ends, as xgrammar's does, when that token is accepted too, so a request always
    ends on a stop token (whose text is not output) and never on a content token."""

    def __init__(self, matcher: Any, stop_token_id: int) -> None:
        self.matcher = matcher
        self.stop_token_id = stop_token_id
        self._ended = False

    def accept_tokens(self, token_ids: list[int]) -> bool:
        for token_id in token_ids:
            if self.matcher.is_stopped():
                if token_id != self.stop_token_id or self._ended:
                    return False
                self._ended = True
            elif not self.matcher.consume_tokens([token_id]) or self.matcher.is_error():
                return False
        return True

    def rollback(self, num_tokens: int) -> None:
        if self._ended and num_tokens > 0:
            self._ended, num_tokens = False, num_tokens - 1
        self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        import llguidance.torch as lt

        lt.fill_next_token_bitmask(self.matcher, bitmask, row)

    def is_terminated(self) -> bool:
        return self._ended

    def reset(self) -> None:
        self.matcher.reset()
        self._ended = False


class GuidanceBackend(StructuredOutputBackend):
    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import llguidance as llg
        import llguidance.hf

        self._llg = llg
        self.vocab_size = vocab_size
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)

    def compile(self, params: StructuredOutputsParams) -> Any:
        return build_grammar(params, self.ll_tokenizer)

    def new_grammar(self, compiled: Any) -> StructuredOutputGrammar:
        return GuidanceGrammar(self._llg.LLMatcher(self.ll_tokenizer, compiled), self.ll_tokenizer.eos_token)

    def allocate_token_bitmask(self, num_rows: int) -> Any:
        import torch

        return torch.full((num_rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
