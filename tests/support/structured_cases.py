"""Constraints shared by the structured-output tests, each with an independent check of an
output (jsonschema, re.fullmatch, a parser written here)."""

from __future__ import annotations

import json
import re

import jsonschema

FLAT = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                         "ok": {"type": "boolean"}}, "required": ["name", "ok"]}
NESTED = {"type": "object", "properties": {
    "user": {"type": "object", "properties": {"id": {"type": "integer"}, "tags": {
        "type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}}, "required": ["id", "tags"]},
    "scores": {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 3}},
    "required": ["user", "scores"]}
ENUM = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                         "size": {"type": "string", "enum": ["S", "M", "L"]}},
        "required": ["color", "size"]}
OPTIONAL = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 5}},
            "required": ["a"]}
BOUNDED = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 99},
                                            "n": {"type": "integer", "minimum": -5, "maximum": 5}},
           "required": ["age", "n"]}
PATTERN = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
           "required": ["code"]}
RECURSIVE = {"$defs": {"node": {"type": "object", "properties": {
    "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
    "required": ["v"]}}, "$ref": "#/$defs/node"}
SCHEMAS = {"flat": FLAT, "nested": NESTED, "enum": ENUM, "optional": OPTIONAL, "bounded": BOUNDED,
           "pattern": PATTERN, "recursive": RECURSIVE}

PHONE = r"\(\d{3}\) \d{3}-\d{4}"
CHOICES = ["positive", "negative", "neutral"]
# Sums and products of integers, with parentheses.
ARITHMETIC = r'''root ::= expr
expr ::= term ("+" term)*
term ::= factor ("*" factor)*
factor ::= [0-9]+ | "(" expr ")"'''


# Real-model instructions for SCHEMAS (the schema itself follows each in the prompt).
INSTRUCTIONS = {
    "flat": "Give a user's name and whether the account is ok, as JSON.",
    "nested": "Give a user with an id, up to three short tags, and one to three scores, as JSON.",
    "enum": "Pick a T-shirt colour (red, green or blue) and size (S, M or L), as JSON.",
    "optional": "Give a number a, and optionally a short word b, as JSON.",
    "bounded": "Give an adult's age and a small number n between -5 and 5, as JSON.",
    "pattern": "Give a product code like AB-123, as JSON.",
    "recursive": 'Copy this tree exactly: {"v": 1, "kids": [{"v": 2}, {"v": 3}]}',
}
SYSTEM = {"role": "system", "content": "You are a helpful assistant who answers in the format asked."}


def conversation(text: str) -> list[dict[str, str]]:
    return [SYSTEM, {"role": "user", "content": text}]


def schema_prompt(name: str) -> list[dict[str, str]]:
    return conversation(f"{INSTRUCTIONS[name]} Schema: {json.dumps(SCHEMAS[name])}")


def check_json(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


def check_regex(text: str) -> None:
    assert re.fullmatch(PHONE, text), text


def parse_arithmetic(text: str) -> int:
    """Recursive descent over ARITHMETIC's language; its value (an error if text is not in it)."""
    pos = 0

    def expr() -> int:
        nonlocal pos
        value = term()
        while pos < len(text) and text[pos] == "+":
            pos += 1
            value += term()
        return value

    def term() -> int:
        nonlocal pos
        value = factor()
        while pos < len(text) and text[pos] == "*":
            pos += 1
            value *= factor()
        return value

    def factor() -> int:
        nonlocal pos
        start = pos
        while pos < len(text) and text[pos].isdigit():
            pos += 1
        if pos > start:
            return int(text[start:pos])
        assert pos < len(text) and text[pos] == "(", text
        pos += 1
        value = expr()
        assert pos < len(text) and text[pos] == ")", text
        pos += 1
        return value

    value = expr()
    assert pos == len(text), text
    return value
