"""Block hashes for prefix caching: a full block is identified by everything that shaped its KV.

A block's hash chains its parent block's hash, its own token ids, and extra keys that change the
KV without changing the tokens (a per-request cache salt; later LoRA ids or multimodal inputs).
Two requests share a block only if their hashes agree, which, through the chain, means the
whole prefix up to and including that block is identical. Only full blocks are hashed.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from minivllm.core.request import Request

BlockHash = bytes | int
HashFn = Callable[[BlockHash | None, Sequence[int], tuple[Any, ...]], BlockHash]


def sha256_block_hash(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple[Any, ...]) -> bytes:
    """Collision-resistant: SHA-256 over a canonical byte encoding (the default)."""
    h = hashlib.sha256()
    h.update(parent if isinstance(parent, bytes) else b"\x00" * 32)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def builtin_block_hash(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple[Any, ...]) -> int:
    """Fast but only 64 bits and not collision-resistant: Python's tuple hash."""
    return hash((parent, tuple(token_ids), extra_keys))


HASH_FUNCTIONS: dict[str, HashFn] = {"sha256": sha256_block_hash, "builtin": builtin_block_hash}


def get_hash_fn(name: str) -> HashFn:
    if name not in HASH_FUNCTIONS:
        raise ValueError(f"Unknown prefix caching hash algorithm {name!r}; choose from {sorted(HASH_FUNCTIONS)}.")
    return HASH_FUNCTIONS[name]


def update_block_hashes(request: Request, block_size: int, hash_fn: HashFn) -> list[BlockHash]:
    """Extend `request.block_hashes` to cover every full block of its known tokens."""
    hashes = request.block_hashes
    tokens = request.all_token_ids
    for i in range(len(hashes), len(tokens) // block_size):
        parent = hashes[-1] if hashes else None
        # NOTE: the salt goes into the first block only; the chain carries it to the rest.
        extra = (request.cache_salt,) if i == 0 and request.cache_salt is not None else ()
        hashes.append(hash_fn(parent, tokens[i * block_size : (i + 1) * block_size], extra))
    return hashes
