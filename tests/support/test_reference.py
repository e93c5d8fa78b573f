"""Tests of the transformers reference harness itself (tests/support/reference.py), so that the
engine-vs-HF comparisons built on it cannot silently be wrong."""

from __future__ import annotations

import json

import pytest
import torch
from reference import (
    SMOLLM2_CHECK_MESSAGES,
    TINY_ARCHS,
    GreedyResult,
    build_tiny_model,
    check_logprobs_close,
    check_outputs_equal,
    hf_greedy,
    load_hf_model,
    smollm2_gguf_path,
    top2_logit_gaps,
)
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

VOCAB = 49152


def _random_prompts(n: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, VOCAB, (lengths[i % len(lengths)],), generator=g).tolist()
        for i in range(n)
    ]


def _safetensors_keys(model_dir) -> set[str]:
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


# ---------------------------------------------------------------------------------------------
# (a) hf_greedy agrees with transformers' own generate() and with its own logprobs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tiny_model_dir", ["llama", "qwen3"], indirect=True)
def test_hf_greedy_matches_generate_tiny(tiny_model_dir):
    model = load_hf_model(tiny_model_dir)
    prompts = _random_prompts(2, [5, 17], seed=1)
    n = 12
    results = hf_greedy(model, prompts, max_new_tokens=n, top_k=5)
    assert len(results) == len(prompts)
    for prompt, res in zip(prompts, results, strict=True):
        out = model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=n, eos_token_id=None
        )
        ref = out[0, len(prompt) :].tolist()
        assert len(ref) == n
        assert res.token_ids == ref
        _check_self_consistent(res, n, top_k=5)


def _check_self_consistent(res: GreedyResult, n: int, top_k: int) -> None:
    assert len(res.token_ids) == n and len(res.top_logprobs) == n
    for tok, top in zip(res.token_ids, res.top_logprobs, strict=True):
        assert len(top) == top_k
        assert all(isinstance(k, int) for k in top)
        assert all(v <= 0.0 for v in top.values())
        assert max(top, key=top.get) == tok  # the chosen token is the argmax of its logprobs


def test_hf_greedy_logprobs_match_full_recompute(make_tiny_model):
    """The KV-cache loop's logprobs equal a cache-free forward over prompt + generated prefix."""
    model = load_hf_model(make_tiny_model("qwen2"))
    prompt = _random_prompts(1, [9], seed=2)[0]
    (res,) = hf_greedy(model, [prompt], max_new_tokens=6, top_k=3)
    seq = prompt + res.token_ids
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    for i, top in enumerate(res.top_logprobs):
        row = logprobs[len(prompt) - 1 + i]
        assert int(row.argmax()) == res.token_ids[i]
        assert set(top) == set(row.topk(3).indices.tolist())
        for tok, lp in top.items():
            assert lp == pytest.approx(float(row[tok]), abs=1e-4)


def test_hf_greedy_prefill_chunks_give_the_whole_prompts_result(make_tiny_model):
    """A tiny Gemma 3 (windows of 16 tokens beside full layers), prompts of 1 to 70 tokens fed
    in chunks of 16 (a chunk's window reaches into the one before) and of 7: the tokens of the
    one-piece prefill, and its logprobs within float32's rounding."""
    model = load_hf_model(make_tiny_model("gemma3", head_dim=16, num_hidden_layers=4, sliding_window=16,
                                          layer_types=["sliding_attention", "full_attention"] * 2))
    prompts = _random_prompts(4, [1, 16, 33, 70], seed=3)
    whole = hf_greedy(model, prompts, max_new_tokens=6, top_k=3)
    for chunk in (16, 7):
        chunked = hf_greedy(model, prompts, max_new_tokens=6, top_k=3, prefill_chunk=chunk)
        for a, b in zip(whole, chunked, strict=True):
            assert a.token_ids == b.token_ids
            for top_a, top_b in zip(a.top_logprobs, b.top_logprobs, strict=True):
                assert top_a.keys() == top_b.keys()
                assert all(top_b[t] == pytest.approx(v, abs=1e-4) for t, v in top_a.items())


def test_hf_greedy_accepts_path_and_ignores_eos(smollm2_hf_dir):
    """SmolLM2 answers the chat prompt and emits <|im_end|> (id 2) early; hf_greedy must keep
    going for exactly max_new_tokens and still agree with generate(eos_token_id=None)."""
    tok = AutoTokenizer.from_pretrained(smollm2_hf_dir)
    prompt = list(
        tok.apply_chat_template(
            SMOLLM2_CHECK_MESSAGES, add_generation_prompt=True, return_dict=True
        )["input_ids"]
    )
    n = 24
    (res,) = hf_greedy(smollm2_hf_dir, [prompt], max_new_tokens=n)
    _check_self_consistent(res, n, top_k=5)
    assert tok.eos_token_id == 2
    assert 2 in res.token_ids[:-1], "expected SmolLM2 to emit <|im_end|> within the window"
    model = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32).eval()
    out = model.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=n, eos_token_id=None
    )
    assert out[0, len(prompt) :].tolist() == res.token_ids
    assert "4" in tok.decode(res.token_ids[: res.token_ids.index(2)])


def test_hf_greedy_rejects_empty_prompt(make_tiny_model):
    with pytest.raises(ValueError):
        hf_greedy(make_tiny_model("llama"), [[]], max_new_tokens=1)


# ---------------------------------------------------------------------------------------------
# (b) check_logprobs_close / check_outputs_equal
# ---------------------------------------------------------------------------------------------


def _lp(*ids: int) -> dict[int, float]:
    return {t: -0.1 * (i + 1) for i, t in enumerate(ids)}


def test_check_logprobs_close_identical():
    seq = ([5, 6, 7], [_lp(5, 9), _lp(6, 9), _lp(7, 9)])
    check_logprobs_close(outputs_0=[seq, seq], outputs_1=[seq, seq], name_0="a", name_1="b")
    res = GreedyResult(token_ids=seq[0], top_logprobs=seq[1])
    check_logprobs_close(outputs_0=[res], outputs_1=[seq], name_0="a", name_1="b")
    check_outputs_equal(outputs_0=[res], outputs_1=[seq], name_0="a", name_1="b")
    check_outputs_equal(outputs_0=[[5, 6, 7]], outputs_1=[seq], name_0="a", name_1="b")


def test_check_logprobs_close_tolerated_mismatch():
    # Position 1 differs (6 vs 8) but each is in the other's top-k; afterwards anything goes.
    out_0 = ([5, 6, 7, 1], [_lp(5), _lp(6, 8), _lp(7), _lp(1)])
    out_1 = ([5, 8, 3], [_lp(5), _lp(8, 6), _lp(3)])
    check_logprobs_close(outputs_0=[out_0], outputs_1=[out_1], name_0="hf", name_1="engine")
    with pytest.raises(AssertionError, match="position 1"):
        check_outputs_equal(outputs_0=[out_0], outputs_1=[out_1], name_0="hf", name_1="engine")


@pytest.mark.parametrize(
    "top_0, top_1",
    [
        (_lp(6, 8), _lp(8, 4)),  # 6 not in engine's top-k
        (_lp(6, 4), _lp(8, 6)),  # 8 not in hf's top-k
        (_lp(6), _lp(8)),  # neither
    ],
)
def test_check_logprobs_close_fails_outside_topk(top_0, top_1):
    out_0 = ([5, 6, 7], [_lp(5), top_0, _lp(7)])
    out_1 = ([5, 8, 7], [_lp(5), top_1, _lp(7)])
    ok = ([1], [_lp(1)])
    with pytest.raises(AssertionError) as exc:
        check_logprobs_close(
            outputs_0=[ok, out_0], outputs_1=[ok, out_1], name_0="hf", name_1="engine"
        )
    msg = str(exc.value)
    assert "prompt 1" in msg and "position 1" in msg and "6" in msg and "8" in msg


def test_check_logprobs_close_length_and_count():
    a = ([5, 6], [_lp(5), _lp(6)])
    b = ([5, 6, 7], [_lp(5), _lp(6), _lp(7)])
    with pytest.raises(AssertionError, match="generated"):
        check_logprobs_close(outputs_0=[a], outputs_1=[b], name_0="x", name_1="y")
    check_logprobs_close(
        outputs_0=[a], outputs_1=[b], name_0="x", name_1="y", require_same_length=False
    )
    with pytest.raises(AssertionError, match="outputs"):
        check_logprobs_close(outputs_0=[a], outputs_1=[a, a], name_0="x", name_1="y")
    with pytest.raises(AssertionError, match="generated"):
        check_outputs_equal(outputs_0=[a], outputs_1=[b], name_0="x", name_1="y")


def test_check_logprobs_close_on_real_outputs(make_tiny_model):
    """Two different random models diverge immediately with tokens outside each other's top-5."""
    prompts = _random_prompts(2, [6], seed=3)
    a = [r.as_output() for r in hf_greedy(make_tiny_model("llama"), prompts, 4)]
    b = [r.as_output() for r in hf_greedy(make_tiny_model("llama", seed=1), prompts, 4)]
    check_logprobs_close(outputs_0=a, outputs_1=a, name_0="a", name_1="a2")
    with pytest.raises(AssertionError):
        check_logprobs_close(outputs_0=a, outputs_1=b, name_0="seed0", name_1="seed1")


# ---------------------------------------------------------------------------------------------
# (c) the SmolLM2 export
# ---------------------------------------------------------------------------------------------


def test_smollm2_gguf_is_present():
    path = smollm2_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size > 50_000_000


def test_smollm2_export_layout(smollm2_hf_dir):
    files = {p.name for p in smollm2_hf_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    cfg = json.loads((smollm2_hf_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["model_type"] == "llama"
    assert cfg["dtype"] == "float32"
    assert cfg["tie_word_embeddings"] is True
    assert "quantization_config" not in cfg
    assert (cfg["hidden_size"], cfg["num_hidden_layers"]) == (576, 30)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (9, 3)
    assert cfg["vocab_size"] == VOCAB
    keys = _safetensors_keys(smollm2_hf_dir)
    assert "lm_head.weight" not in keys
    assert "model.embed_tokens.weight" in keys
    assert len(keys) == 2 + 9 * 30  # embed + final norm + 9 tensors per layer
    with safe_open(str(smollm2_hf_dir / "model.safetensors"), framework="pt") as f:
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "F32"


def test_smollm2_export_reloads_with_same_logits(smollm2_hf_dir, smollm2_gguf_logits):
    prompt_ids, gguf_logits = smollm2_gguf_logits
    model = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir).eval()
    assert model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt_ids])).logits.float()
    assert logits.shape == gguf_logits.shape == (1, len(prompt_ids), VOCAB)
    torch.testing.assert_close(logits, gguf_logits, rtol=0, atol=1e-4)


def test_smollm2_tokenizer(smollm2_hf_dir, tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(smollm2_hf_dir)
    assert len(tok) == VOCAB
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert tok.eos_token == "<|im_end|>"
    assert tok("Hello world")["input_ids"] == [19556, 905]  # no BOS is prepended
    text = "The quick brown fox, 123 ünïcödé 🙂\n  indented"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert rendered.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert rendered.startswith("<|im_start|>system\n")
    tok2 = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert tok2(text)["input_ids"] == tok(text)["input_ids"]


# ---------------------------------------------------------------------------------------------
# (d) tiny random models
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_model_builds_and_is_decisive(make_tiny_model, arch, tie):
    d = make_tiny_model(arch, tie_word_embeddings=tie)
    cfg = json.loads((d / "config.json").read_text())
    expected_cls = {
        "llama": "LlamaForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
    }
    assert cfg["architectures"] == [expected_cls[arch]]
    assert cfg["model_type"] == arch
    assert cfg["dtype"] == "float32"
    assert cfg["tie_word_embeddings"] is tie
    assert cfg["vocab_size"] == VOCAB
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]) == (64, 2, 128)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 16)
    assert cfg["rope_parameters"]["rope_theta"] == 10000.0
    assert (d / "tokenizer.json").is_file() and (d / "chat_template.jinja").is_file()

    keys = _safetensors_keys(d)
    assert ("lm_head.weight" in keys) is (not tie)
    assert ("model.layers.0.self_attn.q_proj.bias" in keys) is (arch == "qwen2")
    assert ("model.layers.0.self_attn.q_norm.weight" in keys) is (arch == "qwen3")

    model = AutoModelForCausalLM.from_pretrained(d).eval()
    assert type(model).__name__ == expected_cls[arch]
    assert model.dtype == torch.float32
    # Norm weights are random, not all ones, so an engine that skips loading them is caught.
    assert not torch.allclose(model.model.norm.weight, torch.ones_like(model.model.norm.weight))

    ids = torch.tensor(_random_prompts(4, [32], seed=4))
    gaps = top2_logit_gaps(model, ids)
    assert gaps.numel() == 128
    assert (gaps < 1e-3).float().mean().item() <= 0.03
    assert gaps.median().item() > 0.05
    # Greedy output is not a degenerate single repeated token.
    (res,) = hf_greedy(model, [ids[0, :8].tolist()], max_new_tokens=16)
    assert len(set(res.token_ids)) > 4


def test_tiny_model_is_deterministic_and_seed_dependent(tmp_path, tokenizer_dir):
    a = build_tiny_model(tmp_path / "a", "llama", tokenizer_dir, seed=7)
    b = build_tiny_model(tmp_path / "b", "llama", tokenizer_dir, seed=7)
    c = build_tiny_model(tmp_path / "c", "llama", tokenizer_dir, seed=8)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}


def test_tiny_model_rope_scaling_and_legacy_config(tmp_path, tokenizer_dir):
    """rope_scaling overrides land in config.json, change the model, and the transformers-4.x
    style config.json (top-level rope_theta / rope_scaling, torch_dtype) reloads identically."""
    v5 = build_tiny_model(tmp_path / "v5", "llama", tokenizer_dir, rope_scaling=LLAMA3_ROPE)
    legacy = build_tiny_model(
        tmp_path / "legacy", "llama", tokenizer_dir, rope_scaling=LLAMA3_ROPE, config_style="legacy"
    )
    plain = build_tiny_model(tmp_path / "plain", "llama", tokenizer_dir)

    cfg_v5 = json.loads((v5 / "config.json").read_text())
    assert cfg_v5["rope_parameters"] == {**LLAMA3_ROPE, "rope_theta": 10000.0}
    cfg_legacy = json.loads((legacy / "config.json").read_text())
    assert "rope_parameters" not in cfg_legacy and "dtype" not in cfg_legacy
    assert cfg_legacy["torch_dtype"] == "float32"
    assert cfg_legacy["rope_theta"] == 10000.0
    assert cfg_legacy["rope_scaling"] == LLAMA3_ROPE
    cfg_plain = json.loads(
        (
            build_tiny_model(tmp_path / "pl", "qwen3", tokenizer_dir, config_style="legacy")
            / "config.json"
        ).read_text()
    )
    assert cfg_plain["rope_scaling"] is None and cfg_plain["rope_theta"] == 10000.0

    m_v5, m_legacy, m_plain = (load_hf_model(d) for d in (v5, legacy, plain))
    assert m_legacy.config.rope_parameters == m_v5.config.rope_parameters
    # Positions beyond the original context: scaled rope must differ from plain rope.
    ids = torch.tensor(_random_prompts(1, [300], seed=5))
    with torch.inference_mode():
        l_v5, l_legacy, l_plain = (m(input_ids=ids).logits for m in (m_v5, m_legacy, m_plain))
    torch.testing.assert_close(l_legacy, l_v5, rtol=0, atol=0)
    assert (l_v5 - l_plain).abs().max().item() > 1e-2


def test_build_tiny_model_rejects_unknown_arch(tmp_path, tokenizer_dir):
    with pytest.raises(ValueError, match="unknown arch"):
        build_tiny_model(tmp_path / "x", "gpt2", tokenizer_dir)
