"""Tokenizers for the front end (input processing, detokenization, chat templates): an HF
directory's through transformers' AutoTokenizer, a GGUF file's built from its metadata without
importing torch (transformers' PreTrainedTokenizerFast does not; its AutoTokenizer does).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from minivllm.transformers_utils.gguf_utils import GGUFFile, open_gguf


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
_SPACE = "\u2581"  # SentencePiece's spelling of " "
# Gemma's SentencePiece vocabularies: merges ranked by file order, no prefix space.
_GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")

# Gemma 3's turn format, for GGUFs that carry no template: <bos>, then each turn as
# <start_of_turn>{user|model}\n{text}<end_of_turn>\n. Gemma has no system role: a system message
# becomes the head of the first user turn, as Gemma 3's own template writes it.
_GEMMA_CHAT_TEMPLATE = """\
{%- macro text(content, strip) -%}
  {%- if content is string -%}{{- content | trim if strip else content -}}
  {%- else -%}
    {%- for part in content if part.type == 'text' -%}{{- part.text | trim if strip else part.text -}}{%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{%- set has_system = messages and messages[0].role == 'system' -%}
{%- set turns = messages[1:] if has_system else messages -%}
{{- bos_token -}}
{%- for message in turns -%}
  {%- if (message.role == 'user') != (loop.index0 is even) -%}
    {{- raise_exception('Gemma turns must alternate user, assistant, user, ... (after an optional system message)') -}}
  {%- endif -%}
  {{- '<start_of_turn>' ~ ('model' if message.role == 'assistant' else message.role) ~ '\\n' -}}
  {%- if loop.first and has_system -%}{{- text(messages[0].content, false) ~ '\\n\\n' -}}{%- endif -%}
  {{- text(message.content, true) ~ '<end_of_turn>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}
"""
_DEFAULT_CHAT_TEMPLATES = {"gemma3": _GEMMA_CHAT_TEMPLATE}
# The token that ends a chat turn where it is not the GGUF's EOS: Gemma's generation_config stops
# on both <eos> and <end_of_turn>, but a GGUF records a single eos_token_id.
_END_OF_TURN_TOKENS = {"gemma3": "<end_of_turn>"}


class GGUFTokenizer(PreTrainedTokenizerFast):
    """A PreTrainedTokenizerFast that takes its backend as is: `tokenizer_object=` deep-copies it,
    which costs ~1.3 s for a 262k-token vocabulary (Gemma 3)."""

    def __init__(self, backend: Tokenizer, **kwargs: Any) -> None:
        self._tokenizer = backend
        super().__init__(**kwargs)


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE vocabularies are spelled in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def load_gguf_tokenizer(path: str) -> GGUFTokenizer:
    """A fast tokenizer built from the vocabulary, merges and special ids in the GGUF metadata.

    Built directly with `tokenizers` in about a second (two for Gemma 3's 262k tokens), where
    transformers' GGUF conversion takes ~8 s (~20 s for Gemma 3); it encodes and decodes as that
    conversion does (for `smollm` it also splits digits, as llama.cpp and SmolLM2's own
    tokenizer.json do, which gives the same ids on SmolLM2's vocabulary).
    """
    file = open_gguf(path)
    kind = file.get("tokenizer.ggml.model")
    builders = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}
    if kind not in builders:
        raise ValueError(f"Unsupported GGUF tokenizer model {kind!r}; supported: 'gpt2' (byte-level "
                         "BPE), 'llama' (SentencePiece BPE)")
    tokens = file.get("tokenizer.ggml.tokens")
    special = {name: tokens[i] for name, key in (("bos_token", "bos"), ("eos_token", "eos"),
                                                 ("unk_token", "unknown"), ("pad_token", "padding"))
               if (i := file.get(f"tokenizer.ggml.{key}_token_id")) is not None}
    arch = file.get("general.architecture")
    return GGUFTokenizer(
        builders[kind](file),
        # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise.
        add_bos_token=file.get("tokenizer.ggml.add_bos_token", kind == "llama"),
        add_eos_token=file.get("tokenizer.ggml.add_eos_token", False),
        chat_template=file.get("tokenizer.chat_template") or _DEFAULT_CHAT_TEMPLATES.get(arch),
        **special,
    )


def _typed_tokens(file: GGUFFile, token_type: int) -> list[str]:
    tokens = file.get("tokenizer.ggml.tokens")
    types = file.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    return [tok for tok, t in zip(tokens, types, strict=True) if t == token_type]


def _add_whole_tokens(backend: Tokenizer, control: list[str], user_defined: list[str]) -> None:
    """Control tokens are matched whole and dropped by skip_special_tokens; user-defined ones (e.g.
    Qwen3's <think>) are matched whole but kept in decoded text, as in the models' tokenizer.json."""
    backend.add_special_tokens([AddedToken(tok, special=True, normalized=False) for tok in control])
    backend.add_tokens([AddedToken(tok, special=False, normalized=False) for tok in user_defined])


def _byte_level_bpe(file: GGUFFile) -> Tokenizer:
    pre = file.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_SPLITS:
        raise ValueError(f"Unsupported GGUF pre-tokenizer {pre!r}; supported: "
                         f"{', '.join(_PRE_SPLITS)}")
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    # Some converters store tokens as raw text; re-spell those in the byte alphabet BPE works in.
    vocab = {tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode()): i
             for i, tok in enumerate(file.get("tokenizer.ggml.tokens"))}
    merges = [tuple(m.split(" ", 1)) for m in file.get("tokenizer.ggml.merges", [])]
    backend = Tokenizer(models.BPE(vocab, merges))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _PRE_SPLITS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    # A control token outside the byte alphabet is a llama.cpp mislabel and is left alone, as
    # transformers does.
    _add_whole_tokens(backend, [tok for tok in _typed_tokens(file, _CONTROL) if set(tok) <= alphabet],
                      _typed_tokens(file, _USER_DEFINED))
    return backend


def _sentencepiece_bpe(file: GGUFFile) -> Tokenizer:
    """SentencePiece BPE: spaces spelled "▁", pieces merged best-ranked first, and characters
    outside the vocabulary spelled as <0xXX> byte tokens.

    The file has no merges, only ranked pieces: each split of a piece into two pieces is a merge,
    ranked by the piece it makes. Gemma's scores do not follow its merge order, its file order
    does (and it has no prefix space); other vocabularies rank by score.
    """
    gemma = file.get("general.architecture") in _GEMMA_ARCHITECTURES
    # Gemma's runs of spaces (user-defined tokens) are stored as raw spaces, which BPE never sees
    # once spaces are spelled "▁": respelled, BPE reaches them (and they are not matched whole).
    tokens = [_SPACE * len(tok) if gemma and tok and tok.strip(" ") == "" else tok
              for tok in file.get("tokenizer.ggml.tokens")]
    ranks = [-i for i in range(len(tokens))] if gemma else file.get("tokenizer.ggml.scores")
    # A character with no piece and no byte tokens becomes <unk>, as in llama.cpp (transformers'
    # Llama tokenizer drops it); with the 256 byte tokens of real vocabularies it never happens.
    unk = file.get("tokenizer.ggml.unknown_token_id")
    backend = Tokenizer(models.BPE({tok: i for i, tok in enumerate(tokens)}, _merges(tokens, ranks),
                                   unk_token=None if unk is None else tokens[unk], fuse_unk=True,
                                   byte_fallback=True))
    prefix = file.get("tokenizer.ggml.add_space_prefix", not gemma)
    if gemma:
        # No pre-tokenizer: the text between added tokens is one word, as SentencePiece sees it.
        backend.normalizer = normalizers.Replace(" ", _SPACE)
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            _SPACE, prepend_scheme="first" if prefix else "never", split=False)
    backend.decoder = decoders.Sequence(
        [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    vocab = set(tokens)
    _add_whole_tokens(backend, _typed_tokens(file, _CONTROL),
                      [tok for tok in _typed_tokens(file, _USER_DEFINED) if tok in vocab])
    return backend


def _merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every way to make a piece from two pieces, best score first.

    Ties are broken as transformers' `generate_merges` does, so that the ids match it exactly:
    longer left part, then longer right part, then file order. ~1 s for 262k pieces.
    """
    score_of = dict(zip(tokens, scores, strict=True))
    candidates = []
    for piece, score in score_of.items():
        for cut in range(len(piece) - 1, 0, -1):
            left = piece[:cut]
            if left in score_of and (right := piece[cut:]) in score_of:
                candidates.append((-score, -cut, cut - len(piece), left, right))
    candidates.sort(key=lambda c: c[:3])
    return [(left, right) for *_, left, right in candidates]


def extra_eos_token_ids(tokenizer_path: str) -> list[int]:
    """Ids that end generation besides the tokenizer's EOS, as a model's generation_config lists
    them: a GGUF's end-of-turn token (`tokenizer.ggml.eot_token_id`, or Gemma's <end_of_turn>),
    without which a chat reply runs on past its turn."""
    if not tokenizer_path.endswith(".gguf"):
        return []
    file = open_gguf(tokenizer_path)
    eot = file.get("tokenizer.ggml.eot_token_id")
    marker = _END_OF_TURN_TOKENS.get(file.get("general.architecture"))
    tokens = file.get("tokenizer.ggml.tokens") or []
    if eot is None and marker in tokens:
        eot = tokens.index(marker)
    return [] if eot is None or eot == file.get("tokenizer.ggml.eos_token_id") else [eot]
