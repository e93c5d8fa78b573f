"""The xgrammar backend: constraints become xgrammar Grammars without a tokenizer (so the front
end can reject a bad one before it reaches the engine), then compile once per engine for the
model's vocabulary; each request walks its own GrammarMatcher."""

from __future__ import annotations

import re
from typing import Any

from minivllm.sampling_params import StructuredOutputsParams
from minivllm.structured_output.backend_types import (
    MAX_JSON_WHITESPACE,
    StructuredOutputBackend,
    StructuredOutputGrammar,
    choice_as_ebnf,
    json_schema,
)

# xgrammar's C++ errors start with its log prefix, "[04:30:53] /project/cpp/regex_converter.cc:94: ":
# a path in its build tree, which says nothing to the client.
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")
# xgrammar's JSON-schema conversion ignores these: a schema that uses them would not be fully
# enforced, so it is refused here (and, under backend "auto", goes to llguidance).
_UNSUPPORTED_KEYWORDS = {
    "multipleOf", "uniqueItems", "contains", "minContains", "maxContains", "minProperties", "maxProperties",
    "propertyNames", "patternProperties", "dependentRequired", "dependentSchemas", "if", "then", "else", "not",
}


def build_grammar(params: StructuredOutputsParams) -> Any:
    """The constraint as an xgrammar Grammar; a ValueError saying what is wrong if it cannot be."""
    import xgrammar as xgr

    kind = params.kind
    if params.whitespace_pattern is not None:
        raise ValueError("whitespace_pattern is an llguidance option; xgrammar cannot honour it.")
    try:
        if kind in ("json", "json_object"):
            schema = json_schema(params)
            unsupported = sorted(_UNSUPPORTED_KEYWORDS & _keywords(schema))
            if unsupported:
                raise ValueError(f"The JSON schema uses features xgrammar does not support: {', '.join(unsupported)}.")
            separators = (",", ":") if params.disable_any_whitespace else None
            return xgr.Grammar.from_json_schema(schema, any_whitespace=not params.disable_any_whitespace,
                                                separators=separators, max_whitespace_cnt=MAX_JSON_WHITESPACE)
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_as_ebnf(params.choice or []))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(params.grammar)
        return xgr.Grammar.from_structural_tag(params.structural_tag)
    except ValueError:
        raise
    except Exception as e:  # xgrammar raises RuntimeError and its own types for bad input
        raise ValueError(f"Invalid {kind} for structured outputs (xgrammar): {_LOG_PREFIX.sub('', str(e)).strip()}") from None


def _keywords(node: Any) -> set[str]:
    """Every key used anywhere in a schema (property names included: a property named "not" is
    refused too, a rare false alarm that only sends the schema to the other backend)."""
    if isinstance(node, dict):
        return set(node).union(*(_keywords(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_keywords(v) for v in node))
    return set()


class XgrammarGrammar(StructuredOutputGrammar):
    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept_tokens(self, token_ids: list[int]) -> bool:
        return all(self.matcher.accept_token(t) for t in token_ids)

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def reset(self) -> None:
        self.matcher.reset()


class XgrammarBackend(StructuredOutputBackend):
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(info, max_threads=2)

    def compile(self, params: StructuredOutputsParams) -> Any:
        return self.compiler.compile_grammar(build_grammar(params))

    def new_grammar(self, compiled: Any) -> StructuredOutputGrammar:
        return XgrammarGrammar(self._xgr.GrammarMatcher(compiled))  # rollback is unlimited

    def allocate_token_bitmask(self, num_rows: int) -> Any:
        return self._xgr.allocate_token_bitmask(num_rows, self.vocab_size)
