"""Tokenizers for the front end (input processing, detokenization, chat templates): an HF
directory's through transformers' AutoTokenizer, a GGUF file's built from its metadata without
importing torch (transformers' PreTrainedTokenizerFast does not; its AutoTokenizer does).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from minivllm.transformers_utils.gguf_utils import open_gguf


def get_tokenizer(tokenizer_path: str) -> Any:
    if tokenizer_path.endswith(".gguf"):
        return load_gguf_tokenizer(tokenizer_path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)


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


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE vocabularies are spelled in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def load_gguf_tokenizer(path: str) -> PreTrainedTokenizerFast:
    """A fast tokenizer built from the vocabulary, merges and special ids in the GGUF metadata.

    Built directly with `tokenizers` in under a second, where transformers' GGUF conversion takes
    ~8 s; it encodes and decodes as that conversion does (for `smollm` it also splits digits, as
    llama.cpp and SmolLM2's own tokenizer.json do, which gives the same ids on SmolLM2's vocabulary).
    """
    file = open_gguf(path)
    kind = file.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"Unsupported GGUF tokenizer model {kind!r}; only 'gpt2' (byte-level BPE) "
                         "is supported")
    pre = file.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_SPLITS:
        raise ValueError(f"Unsupported GGUF pre-tokenizer {pre!r}; supported: "
                         f"{', '.join(_PRE_SPLITS)}")
    tokens = file.get("tokenizer.ggml.tokens")
    token_types = file.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    # Some converters store tokens as raw text; re-spell those in the byte alphabet BPE works in.
    vocab = {tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode()): i
             for i, tok in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in file.get("tokenizer.ggml.merges", [])]
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
               if (i := file.get(f"tokenizer.ggml.{key}_token_id")) is not None}
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        add_bos_token=file.get("tokenizer.ggml.add_bos_token", False),
        add_eos_token=file.get("tokenizer.ggml.add_eos_token", False),
        chat_template=file.get("tokenizer.chat_template"),
        **special,
    )
