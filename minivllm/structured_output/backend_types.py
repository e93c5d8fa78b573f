"""What a structured-output backend is: something that compiles a constraint for a vocabulary
(once per distinct constraint: the manager caches the result) and makes a fresh grammar state
from the compiled form for each request.

The token bitmask is the one format every backend shares: int32 words, 32 tokens a word, bit
`t % 32` of word `t // 32` set when token t is allowed (xgrammar's and llguidance's layout).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import Any

from minivllm.sampling_params import StructuredOutputsParams

# Longest run of whitespace JSON may have between tokens (unless whitespace_pattern says
# otherwise): without a bound a model can emit spaces until max_tokens (vLLM issue #38696),
# and 16 still allows pretty-printing a few levels deep.
MAX_JSON_WHITESPACE = 16


class StructuredOutputGrammar(ABC):
    """One request's position in its grammar."""

    @abstractmethod
    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance over the tokens; False (and no advance past the first rejected one) if the
        grammar rejects one."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (rejected draft tokens)."""

    @abstractmethod
    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Write the tokens allowed next into row `row` of a bitmask from allocate_token_bitmask."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """Whether the grammar has accepted its end (a stop token after a complete match)."""

    @abstractmethod
    def reset(self) -> None:
        """Back to the start."""

    def validate_tokens(self, token_ids: list[int]) -> list[int]:
        """The longest prefix of `token_ids` (draft tokens) the grammar accepts from here; the
        grammar is left where it was."""
        num_valid = 0
        for token_id in token_ids:
            if self.is_terminated() or not self.accept_tokens([token_id]):
                break
            num_valid += 1
        if num_valid:
            self.rollback(num_valid)
        return token_ids[:num_valid]


class StructuredOutputBackend(ABC):
    name: str

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled constraint (shared by every request with the same constraint)."""

    @abstractmethod
    def new_grammar(self, compiled: Any) -> StructuredOutputGrammar:
        """A fresh grammar state for one request."""

    @abstractmethod
    def allocate_token_bitmask(self, num_rows: int) -> Any:
        """A torch int32 tensor [num_rows, ceil(vocab_size / 32)]."""


def cache_key(params: StructuredOutputsParams) -> tuple[Any, ...]:
    """What identifies a compiled constraint: the backend, the kind, its spec and the options."""
    spec = getattr(params, params.kind)
    if params.kind == "json":
        spec = json_schema_text(params)
    elif params.kind == "choice":
        spec = tuple(spec)
    return (params.backend, params.kind, spec, params.disable_any_whitespace,
            params.disable_additional_properties, params.whitespace_pattern)


def json_schema(params: StructuredOutputsParams) -> dict[str, Any]:
    """The schema to enforce for a json or json_object constraint (a ValueError if it is not a
    JSON object), with "additionalProperties": false where the schema leaves it open when
    disable_additional_properties is set."""
    if params.json_object:
        schema: Any = {"type": "object"}
    else:
        schema = params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"The JSON schema is not valid JSON: {e}.") from None
    if not isinstance(schema, dict):
        raise ValueError(f"A JSON schema must be a JSON object, got {type(schema).__name__}.")
    if params.disable_additional_properties:
        schema = _close_objects(schema)
    return schema


def json_schema_text(params: StructuredOutputsParams) -> str:
    return json.dumps(json_schema(params), sort_keys=True)


def _close_objects(node: Any) -> Any:
    if isinstance(node, list):
        return [_close_objects(n) for n in node]
    if not isinstance(node, dict):
        return node
    closed = {k: _close_objects(v) for k, v in node.items()}
    if closed.get("type") == "object" and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


def choice_as_ebnf(choices: list[str]) -> str:
    """root ::= "a" | "b": each choice as an EBNF string literal (JSON's escapes, which
    xgrammar's EBNF and llguidance's Lark both read)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
