"""The input-grounded benchmark workload: each prompt asks an instruct model to repeat a passage
(prose built from fixed word lists, or a small Python file) with one small edit, so most of the
reply copies the prompt. This is the workload where n-gram (prompt lookup) speculation hits."""

from __future__ import annotations

import argparse
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

GROUNDED_KINDS = ("prose", "code", "mixed")

_ADJECTIVES = ("quiet", "old", "bright", "narrow", "heavy", "gentle", "distant", "green", "careful",
               "small", "wooden", "patient", "early", "warm", "silent", "busy", "broken", "golden")
_NOUNS = ("engineer", "bridge", "river", "garden", "teacher", "market", "window", "forest", "doctor",
          "kitchen", "island", "village", "letter", "station", "painter", "harbor", "library", "farmer")
_VERBS = ("repaired", "visited", "painted", "watched", "carried", "opened", "measured", "cleaned",
          "described", "followed", "found", "moved", "built", "checked", "sold", "studied")
_ADVERBS = ("slowly", "quickly", "carefully", "quietly", "twice", "again", "early", "together")
_PLACES = ("the hill", "the old road", "the city", "the coast", "the valley", "the square", "the mill")
_TIMES = ("dawn", "noon", "the storm", "the winter", "the holiday", "sunset", "the meeting")
_NAMES = ("Anna", "Tomas", "Mira", "Jonah", "Lena", "Oskar", "Priya", "Hugo", "Selma", "Ravi")
# Replacement words, disjoint from every list above, so the edit is never already in the passage.
_REPLACEMENTS = ("lantern", "violin", "compass", "blanket", "saddle", "kettle", "anchor", "ribbon",
                 "meadow", "tunnel", "orchard", "glacier")

_FN_VERBS = ("compute", "scale", "merge", "count", "update", "clamp", "blend", "shift", "score", "split",
             "normalize", "accumulate", "estimate", "filter")
_FN_NOUNS = ("total", "weight", "offsets", "prices", "window", "balance", "ratio", "buckets", "margin",
             "average", "steps", "budget", "tokens", "scores")
_FN_NEW = ("transform", "reduce", "resolve", "combine", "adjust", "convert")  # never in _FN_VERBS
_PARAMS = ("x", "y", "count", "width", "height", "rate", "offset", "limit", "step", "base", "value", "size")


@dataclass
class GroundedPrompt:
    passage: str
    instruction: str
    old: str  # the word or function name the reply must change
    new: str  # what it must become

    @property
    def content(self) -> str:
        """The user message: the instruction, then the passage (code in a fenced block)."""
        if "def " in self.passage:
            return f"{self.instruction}\n\n```python\n{self.passage}\n```"
        return f"{self.instruction}\n\n{self.passage}"


def add_grounded_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--grounded-kind", choices=GROUNDED_KINDS, default="mixed",
                        help="Passages of the grounded dataset: prose, Python code, or mixed (prompts "
                             "alternate, prose first).")


def _sentence(rng: random.Random) -> str:
    adj, adj2 = rng.sample(_ADJECTIVES, 2)
    noun, noun2 = rng.sample(_NOUNS, 2)
    verb, name = rng.choice(_VERBS), rng.choice(_NAMES)
    templates = (
        f"The {adj} {noun} {verb} the {adj2} {noun2} near {rng.choice(_PLACES)}.",
        f"{name} {verb} {'an' if adj[0] in 'aeiou' else 'a'} {adj} {noun} before {rng.choice(_TIMES)}.",
        f"In {rng.choice(_PLACES)}, the {noun} {verb} the {noun2} {rng.choice(_ADVERBS)}.",
        f"After {rng.choice(_TIMES)}, {name} and the {adj} {noun} {verb} {rng.randint(2, 99)} {noun2}s.",
        f"Every {noun} near the {adj} {noun2} was {verb} {rng.choice(_ADVERBS)} by {name}.",
    )
    return rng.choice(templates)


def _function(rng: random.Random, name: str) -> str:
    a, b, var = rng.sample(_PARAMS, 3)
    k1, k2, k3, k4 = (rng.randint(2, 97) for _ in range(4))
    verb, noun = name.split("_", 1)
    doc = f'    """{verb.capitalize()} the {noun} from {a} and {b}."""'
    bodies = (
        [f"    {var} = {a} * {k1} + {b}", f"    if {var} > {k2}:", f"        {var} -= {b} // {k3}",
         f"    return {var} % {k4}"],
        [f"    {var} = 0", f"    for i in range({a}):", f"        {var} += (i * {k1} + {b}) % {k2}",
         f"    return {var} // {k3}"],
        [f"    {var} = [{a} + i * {b} for i in range({k1 % 9 + 2})]",
         f"    return sum({var}) / max(len({var}), 1) - {k2}"],
        [f"    {var} = math.sqrt(abs({a} * {a} - {b} * {k1}))", f"    if {var} < {k2}:",
         f"        return {var}", f"    return round({var} / {k3}, 2)"],
    )
    return "\n".join([f"def {name}({a}, {b}):", doc, *rng.choice(bodies)])


def _fill(make: Callable[[], str], count: Callable[[str], int], num_tokens: int) -> list[str]:
    """Units from `make` until their token count is nearest `num_tokens` (at least one)."""
    units: list[str] = []
    total = 0
    while True:
        unit = make()
        n = count(unit)
        if units and total + n / 2 > num_tokens:
            return units
        units.append(unit)
        total += n


def _prose(rng: random.Random, num_tokens: int, count: Callable[[str], int]) -> GroundedPrompt:
    sentences = _fill(lambda: _sentence(rng), lambda s: count(" " + s), num_tokens)
    # Paragraphs of five sentences.
    passage = "\n\n".join(" ".join(sentences[i : i + 5]) for i in range(0, len(sentences), 5))
    old = rng.choice(sorted({w for w in _NOUNS if f" {w} " in f" {passage} "}))
    new = rng.choice(_REPLACEMENTS)
    instruction = (f'Repeat the following passage word for word, but replace every "{old}" with "{new}". '
                   "Output only the passage.")
    return GroundedPrompt(passage, instruction, old, new)


def _code(rng: random.Random, num_tokens: int, count: Callable[[str], int]) -> GroundedPrompt:
    ids = itertools.count()
    names = rng.sample([f"{v}_{n}" for v in _FN_VERBS for n in _FN_NOUNS], k=len(_FN_VERBS) * len(_FN_NOUNS))
    header = f'"""Helpers for {rng.choice(_FN_NOUNS)} and {rng.choice(_FN_NOUNS)}."""\n\nimport math'
    functions = _fill(lambda: _function(rng, names[next(ids)]), lambda f: count("\n\n\n" + f),
                      num_tokens - count(header))
    old = rng.choice(names[: len(functions)])
    new = f"{rng.choice(_FN_NEW)}_{old.split('_', 1)[1]}"
    instruction = f"Rewrite the following code exactly, but rename the function {old} to {new}. Output only the code."
    return GroundedPrompt("\n\n\n".join([header, *functions]), instruction, old, new)


def grounded_prompt(rng: random.Random, kind: str, num_tokens: int, tokenizer: Any) -> GroundedPrompt:
    """A passage of about `num_tokens` tokens of `kind` ("prose" or "code") and its instruction."""

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    return (_prose if kind == "prose" else _code)(rng, num_tokens, count)


def render(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """The chat template's text for `messages`, ready for the assistant's reply."""
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def prompt_overhead(tokenizer: Any, kind: str) -> int:
    """Tokens a rendered prompt of `kind` has besides its passage (template and instruction)."""
    stand_in = GroundedPrompt("def f():" if kind == "code" else "", _STAND_IN_INSTRUCTIONS[kind], "", "")
    text = render(tokenizer, [{"role": "user", "content": stand_in.content}])
    return len(tokenizer.encode(text, add_special_tokens=False))


# Of the same length as real instructions, to measure the prompt around a passage.
_STAND_IN_INSTRUCTIONS = {
    "prose": 'Repeat the following passage word for word, but replace every "village" with "lantern". '
             "Output only the passage.",
    "code": "Rewrite the following code exactly, but rename the function compute_total to transform_total. "
            "Output only the code.",
}
