"""The structured-output backends against independent references: the tokens a grammar allows
at its start, worked out from the vocabulary's own strings; the bitmask applied to logits by
hand; which backend takes which constraint; bad constraints refused with a clear error."""

from __future__ import annotations

import pytest
import torch

from minivllm.sample.ops.bitmask import apply_token_bitmask
from minivllm.sampling_params import StructuredOutputsParams
from minivllm.structured_output import resolve_backend
from minivllm.structured_output.backend_guidance import GuidanceBackend
from minivllm.structured_output.backend_types import cache_key, choice_as_ebnf, json_schema
from minivllm.structured_output.backend_xgrammar import XgrammarBackend
from minivllm.transformers_utils.tokenizer import get_tokenizer

CHOICES = ["yes", "no", "maybe so"]


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return get_tokenizer(str(tokenizer_dir))


@pytest.fixture(scope="module", params=["xgrammar", "guidance"])
def backend(request, tokenizer):
    cls = XgrammarBackend if request.param == "xgrammar" else GuidanceBackend
    return cls(tokenizer, len(tokenizer))


def allowed_ids(grammar, backend) -> set[int]:
    bitmask = backend.allocate_token_bitmask(2)
    grammar.fill_bitmask(bitmask, 1)
    logits = torch.zeros(2, backend.vocab_size)
    apply_token_bitmask(logits, bitmask[1:], torch.tensor([1]))
    assert torch.all(logits[0] == 0)  # the other row untouched
    return set(torch.isfinite(logits[1]).nonzero().flatten().tolist())


def test_choice_allows_exactly_the_prefixes_of_the_choices(backend, tokenizer):
    """At the start, a token is allowed iff its text is a non-empty prefix of a choice; after
    "may", iff it continues "maybe so" (nothing else: the other choices are ruled out).
    xgrammar allows exactly those; llguidance some of them after "may" (it leaves out a few
    tokenizations no tokenizer would produce, here "b" + "e" for "be"), never another."""
    def texts() -> dict[int, str]:
        return {t: tokenizer.decode([t]) for t in range(len(tokenizer)) if t not in tokenizer.all_special_ids}

    vocab = texts()
    params = StructuredOutputsParams(choice=CHOICES, backend=backend.name)
    grammar = backend.new_grammar(backend.compile(params))
    expected = {t for t, s in vocab.items() if s and any(c.startswith(s) for c in CHOICES)}
    assert len(expected) >= 6  # "y", "ye", "yes", "n", "no", "m", ... in this vocabulary
    assert allowed_ids(grammar, backend) == expected
    assert grammar.accept_tokens(tokenizer.encode("may", add_special_tokens=False))
    expected = {t for t, s in vocab.items() if s and "be so".startswith(s)}
    allowed = allowed_ids(grammar, backend)
    assert tokenizer.encode("be", add_special_tokens=False)[0] in allowed
    assert allowed == expected if backend.name == "xgrammar" else allowed <= expected
    assert not grammar.accept_tokens(tokenizer.encode("X", add_special_tokens=False))


def test_grammar_ends_on_the_stop_token_after_a_complete_match(backend, tokenizer):
    """Complete after "123", the grammar allows only EOS, and ends once it takes it (both
    backends: llguidance stops matching at once, its grammar state waits for the stop token)."""
    params = StructuredOutputsParams(regex=r"[0-9]{3}", backend=backend.name)
    grammar = backend.new_grammar(backend.compile(params))
    assert grammar.accept_tokens(tokenizer.encode("123", add_special_tokens=False))
    assert not grammar.is_terminated()
    assert allowed_ids(grammar, backend) == {tokenizer.eos_token_id}
    assert not grammar.accept_tokens(tokenizer.encode("4", add_special_tokens=False))
    assert grammar.accept_tokens([tokenizer.eos_token_id]) and grammar.is_terminated()
    grammar.rollback(1)  # speculative decoding takes rejected tokens back
    assert not grammar.is_terminated() and allowed_ids(grammar, backend) == {tokenizer.eos_token_id}
    grammar.reset()
    assert not grammar.is_terminated() and grammar.accept_tokens(tokenizer.encode("9", add_special_tokens=False))


def test_bitmask_by_hand():
    """Bit t % 32 of word t // 32: tokens 0, 33 and 69 of a 70-token vocabulary."""
    bitmask = torch.tensor([[1, 1 << 1, 1 << 5]], dtype=torch.int32)
    logits = torch.arange(140, dtype=torch.float32).reshape(2, 70)
    apply_token_bitmask(logits, bitmask, torch.tensor([1]))
    assert torch.equal(logits[0], torch.arange(70, dtype=torch.float32))
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [0, 33, 69]
    # The sign bit (token 31 of a word) is an int32's negative values.
    logits = torch.zeros(1, 32)
    apply_token_bitmask(logits, torch.tensor([[-(1 << 31)]], dtype=torch.int32), torch.tensor([0]))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [31]


def test_bitmask_on_random_words_against_shifts():
    """Every bit of random words, unpacked by shifting in the test, against the table lookup."""
    generator = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, 40), dtype=torch.int32, generator=generator)
    logits = torch.randn(7, 40 * 32 - 13, generator=generator)
    rows = torch.tensor([6, 0, 3, 2, 5])
    expected = logits.clone()
    for i, row in enumerate(rows.tolist()):
        for t in range(logits.shape[1]):
            if not (int(bitmask[i, t // 32]) >> (t % 32)) & 1:
                expected[row, t] = float("-inf")
    apply_token_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, expected)


def test_auto_picks_xgrammar_then_llguidance_and_refuses_what_neither_takes():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    assert resolve_backend(StructuredOutputsParams(json=schema), "auto") == "xgrammar"
    # multipleOf: xgrammar would ignore it, llguidance enforces it.
    multiple = {"type": "integer", "multipleOf": 3}
    assert resolve_backend(StructuredOutputsParams(json=multiple), "auto") == "guidance"
    assert resolve_backend(StructuredOutputsParams(regex="a+", whitespace_pattern=" "), "auto") == "guidance"
    with pytest.raises(ValueError, match="xgrammar does not support: multipleOf"):
        resolve_backend(StructuredOutputsParams(json=multiple), "xgrammar")
    assert resolve_backend(StructuredOutputsParams(json=schema), "guidance") == "guidance"
    with pytest.raises(ValueError, match="uniqueItems"):
        resolve_backend(StructuredOutputsParams(json={"type": "array", "uniqueItems": True}), "auto")


@pytest.mark.parametrize("params, message", [
    (dict(json="{not json"), "not valid JSON"),
    (dict(json="[1, 2]"), "must be a JSON object"),
    (dict(regex="(unclosed"), "Invalid regex"),
    (dict(grammar="root ::= (\"a\""), "Invalid grammar"),
    (dict(json={"type": "object"}, regex="a"), "exactly one of"),
    (dict(), "exactly one of"),
    (dict(choice=[]), "exactly one of|non-empty list"),
])
def test_bad_constraints_are_refused(params, message):
    with pytest.raises(ValueError, match=message):
        resolve_backend(StructuredOutputsParams(**params), "auto")


def test_helpers_by_hand():
    params = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "object"}}},
                                     disable_additional_properties=True)
    assert json_schema(params) == {"type": "object", "additionalProperties": False,
                                   "properties": {"a": {"type": "object", "additionalProperties": False}}}
    assert choice_as_ebnf(['a"b', "c"]) == 'root ::= "a\\"b" | "c"'
    # The same schema as a dict or as text, keys in any order: one cache entry.
    text = StructuredOutputsParams(json='{"properties": {"a": {"type": "object"}}, "type": "object"}',
                                   disable_additional_properties=True)
    assert cache_key(params) == cache_key(text)
    assert cache_key(params) != cache_key(StructuredOutputsParams(json={"type": "object"}))
