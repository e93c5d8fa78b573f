"""Load a GGUF model's weights as HF-named tensors: dequantized, in the model's dtype, for the
model, and the raw Q4_1 / Q8_0 codes for the CPU kernels that run on them.

The engine's model code is written against Hugging Face checkpoints, so the tensors are renamed
(`blk.N.attn_q` -> `model.layers.N.self_attn.q_proj`) and undone from llama.cpp's conversion: the
Q/K rows put back from its rotary layout (llama), the 1 it adds to Gemma's norm weights taken off.
Any ggml type gguf's `dequantize` decodes loads (the float types, the legacy and K-quants, the
IQ types); the file's metadata, the config and the tokenizer come from
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
# Gemma 3's four norms per layer: there ffn_norm is the norm before the MLP, and the norms after
# attention and after the MLP have their own names.
_GEMMA3_LAYER_PARTS = {
    **_LAYER_PARTS, "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
}
_ARCH_LAYER_PARTS = {"gemma3": _GEMMA3_LAYER_PARTS}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Gemma's RMSNorm scales by (1 + weight); llama.cpp's converter stores 1 + weight, HF the weight.
_NORM_SHIFT = {"gemma3": -1.0}
# Elements dequantized at a time (as float32): the model-dtype tensor is filled in slices, so a
# large matrix (Gemma 3's 262144 x 640 embedding) never exists as a whole float32 copy.
_DEQUANTIZE_CHUNK = 1 << 22


class _Tensor(NamedTuple):
    """A GGUF tensor as stored: its name and ggml type, its shape in HF (row-major) order, and its
    bytes as gguf's `dequantize` takes them, one row of bytes per row of the tensor (a view of the
    file)."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


class _HFTensor(NamedTuple):
    """A GGUF tensor and what makes it its HF checkpoint counterpart: the HF name, `reorder` (puts
    anything laid out by output row, weights, biases and per-row quantization data alike, in HF's
    row order) and `shift` (added to every dequantized value, in float32)."""

    name: str
    tensor: _Tensor
    reorder: Callable[[torch.Tensor], torch.Tensor]
    shift: float


def _cannot_dequantize(gguf_name: str, type_name: str) -> ValueError:
    return ValueError(f"GGUF tensor {gguf_name} has type {type_name}, which minivllm cannot dequantize")


def _tensor(file: GGUFFile, info: GGUFTensorInfo) -> _Tensor:
    try:
        qtype = GGMLQuantizationType(info.ggml_type)
    except ValueError:  # a type newer than the installed gguf package
        raise _cannot_dequantize(info.name, f"#{info.ggml_type}") from None
    shape = tuple(reversed(info.shape))
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    data = np.frombuffer(file.buffer, np.uint8, math.prod(shape) * type_size // block_size, info.offset)
    return _Tensor(info.name, qtype, shape, data.reshape(quant_shape_to_byte_shape(shape, qtype)))


def _hf_name(gguf_name: str, layer_parts: dict[str, str]) -> str | None:
    """The HF checkpoint name for a GGUF tensor; None for tensors with no HF counterpart."""
    if gguf_name in _TOP_LEVEL:
        return _TOP_LEVEL[gguf_name]
    if gguf_name == "rope_freqs.weight":
        return None  # folded into the config's rope scaling
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match[2] not in layer_parts:
        raise ValueError(f"Unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{match[1]}.{layer_parts[match[2]]}.{match[3]}"


def _unpermute(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved rotary pairs -> HF's rotate-half halves).

    Same as transformers' `LlamaTensorProcessor._reverse_permute_weights`.
    """
    half = weight.shape[0] // n_heads // 2
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _hf_tensors(path: str) -> Iterator[_HFTensor]:
    """Each model tensor of the file, with what turns it into its HF checkpoint counterpart."""
    file = open_gguf(path)
    arch = gguf_architecture(file)
    heads = file.get(f"{arch}.attention.head_count")
    kv_heads = file.get(f"{arch}.attention.head_count_kv", heads)
    layer_parts = _ARCH_LAYER_PARTS.get(arch, _LAYER_PARTS)
    norm_shift = _NORM_SHIFT.get(arch, 0.0)
    for info in file.tensors:
        name = _hf_name(info.name, layer_parts)
        if name is None:
            continue
        tensor = _tensor(file, info)
        shift = norm_shift if info.name.endswith("norm.weight") else 0.0
        if arch == "llama" and info.name.endswith(("attn_q.weight", "attn_q.bias")):
            yield _HFTensor(name, tensor, lambda t: _unpermute(t, heads), shift)
        elif arch == "llama" and info.name.endswith(("attn_k.weight", "attn_k.bias")):
            yield _HFTensor(name, tensor, lambda t: _unpermute(t, kv_heads), shift)
        else:
            yield _HFTensor(name, tensor, lambda t: t, shift)


def _dequantize(tensor: _Tensor, shift: float, dtype: torch.dtype) -> torch.Tensor:
    """The tensor's values (plus `shift`) in `dtype`, dequantized a slice of rows at a time."""
    out = torch.empty(tensor.shape, dtype=dtype)
    rows = out.view(-1, tensor.shape[-1])
    data = tensor.data.reshape(rows.shape[0], -1)
    step = max(1, _DEQUANTIZE_CHUNK // rows.shape[1])
    for start in range(0, rows.shape[0], step):
        try:
            values = dequantize(data[start : start + step], tensor.qtype)
        except NotImplementedError:
            raise _cannot_dequantize(tensor.name, tensor.qtype.name) from None
        if shift:
            values = values + np.float32(shift)
        # F32 comes back as a view of the read-only file mapping, which torch will not wrap.
        rows[start : start + step] = torch.from_numpy(np.require(values, requirements="W"))
    return out


def iterate_gguf_weights(path: str, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor in `dtype`) pairs, the tensors of the model's HF safetensors checkpoint.

    Each tensor is dequantized from the memory map straight into `dtype` (the model's), so peak
    memory stays at the model's size plus one tensor, instead of holding a float32 copy of the
    whole model (or even of one large tensor).
    """
    for name, tensor, reorder, shift in _hf_tensors(path):
        yield name, reorder(_dequantize(tensor, shift, dtype))


def gguf_lm_head_q8_0(path: str) -> Q8_0Weight | None:
    """The matrix serving as lm_head (output.weight, else the tied token_embd.weight) as stored,
    when it is Q8_0. A Q8_0 block is 34 bytes: a float16 scale, then 32 int8 values."""
    file = open_gguf(path)
    infos = {t.name: t for t in file.tensors}
    info = infos.get("output.weight") or infos.get("token_embd.weight")
    if info is None or info.ggml_type != GGMLQuantizationType.Q8_0:
        return None
    return _q8_0(_tensor(file, info).data)


def _q8_0(raw: np.ndarray) -> Q8_0Weight:
    """Q8_0 rows as stored: a 34-byte block is a float16 scale, then 32 int8 values."""
    blocks = raw.reshape(raw.shape[0], -1, 34)
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    q = blocks[..., 2:].copy().view(np.int8).reshape(raw.shape[0], -1)
    return Q8_0Weight(torch.from_numpy(q), torch.from_numpy(scale))


def _q5_0_as_q8_0(tensor: _Tensor) -> Q8_0Weight:
    """A Q5_0 matrix as Q8_0, exactly: both are a float16 scale per 32 values times an integer
    (Q5_0's in [-16, 16), Q8_0's in [-128, 128)). The integers are read back from the dequantized
    values (scale * q is exact in float32). A Q5_0 block is 22 bytes: the scale, then the codes."""
    rows = tensor.data.shape[0]
    scale = tensor.data.reshape(rows, -1, 22)[..., 0:2].copy().view(np.float16)[..., 0]
    values = dequantize(tensor.data, tensor.qtype).reshape(rows, -1, 32)
    d = scale.astype(np.float32)[..., None]
    q = np.divide(values, d, out=np.zeros_like(values), where=d != 0)
    return Q8_0Weight(torch.from_numpy(np.rint(q).astype(np.int8).reshape(rows, -1)), torch.from_numpy(scale))


def iterate_gguf_q8_0(path: str) -> Iterator[tuple[str, Q8_0Weight]]:
    """(HF name, codes) for every linear layer's weight stored as Q8_0, or as Q5_0 (which Q8_0
    holds exactly), rows in HF order, for q8_0_linear at steps of few rows. The embedding and
    lm_head are not here (gguf_lm_head_q8_0)."""
    for name, tensor, reorder, _ in _hf_tensors(path):
        if not name.startswith("model.layers.") or not name.endswith(".weight"):
            continue
        if tensor.qtype == GGMLQuantizationType.Q8_0:
            codes = _q8_0(tensor.data)
        elif tensor.qtype == GGMLQuantizationType.Q5_0:
            codes = _q5_0_as_q8_0(tensor)
        else:
            continue
        yield name, Q8_0Weight(reorder(codes.q), reorder(codes.scale))


def iterate_gguf_q4_1(path: str) -> Iterator[tuple[str, Q4_1Weight]]:
    """(HF name, raw quantization) for every Q4_1 weight, rows in HF order. A Q4_1 block is 20
    bytes: float16 scale, float16 min, then 16 bytes whose low nibbles are values 0-15 and high
    nibbles values 16-31."""
    for name, tensor, reorder, _ in _hf_tensors(path):
        if tensor.qtype != GGMLQuantizationType.Q4_1:
            continue
        raw = tensor.data
        blocks = raw.reshape(raw.shape[0], -1, 20)
        scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        minimum = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        nibbles = blocks[..., 4:]
        q = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).reshape(raw.shape[0], -1).astype(np.int32)
        yield name, Q4_1Weight(reorder(torch.from_numpy(q)), reorder(torch.from_numpy(scale)),
                               reorder(torch.from_numpy(minimum)))
