"""Load a GGUF model's weights as HF-named tensors: float32 for the model, and the raw Q4_1 / Q8_0
codes for the CPU kernels that run on them.

The engine's model code is written against Hugging Face checkpoints, so the tensors are renamed
(`blk.N.attn_q` -> `model.layers.N.self_attn.q_proj`) and the Q/K rows put back from llama.cpp's
rotary layout. The file's metadata, the config and the tokenizer come from
transformers_utils/gguf_utils.py (torch-free: the front end reads them too).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from typing import NamedTuple

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quant_shape_to_byte_shape

from minivllm.model.layers.quant import Q4_1Weight, Q8_0Weight
from minivllm.transformers_utils.gguf_utils import (
    GGUFFile,
    GGUFTensorInfo,
    gguf_architecture,
    open_gguf,
)

_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_PARTS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class _Tensor(NamedTuple):
    """A GGUF tensor as stored: its ggml type, its shape in HF (row-major) order, and its bytes as
    gguf's `dequantize` takes them, one row of bytes per row of the tensor (a view of the file)."""

    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


def _tensor(file: GGUFFile, info: GGUFTensorInfo) -> _Tensor:
    qtype = GGMLQuantizationType(info.ggml_type)
    shape = tuple(reversed(info.shape))
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    data = np.frombuffer(file.buffer, np.uint8, math.prod(shape) * type_size // block_size, info.offset)
    return _Tensor(qtype, shape, data.reshape(quant_shape_to_byte_shape(shape, qtype)))


def _hf_name(gguf_name: str) -> str | None:
    """The HF checkpoint name for a GGUF tensor; None for tensors with no HF counterpart."""
    if gguf_name in _TOP_LEVEL:
        return _TOP_LEVEL[gguf_name]
    if gguf_name == "rope_freqs.weight":
        return None  # folded into the config's rope scaling
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match[2] not in _LAYER_PARTS:
        raise ValueError(f"Unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{match[1]}.{_LAYER_PARTS[match[2]]}.{match[3]}"


def _unpermute(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved rotary pairs -> HF's rotate-half halves).

    Same as transformers' `LlamaTensorProcessor._reverse_permute_weights`.
    """
    half = weight.shape[0] // n_heads // 2
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _hf_tensors(path: str) -> Iterator[tuple[str, _Tensor, Callable[[torch.Tensor], torch.Tensor]]]:
    """(HF name, GGUF tensor, fix) for each model tensor; `fix` undoes llama.cpp's Q/K row order
    on anything laid out by output row (weights, biases, per-row quantization data)."""
    file = open_gguf(path)
    arch = gguf_architecture(file)
    heads = file.get(f"{arch}.attention.head_count")
    kv_heads = file.get(f"{arch}.attention.head_count_kv", heads)
    for info in file.tensors:
        name = _hf_name(info.name)
        if name is None:
            continue
        tensor = _tensor(file, info)
        if arch == "llama" and info.name.endswith(("attn_q.weight", "attn_q.bias")):
            yield name, tensor, lambda t: _unpermute(t, heads)
        elif arch == "llama" and info.name.endswith(("attn_k.weight", "attn_k.bias")):
            yield name, tensor, lambda t: _unpermute(t, kv_heads)
        else:
            yield name, tensor, lambda t: t


def iterate_gguf_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, float32 tensor) pairs shaped as in the model's HF safetensors checkpoint.

    One tensor is dequantized at a time from the memory map, so peak memory stays at the model's
    float32 size plus one tensor, instead of holding a dequantized copy of the whole file.
    """
    for name, tensor, fix in _hf_tensors(path):
        array = dequantize(tensor.data, tensor.qtype)
        if not array.flags.writeable:  # F32 comes back as a view of the read-only file mapping
            array = array.copy()
        yield name, fix(torch.from_numpy(array).reshape(tensor.shape))


def gguf_lm_head_q8_0(path: str) -> Q8_0Weight | None:
    """The matrix serving as lm_head (output.weight, else the tied token_embd.weight) as stored,
    when it is Q8_0. A Q8_0 block is 34 bytes: a float16 scale, then 32 int8 values."""
    file = open_gguf(path)
    infos = {t.name: t for t in file.tensors}
    info = infos.get("output.weight") or infos.get("token_embd.weight")
    if info is None or info.ggml_type != GGMLQuantizationType.Q8_0:
        return None
    raw = _tensor(file, info).data
    blocks = raw.reshape(raw.shape[0], -1, 34)
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    q = blocks[..., 2:].copy().view(np.int8).reshape(raw.shape[0], -1)
    return Q8_0Weight(torch.from_numpy(q), torch.from_numpy(scale))


def iterate_gguf_q4_1(path: str) -> Iterator[tuple[str, Q4_1Weight]]:
    """(HF name, raw quantization) for every Q4_1 weight, rows in HF order. A Q4_1 block is 20
    bytes: float16 scale, float16 min, then 16 bytes whose low nibbles are values 0-15 and high
    nibbles values 16-31."""
    for name, tensor, fix in _hf_tensors(path):
        if tensor.qtype != GGMLQuantizationType.Q4_1:
            continue
        raw = tensor.data
        blocks = raw.reshape(raw.shape[0], -1, 20)
        scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        minimum = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        nibbles = blocks[..., 4:]
        q = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).reshape(raw.shape[0], -1).astype(np.int32)
        yield name, Q4_1Weight(fix(torch.from_numpy(q)), fix(torch.from_numpy(scale)), fix(torch.from_numpy(minimum)))
