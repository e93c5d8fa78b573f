"""IncrementalDetokenizer: incremental text == full decode, stop strings, delta streaming.

The references are independent of the code under test: `tokenizer.decode` of the whole id
sequence, and hand-written expected strings. Three tokenizer families: SmolLM2's byte-level BPE
(read from the GGUF, the engine's default model) and two built here with `tokenizers`, both with
`▁` spaces and byte-fallback tokens (`<0xE2>`): a Llama-style BPE (Replace/ByteFallback/Fuse/Strip
decoder) and a Unigram with a Metaspace decoder whose transformers wrapper also applies
transformers' space clean-up (" ," -> ",").
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)

from minivllm.engine.detokenizer import IncrementalDetokenizer
from minivllm.sampling_params import SamplingParams

FFFD = "\ufffd"

TEXTS = [
    "Hello, world! How are you today?",
    "Family: 👩‍👩‍👧 and flags 🇫🇷🇯🇵🏳️‍🌈, thumbs 👍🏽 done.",
    "日本語のテキストと中文字符，还有한국어.",
    "Accents: café, naïve, résumé, Ångström, señor, Zürich, Œuvre, ǅ.",
    "Lines\n\n\tindented\r\n   three spaces   \n\n",
    "def f(x):\n    return {'a': [x ** 2 for x in range(10)]}  # squares\n",
    "mixed 😀é日 and a literal \ufffd in the middle",
    "He said , \" don 't stop ! \" and I 've been there ; isn 't it ?",
]
SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@dataclass
class Family:
    name: str
    tok: Any
    specials: list[str]  # e.g. ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    byte_level: bool  # byte-level BPE: full decode never rewrites text (exact at every step)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], skip: bool) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip)

    def chat_text(self) -> str:
        start, end, eot = self.specials
        return f"{start}user\nHi there 👋{end}\n{start}assistant\nHello, café!{end}{eot}"


# --- tokenizers -----------------------------------------------------------------------------------

_CORPUS = ["the quick brown fox jumps over the lazy dog",
           "hello world, this is a test of the tokenizer", "café naïve résumé",
           "def f(x):\n    return x + 1", "stop here STOP there", "don't stop"] * 3
_BYTES = [f"<0x{b:02X}>" for b in range(256)]
_SP_SPECIALS = ["<unk>", "<s>", "</s>"]


def _llama_style_bpe() -> transformers.PreTrainedTokenizerFast:
    """Llama-2-like: `▁` for spaces, byte-fallback BPE, decoder Replace/ByteFallback/Fuse/Strip."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=_SP_SPECIALS, show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    trained = json.loads(tok.to_str())["model"]
    vocab = dict(trained["vocab"])
    for piece in _BYTES:
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    tok.model = models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in _SP_SPECIALS])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                                bos_token="<s>", eos_token="</s>",
                                                clean_up_tokenization_spaces=False)


def _unigram_metaspace() -> transformers.PreTrainedTokenizerFast:
    """T5/ALBERT-like: Unigram with byte fallback, Metaspace, and transformers' space clean-up."""
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.train_from_iterator(_CORPUS, trainers.UnigramTrainer(
        vocab_size=100, special_tokens=_SP_SPECIALS, unk_token="<unk>", show_progress=False,
        max_piece_length=6))
    vocab = [tuple(v) for v in json.loads(tok.to_str())["model"]["vocab"]]
    tok.model = models.Unigram(vocab + [(piece, -20.0) for piece in _BYTES], unk_id=0,
                               byte_fallback=True)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in _SP_SPECIALS])
    tok.decoder = decoders.Sequence([decoders.ByteFallback(),
                                     decoders.Metaspace(replacement="▁", prepend_scheme="first")])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                                bos_token="<s>", eos_token="</s>",
                                                clean_up_tokenization_spaces=True)


@pytest.fixture(scope="module")
def smol() -> Family:
    from minivllm.transformers_utils.gguf_utils import default_model_path
    from minivllm.transformers_utils.tokenizer import load_gguf_tokenizer

    try:
        path = default_model_path()
    except ValueError as e:
        pytest.skip(str(e))
    return Family("smollm2", load_gguf_tokenizer(path),
                  ["<|im_start|>", "<|im_end|>", "<|endoftext|>"], byte_level=True)


@pytest.fixture(scope="module")
def llama_bpe() -> Family:
    return Family("llama-bpe", _llama_style_bpe(), ["<s>", "</s>", "<unk>"], byte_level=False)


@pytest.fixture(scope="module")
def unigram() -> Family:
    return Family("unigram", _unigram_metaspace(), ["<s>", "</s>", "<unk>"], byte_level=False)


@pytest.fixture(scope="module", params=["smol", "llama_bpe", "unigram"])
def family(request) -> Family:
    return request.getfixturevalue(request.param)


# --- helpers --------------------------------------------------------------------------------------

def _params(**kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=None, **kw)


def _chunks(ids: list[int], sizes: list[int]) -> list[list[int]]:
    """Split ids into chunks of the given sizes (cycled), none empty."""
    out, i, k = [], 0, 0
    sizes = sizes or [1]
    while i < len(ids):
        n = sizes[k % len(sizes)]
        out.append(ids[i:i + n])
        i, k = i + n, k + 1
    return out


@dataclass
class Run:
    detok: IncrementalDetokenizer
    deltas: list[str]  # delta returned after each update, then the final one
    stop: str | None
    stop_at_update: int | None


def _run(tok: Any, chunks: list[list[int]], params: SamplingParams,
         stop_terminated: bool = False, check_step=None) -> Run:
    """Feed the chunks as a front end would: update, then a (delta) output, until finished."""
    detok = IncrementalDetokenizer(tok, params)
    deltas: list[str] = []
    stop, stop_at = None, None
    for n, chunk in enumerate(chunks):
        last = n == len(chunks) - 1
        stop = detok.update(chunk, stop_terminated and last)
        if check_step is not None:
            check_step(detok, sum(len(c) for c in chunks[:n + 1]))
        if stop is not None:
            stop_at = n
            break
        if not last:
            deltas.append(detok.get_next_output_text(finished=False, delta=True))
    deltas.append(detok.get_next_output_text(finished=True, delta=True))
    return Run(detok, deltas, stop, stop_at)


def _assert_stream_consistent(run: Run) -> None:
    """Deltas add up to the final text, and every partial sum is a prefix of it."""
    final = run.detok.output_text
    streamed = ""
    for delta in run.deltas:
        streamed += delta
        assert final.startswith(streamed), (streamed, final)
    assert streamed == final
    assert run.detok.get_next_output_text(finished=True, delta=True) == ""
    assert run.detok.get_next_output_text(finished=True, delta=False) == final


def _settled_prefix_ok(family: Family, ids: list[int], skip: bool) -> bool:
    """Whether the full decode of `ids` is one an incremental decoder can match exactly.

    Byte-level decoding never rewrites a complete character, so always; byte-fallback decoding
    turns a whole run of byte tokens into U+FFFD while the run's last character is incomplete
    (see the corner-case test), so only where the decode does not end in U+FFFD.
    """
    return family.byte_level or not family.decode(ids, skip).endswith(FFFD)


def _token_span(family: Family, ids: list[int], start: int, end: int) -> int:
    """How many tokens the text[start:end] of decode(ids) overlaps (ASCII text)."""
    offsets = [len(family.decode(ids[:k], False)) for k in range(len(ids) + 1)]
    return sum(1 for k in range(len(ids)) if offsets[k] < end and offsets[k + 1] > start)


# --- exactness ------------------------------------------------------------------------------------

@pytest.mark.parametrize("skip", [True, False], ids=["skip", "keep"])
@pytest.mark.parametrize("text_index", range(len(TEXTS) + 1))
def test_one_token_at_a_time_matches_full_decode(family: Family, text_index: int, skip: bool):
    text = TEXTS[text_index] if text_index < len(TEXTS) else family.chat_text()
    ids = family.encode(text)
    assert len(ids) > 5

    def check(detok: IncrementalDetokenizer, n: int) -> None:
        if _settled_prefix_ok(family, ids[:n], skip):
            assert detok.output_text == family.decode(ids[:n], skip)
        assert detok.output_token_ids == ids[:n]

    run = _run(family.tok, [[i] for i in ids], _params(skip_special_tokens=skip),
               check_step=check)
    assert run.stop is None
    assert run.detok.output_text == family.decode(ids, skip)
    _assert_stream_consistent(run)
    if FFFD not in text:
        # Incomplete characters are held back, never streamed as U+FFFD.
        assert not any(FFFD in d for d in run.deltas)
    if family.byte_level:  # byte-level BPE round-trips any text
        expected = text
        if skip:
            for special in family.specials:
                expected = expected.replace(special, "")
        assert run.detok.output_text == expected


def test_hand_written_chat_decoding(smol: Family):
    ids = smol.encode(smol.chat_text())
    assert _run(smol.tok, [ids], _params()).detok.output_text == (
        "user\nHi there 👋\nassistant\nHello, café!")
    assert _run(smol.tok, [ids], _params(skip_special_tokens=False)).detok.output_text == (
        "<|im_start|>user\nHi there 👋<|im_end|>\n<|im_start|>assistant\nHello, café!"
        "<|im_end|><|endoftext|>")


def test_multibyte_character_is_streamed_once_complete(smol: Family):
    ids = smol.encode("x日")
    assert [smol.decode([i], False) for i in ids] == ["x", FFFD, FFFD]  # 日 = 2 byte-level tokens
    detok = IncrementalDetokenizer(smol.tok, _params())
    out = []
    for i in ids:
        detok.update([i], False)
        out.append((detok.output_text, detok.get_next_output_text(finished=False, delta=True)))
    assert out == [("x", "x"), ("x" + FFFD, ""), ("x日", "日")]
    # Flags and ZWJ sequences come out one code point at a time, never as U+FFFD.
    run = _run(smol.tok, [[i] for i in smol.encode("🇫🇷👩‍👧")], _params())
    assert [d for d in run.deltas if d] == ["🇫", "🇷", "👩", "\u200d", "👧"]


@SETTINGS
@given(data=st.data())
def test_random_chunk_splits(family: Family, data):
    texts = [*TEXTS, family.chat_text()]
    text = data.draw(st.sampled_from(texts), label="text")
    skip = data.draw(st.booleans(), label="skip")
    sizes = data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=8), label="sizes")
    ids = family.encode(text)
    params = _params(skip_special_tokens=skip)
    run = _run(family.tok, _chunks(ids, sizes), params)
    assert run.detok.output_text == family.decode(ids, skip)
    assert run.detok.output_token_ids == ids
    _assert_stream_consistent(run)
    # Chunking changes when text is streamed, never what.
    assert run.detok.output_text == _run(family.tok, [[i] for i in ids], params).detok.output_text


_PIECES = st.sampled_from(["a", "b", "the", " ", "  ", "\n", ",", "'", "s", "n't", "é", "日", "本",
                           "👩", "\u200d", "🇫", "👍🏽", "x(1)", FFFD])


@SETTINGS
@given(data=st.data())
def test_random_text_and_specials(family: Family, data):
    """Generated texts with special tokens in between, and possibly an incomplete last character."""
    segments = data.draw(st.lists(st.one_of(st.lists(_PIECES, min_size=1, max_size=6).map("".join),
                                            st.sampled_from(family.specials).map(lambda s: [s])),
                                  max_size=6), label="segments")
    ids: list[int] = []
    for segment in segments:
        if isinstance(segment, list):
            ids += family.tok.convert_tokens_to_ids(segment)
        else:
            ids += family.encode(segment)
    if ids and data.draw(st.booleans(), label="cut last id"):
        ids = ids[:-1]  # may end inside a character
    skip = data.draw(st.booleans(), label="skip")
    sizes = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=5), label="sizes")
    run = _run(family.tok, _chunks(ids, sizes), _params(skip_special_tokens=skip))
    if _settled_prefix_ok(family, ids, skip):
        assert run.detok.output_text == family.decode(ids, skip)
    _assert_stream_consistent(run)


@SETTINGS
@given(ids=st.lists(st.one_of(st.integers(0, 49151), st.sampled_from([0, 1, 2]),
                              st.integers(100, 300)), max_size=40),
       sizes=st.lists(st.integers(1, 5), min_size=1, max_size=5), skip=st.booleans())
def test_any_ids_byte_level_exact_after_every_update(smol: Family, ids, sizes, skip):
    """Byte-level BPE is exact for arbitrary ids, broken UTF-8 included, after every update."""
    def check(detok: IncrementalDetokenizer, n: int) -> None:
        assert detok.output_text == smol.decode(ids[:n], skip)

    run = _run(smol.tok, _chunks(ids, sizes), _params(skip_special_tokens=skip), check_step=check)
    assert run.detok.output_text == smol.decode(ids, skip)
    _assert_stream_consistent(run)


def test_incomplete_character_and_literal_fffd_are_released_at_finish(smol: Family):
    for text, ids in [("x日", smol.encode("x日")[:-1]), ("a" + FFFD, smol.encode("a" + FFFD))]:
        detok = IncrementalDetokenizer(smol.tok, _params())
        detok.update(ids, False)
        assert detok.output_text == smol.decode(ids, True) == text[0] + FFFD
        assert detok.get_next_output_text(finished=False, delta=False) == text[0]
        assert detok.get_next_output_text(finished=False, delta=True) == text[0]
        assert detok.get_next_output_text(finished=True, delta=True) == FFFD
        assert detok.get_next_output_text(finished=True, delta=False) == text[0] + FFFD


@pytest.mark.parametrize("which", ["llama_bpe", "unigram"])
def test_byte_fallback_rewrite_corner_case(request, which: str):
    """Byte fallback decodes a run of byte tokens at once and turns all of it into U+FFFD when one
    byte is invalid, so the full decode rewrites an "é" it had already produced. A stream cannot
    take text back: it keeps "é" and decodes the invalid byte on its own."""
    family: Family = request.getfixturevalue(which)
    ids = family.tok.convert_tokens_to_ids(["<0xC3>", "<0xA9>", "<0x97>", "a"])
    assert family.decode(ids[:2], True).endswith("é")
    assert family.decode(ids, True).endswith(FFFD * 3 + "a")  # the é is gone
    run = _run(family.tok, [[i] for i in ids], _params())
    assert run.detok.output_text.endswith("é" + FFFD + "a")
    _assert_stream_consistent(run)
    # Same with an unfinished last character: "日" and two of the three bytes of "本".
    ids = family.tok.convert_tokens_to_ids(["<0xE6>", "<0x97>", "<0xA5>", "<0xE6>", "<0x9C>"])
    assert family.decode(ids, True) == FFFD * 5
    run = _run(family.tok, [[i] for i in ids], _params())
    assert run.detok.output_text == "日" + FFFD * 2
    assert run.deltas == ["", "", "日", "", FFFD * 2]  # the last part only once finished
    _assert_stream_consistent(run)


def test_space_cleanup_is_applied_like_decode(unigram: Family):
    ids = unigram.encode("do n't stop , now ! it 's ok ?")
    assert unigram.tok.backend_tokenizer.decode(ids) == "do n't stop , now ! it 's ok ?"
    assert unigram.decode(ids, True) == "don't stop, now! it's ok?"  # clean-up is on
    run = _run(unigram.tok, [[i] for i in ids], _params())
    assert run.detok.output_text == "don't stop, now! it's ok?"
    _assert_stream_consistent(run)


def test_spaces_between_special_tokens_has_no_effect_on_fast_tokenizers(smol: Family):
    ids = smol.encode("<|im_start|><|im_end|> a<|im_end|><|endoftext|>b")
    for skip in (True, False):
        texts = {smol.tok.decode(ids, skip_special_tokens=skip, spaces_between_special_tokens=s)
                 for s in (True, False)}
        assert len(texts) == 1
        for spaces in (True, False):
            params = _params(skip_special_tokens=skip, spaces_between_special_tokens=spaces)
            assert _run(smol.tok, [[i] for i in ids], params).detok.output_text in texts


class _SlowTokenizer:
    """No backend_tokenizer, so the detokenizer decodes through `decode(...)`: a slow tokenizer as
    in transformers 4.x, which joins special tokens and the text between them with spaces when
    spaces_between_special_tokens is set."""

    def __init__(self, fast: Any) -> None:
        self._fast = fast
        self.clean_up_tokenization_spaces = False
        self.kwargs_seen: set[str] = set()

    def decode(self, ids: list[int], skip_special_tokens: bool = False,
               spaces_between_special_tokens: bool = True, **kwargs: Any) -> str:
        self.kwargs_seen |= set(kwargs)
        special = set(self._fast.all_special_ids)
        parts: list[str] = []
        run: list[str] = []
        for i in ids:
            if i in special:
                if skip_special_tokens:
                    continue
                if run:
                    parts.append(self._fast.backend_tokenizer.decoder.decode(run))
                    run = []
                parts.append(self._fast.convert_ids_to_tokens(i))
            else:
                run.append(self._fast.convert_ids_to_tokens(i))
        if run:
            parts.append(self._fast.backend_tokenizer.decoder.decode(run))
        return (" " if spaces_between_special_tokens else "").join(parts)


@pytest.mark.parametrize("spaces", [True, False])
@pytest.mark.parametrize("skip", [True, False])
def test_slow_tokenizer_path(smol: Family, skip: bool, spaces: bool):
    slow = _SlowTokenizer(smol.tok)
    ids = smol.encode(smol.chat_text() + "日本 👍🏽")
    expected = slow.decode(ids, skip, spaces)
    if not skip:
        assert expected != slow.decode(ids, skip, not spaces)  # the flag matters here
    params = _params(skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    for sizes in ([1], [3, 1, 2]):
        run = _run(slow, _chunks(ids, sizes), params)
        assert run.detok.output_text == expected
        _assert_stream_consistent(run)
    assert slow.kwargs_seen == {"clean_up_tokenization_spaces"}


class _CountingBackend:
    def __init__(self, backend: Tokenizer) -> None:
        self._backend = backend
        self.ids_decoded = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        self.ids_decoded += len(ids)
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)


class _CountingTokenizer:
    clean_up_tokenization_spaces = False

    def __init__(self, fast: Any) -> None:
        self.backend_tokenizer = _CountingBackend(fast.backend_tokenizer)


def test_cost_per_token_does_not_grow_with_output(smol: Family):
    tok = _CountingTokenizer(smol.tok)
    ids = smol.encode(" ".join(TEXTS) * 8)
    assert len(ids) > 1500
    detok = IncrementalDetokenizer(tok, _params())
    for i in ids:
        detok.update([i], False)
        detok.get_next_output_text(finished=False, delta=True)
    assert detok.output_text == smol.decode(ids, True)
    # Two windows of a few ids per token (longer only while a character is incomplete).
    assert tok.backend_tokenizer.ids_decoded < 8 * len(ids)


def test_detokenize_false(smol: Family):
    ids = smol.encode("Hello world")
    detok = IncrementalDetokenizer(smol.tok, _params(detokenize=False))
    assert detok.update(ids[:1], False) is None
    assert detok.update(ids[1:], True) is None
    assert detok.output_text == ""
    assert detok.get_next_output_text(finished=False, delta=True) == ""
    assert detok.get_next_output_text(finished=True, delta=False) == ""
    assert detok.output_token_ids == ids


# --- stop strings ---------------------------------------------------------------------------------

STORY = "The answer is forty-two. Then we stop here. END OF STORY"


@pytest.mark.parametrize("stop,span,before", [
    ("forty-two", 3, "The answer is "),  # " forty" | "-" | "two"
    ("y-t", 3, "The answer is fort"),  # ends of " forty" and "two", all of "-"
    ("STORY", 2, "The answer is forty-two. Then we stop here. END OF "),  # " ST" | "ORY"
    ("e ans", 2, "Th"),
])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(smol: Family, stop: str, span: int, before: str,
                                     include: bool):
    ids = smol.encode(STORY)
    at = STORY.index(stop)
    assert STORY[:at] == before
    assert _token_span(smol, ids, at, at + len(stop)) == span
    done = next(k for k in range(len(ids) + 1) if stop in smol.decode(ids[:k], False))
    expected = before + stop if include else before
    params = _params(stop=[stop], include_stop_str_in_output=include)

    def check(detok: IncrementalDetokenizer, n: int) -> None:
        # While not finished, nothing that a later match could cut is handed out.
        assert expected.startswith(detok.get_next_output_text(finished=False, delta=False))

    run = _run(smol.tok, [[i] for i in ids], params, check_step=check)
    assert run.stop == stop
    assert run.stop_at_update == done - 1  # caught by the token that completes it
    assert run.detok.output_text == expected
    _assert_stream_consistent(run)
    assert run.detok.output_token_ids == ids[:done]
    # Later updates (the engine should not send any) change nothing but the ids.
    assert run.detok.update(ids[done:done + 1], False) is None
    assert run.detok.output_text == expected


def test_stop_string_holds_back_streamed_text(smol: Family):
    ids = smol.encode("The answer is forty")  # a prefix of the stop string is there
    detok = IncrementalDetokenizer(smol.tok, _params(stop=["forty-two"]))
    assert detok.update(ids, False) is None
    assert detok.output_text == "The answer is forty"
    held = "The answer "  # all but the last len("forty-two") - 1 = 8 characters
    assert detok.get_next_output_text(finished=False, delta=False) == held
    assert detok.get_next_output_text(finished=False, delta=True) == held
    assert detok.get_next_output_text(finished=False, delta=True) == ""
    assert detok.get_next_output_text(finished=True, delta=True) == "is forty"
    # With include_stop_str_in_output nothing is ever cut from the text before a match.
    detok = IncrementalDetokenizer(smol.tok, _params(stop=["forty-two"],
                                                         include_stop_str_in_output=True))
    detok.update(ids, False)
    assert detok.get_next_output_text(finished=False, delta=True) == "The answer is forty"


@SETTINGS
@given(data=st.data())
def test_stop_string_random_splits(smol: Family, data):
    """Any substring of the text as stop string, any chunking: cut at its first occurrence."""
    text = data.draw(st.sampled_from([STORY, *TEXTS[:6]]), label="text")
    ids = smol.encode(text)
    start = data.draw(st.integers(0, len(text) - 1), label="start")
    stop = text[start:start + data.draw(st.integers(1, 12), label="length")]
    include = data.draw(st.booleans(), label="include")
    sizes = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=6), label="sizes")
    at = text.index(stop)
    expected = text[:at + len(stop)] if include else text[:at]
    params = _params(stop=[stop], include_stop_str_in_output=include, skip_special_tokens=False)

    def check(detok: IncrementalDetokenizer, n: int) -> None:
        assert expected.startswith(detok.get_next_output_text(finished=False, delta=False))

    run = _run(smol.tok, _chunks(ids, sizes), params, check_step=check)
    assert run.stop == stop
    assert run.detok.output_text == expected
    _assert_stream_consistent(run)


@pytest.mark.parametrize("one_chunk", [False, True])
def test_multiple_stop_strings_earliest_match_wins(smol: Family, one_chunk: bool):
    ids = smol.encode(STORY)
    chunks = [ids] if one_chunk else [[i] for i in ids]
    run = _run(smol.tok, chunks, _params(stop=["STORY", "stop", "forty"]))
    assert (run.stop, run.detok.output_text) == ("forty", "The answer is ")
    # "is" ends before "answer is forty" does, although the latter starts first: the match a
    # token-by-token stream meets first wins, however the tokens were grouped.
    run = _run(smol.tok, chunks, _params(stop=["answer is forty", "is"]))
    assert (run.stop, run.detok.output_text) == ("is", "The answer ")
    # Two matches ending together: the longer (earlier) one.
    params = _params(stop=["two", "forty-two"], include_stop_str_in_output=True)
    run = _run(smol.tok, chunks, params)
    assert (run.stop, run.detok.output_text) == ("forty-two", "The answer is forty-two")


def test_min_tokens_delays_stop_strings(smol: Family):
    text = "one stop two stop three"
    ids = smol.encode(text)
    first = next(k for k in range(len(ids) + 1) if "stop" in smol.decode(ids[:k], False))
    chunks = [[i] for i in ids]
    # Completed by token number `first`: caught once more than first - 1 tokens are out...
    run = _run(smol.tok, chunks, _params(stop=["stop"], min_tokens=first - 1))
    assert (run.stop, run.detok.output_text) == ("stop", "one ")
    # ...ignored under min_tokens=first; the second occurrence is caught.
    run = _run(smol.tok, chunks, _params(stop=["stop"], min_tokens=first))
    assert (run.stop, run.detok.output_text) == ("stop", "one stop two ")
    # Never matched when min_tokens covers the whole output.
    run = _run(smol.tok, chunks, _params(stop=["stop"], min_tokens=len(ids)))
    assert (run.stop, run.detok.output_text) == (None, text)
    # Each token counts where it stands, so chunking does not matter (vLLM checks a whole chunk
    # with the count after it, which would catch the first "stop" here).
    run = _run(smol.tok, [ids], _params(stop=["stop"], min_tokens=first))
    assert (run.stop, run.detok.output_text) == ("stop", "one stop two ")


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("one_chunk", [False, True])
def test_stop_terminated_drops_stop_token_text(smol: Family, skip: bool, include: bool,
                                               one_chunk: bool):
    body = smol.encode("Hello there, café")
    eos = smol.tok.eos_token_id
    assert smol.tok.convert_ids_to_tokens(eos) == "<|im_end|>"
    ids = body + [eos]
    chunks = [ids] if one_chunk else [[i] for i in ids]
    params = _params(skip_special_tokens=skip, include_stop_str_in_output=include)
    run = _run(smol.tok, chunks, params, stop_terminated=True)
    assert run.stop is None
    tail = "<|im_end|>" if include and not skip else ""
    assert run.detok.output_text == "Hello there, café" + tail
    assert run.detok.output_token_ids == ids
    _assert_stream_consistent(run)

    # A normal word as stop token id: " friend".
    friend = smol.encode(" friend")
    assert len(friend) == 1
    run = _run(smol.tok, [body, friend], params, stop_terminated=True)
    assert run.detok.output_text == "Hello there, café" + (" friend" if include else "")
    assert run.detok.output_token_ids == body + friend


def test_dropped_stop_token_text_is_not_matched_by_stop_strings(smol: Family):
    body, friend = smol.encode("Hello there,"), smol.encode(" friend")
    run = _run(smol.tok, [body, friend], _params(stop=["friend"]), stop_terminated=True)
    assert (run.stop, run.detok.output_text) == (None, "Hello there,")
    run = _run(smol.tok, [body, friend], _params(stop=["friend"], include_stop_str_in_output=True),
               stop_terminated=True)
    assert (run.stop, run.detok.output_text) == ("friend", "Hello there, friend")


def test_tokens_after_a_stop_string_in_the_same_update(smol: Family):
    ids = smol.encode(STORY)
    run = _run(smol.tok, [ids[:2], ids[2:]], _params(stop=["Then"]))
    assert (run.stop, run.detok.output_text) == ("Then", "The answer is forty-two. ")
    assert run.detok.output_token_ids == ids  # the ids are all kept
