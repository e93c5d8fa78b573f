"""msgpack (msgspec) encoding of engine messages, with numpy arrays shipped as raw buffers.

Logprobs travel as arrays, not lists of Python floats: an array becomes one msgpack extension
holding its dtype, shape and bytes, and is decoded as a zero-copy numpy view of the message.
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec
import numpy as np

_NDARRAY_EXT = 1


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        header = msgspec.msgpack.encode((obj.dtype.str, obj.shape))
        return msgspec.msgpack.Ext(_NDARRAY_EXT, struct.pack("<I", len(header)) + header + obj.tobytes())
    raise NotImplementedError(f"Cannot serialize {type(obj).__name__}")


def _ext_hook(code: int, data: memoryview) -> Any:
    if code != _NDARRAY_EXT:
        raise NotImplementedError(f"Unknown msgpack extension {code}")
    (header_len,) = struct.unpack_from("<I", data)
    dtype, shape = msgspec.msgpack.decode(data[4 : 4 + header_len])
    return np.frombuffer(data[4 + header_len :], dtype=np.dtype(dtype)).reshape(shape)


class MsgpackEncoder:
    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)

    def encode(self, obj: Any) -> bytes:
        return self._encoder.encode(obj)


class MsgpackDecoder:
    def __init__(self, type_: Any = Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(type_, ext_hook=_ext_hook)

    def decode(self, data: bytes | memoryview) -> Any:
        return self._decoder.decode(data)
