"""minivllm's SentencePiece GGUF tokenizer (`tokenizer.ggml.model` "llama": Gemma 3, Llama 2,
Mistral v0.1) against transformers' GGUF tokenizer built from the same file, the independent
reference, and against ids worked out by hand.

Small GGUFs written here with `gguf.GGUFWriter` cover both rankings (Gemma's by file order with no
prefix space, Llama's by score with one) in a second; the real Gemma 3 270M file checks the 262k
vocabulary the engine serves. Also: the Gemma chat template used when a GGUF carries none, and
<end_of_turn> as a stop beside <eos>.
"""

from __future__ import annotations

import json
import os
import random
import string
import time
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gguf  # noqa: E402
import jinja2  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import reference  # noqa: E402  (tests/support)
import transformers  # noqa: E402

from minivllm.engine.processor import Processor  # noqa: E402
from minivllm.sampling_params import SamplingParams  # noqa: E402
from minivllm.transformers_utils.tokenizer import extra_eos_token_ids, load_gguf_tokenizer  # noqa: E402

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6  # llama.cpp's token types
BYTES = [f"<0x{b:02X}>" for b in range(256)]
SPACE = "\u2581"

CORPUS = [
    "Hello world",
    "hello, world! The quick brown fox jumps over the lazy dog.",
    "   leading spaces",
    "trailing spaces   ",
    "multiple    spaces  between     words",
    "new\nline and\n\ntwo, tabs\tand\t\ttwo\r\nwindows",
    "\n\nstarts with newlines",
    " ",
    "  ",
    "",
    "\t",
    "digits 12345 2024 3.14 007 1,000,000",
    "unicode: café naïve über straße Ångström",
    "emoji 😀 and 👨‍👩‍👧 and 日本語 and 👍🏽",
    "<start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n",
    "<s>[INST] hello [/INST] world</s>",
    "special<eos>inside<bos>text<unk>and<pad>",
    "user-defined [multimodal] <b>bold</b> and <tool>",
    "tokenizer tokens merged merges pieces tokenizers",
    " merges\n merged\t tokens ",
]
WORDS = ("hello world the quick brown fox jumps over lazy dog token tokens tokenizer piece pieces merge "
         "merged merges space spaces between words new line two tabs and with leading trailing "
         "starts digits unicode café naïve über straße special inside text bold user defined").split()


# --- writing SentencePiece GGUFs ----------------------------------------------------------------


def write_spm_gguf(path: Path, arch: str, vocab: list[tuple[str, float, int]], **metadata) -> Path:
    """A GGUF with a SentencePiece vocabulary of (piece, score, token type), the given special ids
    (bos/eos/unk/pad/eot) and flags, and a tiny token_embd tensor so that it is a valid model file."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([piece for piece, _, _ in vocab])
    writer.add_token_scores([float(score) for _, score, _ in vocab])
    writer.add_token_types([kind for _, _, kind in vocab])
    for key, value in metadata.items():
        if key.endswith("_id"):
            writer.add_uint32(f"tokenizer.ggml.{key}", value)
        elif key == "chat_template":
            writer.add_chat_template(value)
        else:
            writer.add_bool(f"tokenizer.ggml.{key}", value)
    writer.add_tensor("token_embd.weight", np.zeros((len(vocab), 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def synthetic_pieces(rng: random.Random) -> list[str]:
    """Characters, "▁word" prefixes and in-word substrings: pieces that overlap in many ways, so
    that the ranking decides the split."""
    pieces = set(string.ascii_letters + string.digits + string.punctuation + "éïüßÅ日" + SPACE)
    for word in WORDS:
        spaced = SPACE + word
        pieces |= {spaced[:end] for end in range(2, len(spaced) + 1)}
        pieces |= {word[i:i + n] for n in (2, 3, 4) for i in range(len(word) - n + 1)}
    pieces |= {"12", "123", "2024", "00", "007", ".1", "3.", "!\n"}
    ordered = sorted(pieces)
    rng.shuffle(ordered)
    return ordered


def gemma_vocab(rng: random.Random) -> list[tuple[str, float, int]]:
    """Gemma's layout: control tokens, user-defined ones (runs of newlines, tabs and raw spaces,
    HTML tags), byte tokens, then pieces whose scores are noise (Gemma ranks by file order)."""
    head = [(t, -1000.0, CONTROL) for t in ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")]
    head += [("[multimodal]", -1000.0, USER_DEFINED)]
    head += [(t, -1000.0, CONTROL) for t in ("<start_of_turn>", "<end_of_turn>")]
    head += [(t, -1000.0, USER_DEFINED) for t in ("\n", "\n\n", "  ", "   ", "    ", "\t", "\t\t",
                                                   "<b>", "</b>")]
    head += [(b, 0.0, BYTE) for b in BYTES]
    return head + [(p, rng.uniform(-1000, 0), NORMAL) for p in synthetic_pieces(rng)]


def llama_vocab(rng: random.Random) -> list[tuple[str, float, int]]:
    """Llama 2's layout: <unk> <s> </s>, byte tokens, then pieces ranked by score, in few distinct
    values so that ties (broken by the lengths of the two parts, then by file order) are common."""
    head = [("<unk>", 0.0, UNKNOWN), ("<s>", 0.0, CONTROL), ("</s>", 0.0, CONTROL)]
    head += [(b, 0.0, BYTE) for b in BYTES]
    pieces = synthetic_pieces(rng) + [SPACE * 2, SPACE * 4]
    tail = [("<tool>", 0.0, USER_DEFINED), ("  ", 0.0, USER_DEFINED), ("[INST]", 0.0, CONTROL)]
    return head + [(p, float(rng.randint(-8, 0)), NORMAL) for p in pieces] + tail


SYNTHETIC = {
    "gemma3": (gemma_vocab, dict(bos_token_id=2, eos_token_id=1, unknown_token_id=3,
                                 padding_token_id=0, add_bos_token=True, add_eos_token=False,
                                 add_space_prefix=False)),
    "llama": (llama_vocab, dict(bos_token_id=1, eos_token_id=2, unknown_token_id=0)),
}


@pytest.fixture(scope="module", params=sorted(SYNTHETIC))
def synthetic(request, tmp_path_factory) -> tuple[Path, object, object]:
    """(file, minivllm's tokenizer, transformers' tokenizer) for one synthetic vocabulary."""
    make_vocab, metadata = SYNTHETIC[request.param]
    path = write_spm_gguf(tmp_path_factory.mktemp(request.param) / "spm.gguf", request.param,
                          make_vocab(random.Random(0)), **metadata)
    ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return path, load_gguf_tokenizer(str(path)), ref


def assert_same_as_transformers(ours, ref, texts: list[str]) -> None:
    for text in texts:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == ref.encode(
                text, add_special_tokens=special), (text, special)
        ids = ref.encode(text)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(
                ids, skip_special_tokens=skip), (text, skip)


# --- synthetic vocabularies ---------------------------------------------------------------------


def test_synthetic_matches_transformers(synthetic):
    _, ours, ref = synthetic
    assert ours.get_vocab() == ref.get_vocab()
    assert_same_as_transformers(ours, ref, CORPUS)
    assert (ours.bos_token_id, ours.eos_token_id, ours.unk_token_id, ours.pad_token_id) == (
        ref.bos_token_id, ref.eos_token_id, ref.unk_token_id, ref.pad_token_id)


def test_synthetic_corpus_exercises_the_vocabulary(synthetic):
    """Guards the test above: the corpus reaches byte fallback, multi-character pieces, control
    and user-defined tokens."""
    _, ours, _ = synthetic
    tokens = {t for text in CORPUS for t in ours.convert_ids_to_tokens(ours.encode(text))}
    assert {"<0xF0>", "<0x9F>"} <= tokens  # emoji
    assert any(len(t) > 3 and not t.startswith("<") for t in tokens)
    assert {ours.bos_token, ours.eos_token} <= tokens and tokens & {"<b>", "<tool>"}  # user-defined


def tiny_vocab(unk_type: int) -> list[tuple[str, float, int]]:
    """Five specials, three byte tokens (those of "€"), then pieces: file order ranks "ab" before
    "bc" before "cd"; scores rank "cd" (-0.5), "bc" (-1), "▁a" (-3), then "ab" and "bcd" (-5),
    a tie that the longer right part ("b" + "cd") wins."""
    head = [("<pad>", 0.0, CONTROL), ("<eos>", 0.0, CONTROL), ("<bos>", 0.0, CONTROL),
            ("<unk>", 0.0, unk_type), ("<end_of_turn>", 0.0, CONTROL)]
    head += [(b, 0.0, BYTE) for b in ("<0xE2>", "<0x82>", "<0xAC>")]
    pieces = [(SPACE, -1.0, NORMAL), ("a", -2.0, NORMAL), ("b", -2.0, NORMAL), ("c", -2.0, NORMAL),
              ("ab", -5.0, NORMAL), ("bc", -1.0, NORMAL), (SPACE + "a", -3.0, NORMAL),
              ("d", -2.0, NORMAL), ("cd", -0.5, NORMAL), ("bcd", -5.0, NORMAL)]
    return head + pieces


# ids in tiny_vocab: 2 <bos>, 3 <unk>, 4 <end_of_turn>, 5-7 the bytes of "€", 8 "▁", 9 "a",
# 10 "b", 11 "c", 12 "ab", 13 "bc", 14 "▁a", 15 "d", 16 "cd", 17 "bcd".
HAND_COMPUTED = {
    # Gemma: no prefix space; "ab" (file position 12) merges before "bc" (13).
    "gemma3": [("abc", [2, 12, 11]),
               (" abc€", [2, 8, 12, 11, 5, 6, 7]),  # "▁a" (14) loses to "ab"; € by its bytes
               ("a😀<end_of_turn>", [2, 9, 3, 4]),  # no byte tokens for 😀: <unk>
               ("xabcd", [2, 3, 12, 16])],  # "x": <unk>; then "ab" (12), "cd" (16)
    # Llama: "▁abc" after the prefix space; "bc" (score -1) first, then "▁a" (-3).
    "llama": [("abc", [2, 14, 13]),
              (" abc€", [2, 14, 13, 5, 6, 7]),  # the text's own space is the prefix
              ("a😀<end_of_turn>", [2, 14, 3, 4]),  # 😀: <unk>, see "xabcd"
              # "cd", then "b"+"cd" before "a"+"b". "x" has no piece and no byte tokens:
              # <unk>, as in llama.cpp (transformers' Llama tokenizer drops it: [2, 14, 17]).
              ("xabcd", [2, 8, 3, 9, 17])],
}


@pytest.mark.parametrize("arch", sorted(HAND_COMPUTED))
def test_hand_computed_ids(tmp_path, arch):
    path = write_spm_gguf(tmp_path / "tiny.gguf", arch, tiny_vocab(CONTROL if arch == "gemma3" else UNKNOWN),
                          bos_token_id=2, eos_token_id=1, unknown_token_id=3, padding_token_id=0)
    ours = load_gguf_tokenizer(str(path))
    for text, ids in HAND_COMPUTED[arch]:
        assert ours.encode(text) == ids, text
    assert ours.decode([2, 12, 11, 5, 6, 7, 4], skip_special_tokens=True) == "abc€"
    assert ours.decode([2, 8, 12, 11, 4]) == "<bos> abc<end_of_turn>"


# --- chat template and end of turn --------------------------------------------------------------


CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there! "},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": [{"type": "text", "text": "What is 2+2?"}]},
]
GEMMA_PROMPT = ("<bos><start_of_turn>user\nYou are terse.\n\nHi there!<end_of_turn>\n"
                "<start_of_turn>model\nHello.<end_of_turn>\n"
                "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n"
                "<start_of_turn>model\n")


@pytest.fixture(scope="module")
def gemma_file(tmp_path_factory) -> Path:
    _, metadata = SYNTHETIC["gemma3"]
    return write_spm_gguf(tmp_path_factory.mktemp("gemma") / "g.gguf", "gemma3",
                          gemma_vocab(random.Random(0)), **metadata)


def test_gemma_chat_template(gemma_file):
    tokenizer = load_gguf_tokenizer(str(gemma_file))
    assert tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False) == GEMMA_PROMPT
    without_prompt = tokenizer.apply_chat_template(CONVERSATION[1:3], tokenize=False)
    assert without_prompt == "<bos><start_of_turn>user\nHi there!<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
    with pytest.raises(jinja2.TemplateError, match="alternate"):
        tokenizer.apply_chat_template(CONVERSATION[2:], tokenize=False)


def test_chat_template_from_the_file_wins(tmp_path):
    _, metadata = SYNTHETIC["gemma3"]
    path = write_spm_gguf(tmp_path / "g.gguf", "gemma3", gemma_vocab(random.Random(0)),
                          chat_template="{{ messages[0]['content'] }}", **metadata)
    assert load_gguf_tokenizer(str(path)).apply_chat_template(CONVERSATION, tokenize=False) == "You are terse."


def test_no_default_template_for_other_architectures(tmp_path):
    path = write_spm_gguf(tmp_path / "l.gguf", "llama", llama_vocab(random.Random(0)), eos_token_id=2)
    assert load_gguf_tokenizer(str(path)).chat_template is None


def test_extra_eos_token_ids(tmp_path, gemma_file):
    assert extra_eos_token_ids(str(gemma_file)) == [7]  # <end_of_turn>
    vocab = llama_vocab(random.Random(0))
    plain = write_spm_gguf(tmp_path / "l.gguf", "llama", vocab, eos_token_id=2)
    assert extra_eos_token_ids(str(plain)) == []
    eot = write_spm_gguf(tmp_path / "eot.gguf", "llama", vocab, eos_token_id=2, eot_token_id=len(vocab) - 1)
    assert extra_eos_token_ids(str(eot)) == [len(vocab) - 1]
    assert extra_eos_token_ids(str(tmp_path)) == []  # an HF directory


def test_processor_stops_at_extra_eos(gemma_file):
    """Each request stops at <end_of_turn> as at a stop token id, unless it ignores EOS."""
    tokenizer = load_gguf_tokenizer(str(gemma_file))
    config = SimpleNamespace(hf_config=SimpleNamespace(vocab_size=len(tokenizer)), max_logprobs=20,
                             max_model_len=64)
    processor = Processor(config, tokenizer, "fcfs", extra_eos_token_ids=[7])

    def stop_ids(**kw) -> list[int]:
        request, _ = processor.process_inputs("r", "hello", SamplingParams(max_tokens=4, **kw))
        assert request.eos_token_id == 1
        return request.sampling_params.stop_token_ids

    assert stop_ids() == [7]
    assert stop_ids(stop_token_ids=[9, 7]) == [9, 7]
    assert stop_ids(stop_token_ids=[9]) == [9, 7]
    assert stop_ids(ignore_eos=True) == []


# --- the real Gemma 3 270M ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma3_ref(gemma3_gguf):
    """transformers' tokenizer from the file, built once: ~20-50 s, ~10 s of it parsing the
    file's metadata, which the session's one reader of the file (reference.one_gguf_reader) saves
    when the Gemma model was loaded first."""
    with reference.one_gguf_reader(gemma3_gguf):
        return transformers.AutoTokenizer.from_pretrained(gemma3_gguf.parent, gguf_file=gemma3_gguf.name)


@pytest.fixture(scope="module")
def gemma3_tokenizer(gemma3_gguf):
    return load_gguf_tokenizer(str(gemma3_gguf))


GEMMA3_TEXTS = [
    "The quick brown fox jumps over the lazy dog. " * 40,
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "#include <stdio.h>\nint main(void) {\n\tprintf(\"%d\\n\", 42);\n\treturn 0;\n}\n",
    "   leading, trailing   and    runs of spaces  ",
    "\n\n\nnewlines\n\n and\ttabs\t\t\t and \r\n windows \u00a0nbsp",
    "Le cœur a ses raisons que la raison ne connaît point. Ça va? Übermäßig größer.",
    "日本語のテキストと中文文本，还有한국어. Русский текст. Ελληνικά. العربية. हिन्दी.",
    "Emoji: 😀🎉👍🏽👨‍👩‍👧🇫🇷 and a lone \U0001fae8 and keycap 1\ufe0f\u20e3",
    "Pi is 3.14159265358979, e = 2.71828; 1234567890 and 1,000,000.00 on 2024-01-31.",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n",
    "<bos>text<eos> with <pad>, <unk>, <mask> and <unused0> inside",
    "<table><tr><td>cell</td></tr></table> <h1>Title</h1> [multimodal] <start_of_image>",
    "{\"key\": [1, 2, {\"nested\": null}], \"ok\": true}",
    "SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name;",
    "x\u200by zero width, \ufeffBOM, combining e\u0301 vs é, ﬁ ligature, Ⅻ",
    "$%^&*()[]{}<>~`|\\/@#!? ... --- ___ === +++",
    "",
    " ",
    "a",
    "I'm sure you're right; they've said we'll go. IT'S LOUD!!!",
]


def test_gemma3_matches_transformers(gemma3_tokenizer, gemma3_ref):
    chat = gemma3_tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False)
    assert chat == GEMMA_PROMPT
    assert_same_as_transformers(gemma3_tokenizer, gemma3_ref, [*GEMMA3_TEXTS, chat])
    assert gemma3_tokenizer.encode(chat, add_special_tokens=False)[:3] == [2, 105, 2364]  # <bos><start_of_turn>user


def test_gemma3_model_is_transformers_one(gemma3_tokenizer, gemma3_ref):
    """Same vocabulary, merges in the same order, same added tokens and decoder: then every text
    encodes and decodes the same, not only the ones tried above."""
    ours = json.loads(gemma3_tokenizer.backend_tokenizer.to_str())
    ref = json.loads(gemma3_ref.backend_tokenizer.to_str())
    for key in ("model", "added_tokens", "normalizer", "decoder", "post_processor"):
        assert ours[key] == ref[key], key


def test_gemma3_special_tokens_and_stops(gemma3_gguf, gemma3_tokenizer, gemma3_ref):
    assert (gemma3_tokenizer.bos_token_id, gemma3_tokenizer.eos_token_id) == (2, 1)
    assert (gemma3_tokenizer.pad_token_id, gemma3_tokenizer.unk_token_id) == (0, 3)
    assert len(gemma3_tokenizer) == len(gemma3_ref) == 262144
    assert gemma3_tokenizer.convert_ids_to_tokens(106) == "<end_of_turn>"
    assert extra_eos_token_ids(str(gemma3_gguf)) == [106]


def test_gemma3_builds_fast(gemma3_gguf, gemma3_tokenizer):
    start = time.perf_counter()
    load_gguf_tokenizer(str(gemma3_gguf))
    elapsed = time.perf_counter() - start
    assert elapsed < 5.0, f"the Gemma 3 tokenizer took {elapsed:.2f} s"


def test_packaged_model_names_resolve_to_their_files(gemma3_gguf, tmp_path, monkeypatch):
    """`--model gemma-3-270m` is the assembled file; a local path of that name wins; an unknown
    name says which names exist."""
    from minivllm.transformers_utils.config import resolve_model_path

    assert resolve_model_path("gemma-3-270m") == str(gemma3_gguf)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gemma-3-270m").mkdir()
    (tmp_path / "gemma-3-270m" / "config.json").write_text("{}")
    assert resolve_model_path("gemma-3-270m") == "gemma-3-270m"
    with pytest.raises(ValueError, match="smollm2-135m-instruct, gemma-3-270m"):
        resolve_model_path("gemma-4")
