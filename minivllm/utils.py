"""Small helpers every layer of the engine uses; torch-free, so core/ may import them."""

from __future__ import annotations

import socket


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of `b` tokens hold `a` tokens."""
    return -(-a // b)


def get_open_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now (the kernel's choice for port 0)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
