"""Small helpers every layer of the engine uses; torch-free, so core/ may import them."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of `b` tokens hold `a` tokens."""
    return -(-a // b)
