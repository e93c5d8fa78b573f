"""Per-request incremental detokenization and stop-string matching for the output processor:
new token ids in, text out at a cost independent of the output's length, stop strings caught as
they appear, and streamed text that no later step takes back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tokenizers

from minivllm.sampling_params import SamplingParams

_REPLACEMENT = "\ufffd"  # what a decoder writes for bytes that are not (yet) valid UTF-8


class IncrementalDetokenizer:
    """The generated text of one request, kept up to date token by token.

    The reference is `tokenizer.decode(output_token_ids, skip_special_tokens=...)`: `output_text`
    equals it after any sequence of `update` calls, however the ids were split into calls, except
    for the stop handling described in `update` and one corner case of byte-fallback vocabularies
    (see `_WindowDecoder`) where that decode rewrites text it had already produced.

    Why not `tokenizers.decoders.DecodeStream` (vLLM's choice for fast tokenizers)? It runs the
    same prefix/read-offset algorithm, but checked against full decodes it (1) cannot flush: ids
    whose text ends in U+FFFD (an incomplete character, a literal U+FFFD, bytes that never become
    valid) stay buffered until a later token, so a request that ends there loses text `decode`
    shows, and (2) it raises "Invalid prefix" in the byte-fallback corner case. `_WindowDecoder`
    runs the algorithm on the backend's `decode` instead (about 3 us a token rather than 1,
    negligible next to a model step) and keeps the unsettled tail at hand.
    """

    def __init__(self, tokenizer: Any, params: SamplingParams) -> None:
        # The prompt is deliberately not used as decoding context (vLLM primes its stream with the
        # prompt's last tokens): the contract is equality with decoding the output ids alone, and
        # context would change that for SentencePiece-style decoders (the first output token would
        # keep its leading space) while changing nothing for byte-level BPE.
        self.params = params
        self._token_ids: list[int] = []
        self._decoder: _WindowDecoder | None = None
        self._cleanup: _SpaceCleanup | None = None
        if params.detokenize:
            self._decoder = _WindowDecoder(_window_decode_fn(tokenizer, params))
            if _cleans_up_spaces(tokenizer):
                self._cleanup = _SpaceCleanup(tokenizer.clean_up_tokenization)
        self._stops = tuple(dict.fromkeys(params.stop or ())) if params.detokenize else ()
        self._lookback = max(map(len, self._stops), default=1) - 1
        # Streamed text must never include what a later match cuts off. With
        # include_stop_str_in_output a match only cuts text after its end, which lies in text that
        # has not been produced yet, so nothing needs holding back.
        self._hold = 0 if params.include_stop_str_in_output else self._lookback
        self._pieces: list[str] = []  # settled text: it can only be cut by a stop string
        self._length = 0  # total length of _pieces
        self._joined: str | None = ""  # "".join(_pieces), cached
        self._tail = ""  # last `_lookback` settled characters, for matches across steps
        self._unstreamed = ""  # settled text after what delta calls have returned
        self._streamed = 0  # characters returned by delta calls
        self._stop_reason: str | None = None

    @property
    def output_text(self) -> str:
        """All text so far: the settled text plus the decode of the tail that is not settled yet."""
        return self._settled_text() + self._unsettled_text()

    @property
    def output_token_ids(self) -> list[int]:
        """Every generated id, including a stop token and ids that arrived after a stop string."""
        return self._token_ids

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Append newly generated ids (usually one per step, may be several).

        `stop_terminated` is True when the engine finished the request because the LAST of these
        ids is EOS or one of params.stop_token_ids: that token's text is then not added to the
        output (unless include_stop_str_in_output). Returns the stop string that matched, if any
        (the caller then finishes the request with finish_reason "stop" and stop_reason = that
        string); the text is then truncated right before the stop string (or right after it with
        include_stop_str_in_output) and stays frozen. Stop strings are only looked for once more
        than params.min_tokens tokens have been generated, in text that may span several tokens;
        when several match, the one that ends first wins (as if the text came one character at a
        time), and of those ending together the longest.
        """
        first = len(self._token_ids)
        self._token_ids.extend(new_token_ids)
        if self._decoder is None or self._stop_reason is not None:
            return None
        text_ids = new_token_ids
        if stop_terminated and new_token_ids and not self.params.include_stop_str_in_output:
            text_ids = new_token_ids[:-1]
        # One id at a time, so that a chunk settles exactly the text its ids would settle one per
        # call (a stop string found in a chunk is the one a token-by-token run would have found).
        for count, token_id in enumerate(text_ids, first + 1):
            piece = self._decoder.step(token_id)
            if piece and self._cleanup is not None:
                piece = self._cleanup.settle(piece)
            if piece and self._append(piece, count > self.params.min_tokens):
                return self._stop_reason
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to hand to the user now.

        delta=False: the whole text; delta=True: only the text not returned by a previous delta
        call. While not finished, the last (longest stop string length - 1) characters are held
        back, as is the unsettled tail (an incomplete UTF-8 character may still change), so that
        streamed text is never text that a later step changes or a stop-string match removes.
        When finished (or stopped by a stop string), everything is released.
        """
        if self._decoder is None:
            return ""
        if finished or self._stop_reason is not None:
            text = self.output_text
            if not delta:
                return text
            out, self._unstreamed, self._streamed = text[self._streamed:], "", len(text)
            return out
        if not delta:
            return self._settled_text()[:max(0, self._length - self._hold)]
        n = max(0, len(self._unstreamed) - self._hold)
        out, self._unstreamed = self._unstreamed[:n], self._unstreamed[n:]
        self._streamed += n
        return out

    def _append(self, piece: str, check_stops: bool) -> bool:
        """Add settled text; if a stop string now ends inside it, truncate and return True."""
        start = self._length
        self._pieces.append(piece)
        self._length += len(piece)
        self._joined = None
        self._unstreamed += piece
        window = self._tail + piece  # every match ending inside `piece` lies in here
        if check_stops and self._stops:
            match = _first_stop(window, self._stops, len(self._tail))
            if match is not None:
                stop, at = match
                if self.params.include_stop_str_in_output:
                    at += len(stop)
                self._truncate(start - len(self._tail) + at)
                self._stop_reason = stop
                return True
        if self._lookback:
            self._tail = window[-self._lookback:]
        return False

    def _truncate(self, length: int) -> None:
        # `_hold` guarantees the cut is not before anything already streamed.
        assert length >= self._streamed, "stop-string cut inside already streamed text"
        text = self._settled_text()[:length]
        self._pieces, self._length, self._joined = [text], length, text
        self._unstreamed = self._unstreamed[:length - self._streamed]

    def _settled_text(self) -> str:
        if self._joined is None:
            self._joined = "".join(self._pieces)
            self._pieces = [self._joined]  # the next join starts from this one string
        return self._joined

    def _unsettled_text(self) -> str:
        """Decode of what has not settled: only for the final text, never for streaming."""
        if self._decoder is None or self._stop_reason is not None:
            return ""  # after a stop string, everything past the cut is dropped
        raw = self._decoder.pending_text()
        return self._cleanup.finish(raw) if self._cleanup is not None else raw


def _first_stop(window: str, stops: Sequence[str], old: int) -> tuple[str, int] | None:
    """The stop string occurrence in `window` that ends first after its first `old` characters.

    Returns (stop string, start index in window). Matches ending within the first `old`
    characters were already looked for (or deliberately ignored, under min_tokens).
    """
    best: tuple[int, int, str] | None = None  # (end, -length, stop)
    for stop in stops:
        at = window.find(stop, max(0, old - len(stop) + 1))
        if at >= 0:
            key = (at + len(stop), -len(stop), stop)
            if best is None or key < best:
                best = key
    if best is None:
        return None
    end, neg_length, stop = best
    return stop, end + neg_length


class _WindowDecoder:
    """The prefix/read-offset algorithm: text of a growing id list, decoding a few ids per step.

    ids[prefix:read] are context whose text was already produced, ids[read:] are not settled.
    Each step decodes the window ids[prefix:] and takes what follows the context's text. The
    context makes decoders that look at neighbouring tokens (SentencePiece's leading-space
    stripping, byte-level merges) decode the new ids as they would inside the whole sequence.
    The new text is held while it ends in U+FFFD: the last bytes may be the start of a character
    that later tokens complete (decoding it now would emit U+FFFD and later take it back). The
    window then grows by one id per step until its text stops ending in U+FFFD; that, and runs of
    ids that decode to nothing (skipped special tokens), are the only times a step decodes more
    than a few ids.

    Corner case: a byte-fallback decoder (`<0xC3>`-style tokens) decodes a whole run of byte
    tokens at once and, if the run is not valid UTF-8, turns every byte of it into U+FFFD. An
    invalid byte, or an unfinished last character, thus rewrites complete characters before it
    in the run: `<0xC3><0xA9>` is "é" and one more `<0x97>` makes it "���"; "日" followed by two
    of the three bytes of "本" decodes as five U+FFFD. No streaming decoder can follow that
    without taking text back, so there we keep the text produced and decode the rest on its own
    ("é�", "日��"). Byte-level BPE (GPT-2 style) decodes bytes with UTF-8 error recovery, which
    never rewrites a complete character, so it is exact for any ids.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self._prefix_text = ""  # decode(ids[prefix:read])
        self._produced: list[str] = []  # everything returned, for the rare resynchronisation

    def step(self, token_id: int) -> str:
        """Add one id; return the text that is now settled ("" if none)."""
        self._ids.append(token_id)
        text = self._decode(self._ids[self._prefix:])
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT):
            return ""
        if text.startswith(self._prefix_text):
            new = text[len(self._prefix_text):]
        else:
            new = self._resync()
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix:])
        self._produced.append(new)
        return new

    def pending_text(self) -> str:
        """Decode of the ids not settled yet, as a full decode would end (U+FFFD included)."""
        if self._read == len(self._ids):
            return ""
        text = self._decode(self._ids[self._prefix:])
        if text.startswith(self._prefix_text):
            return text[len(self._prefix_text):]
        return self._decode(self._ids[self._read:])  # the byte-fallback corner case

    def _resync(self) -> str:
        """New text when the window no longer starts with its context's text (rare).

        Decodes everything once: exact whenever the full decode still starts with the text
        already produced; otherwise (the byte-fallback corner case) decodes the new ids alone.
        """
        produced = "".join(self._produced)
        self._produced = [produced]
        full = self._decode(self._ids)
        if full.startswith(produced):
            return full[len(produced):]
        return self._decode(self._ids[self._read:])


class _SpaceCleanup:
    """transformers' `clean_up_tokenization` (" ," -> ",", " 's" -> "'s", ...) applied as text
    settles, for the tokenizers whose `decode` applies it.

    It deletes spaces in patterns of at most 4 characters that start with a space, so it cannot
    act across a point preceded by 3 non-space characters: text up to the last such point is
    cleaned and settled, the rest waits for more text (or for the end).
    """

    def __init__(self, clean: Callable[[str], str]) -> None:
        self._clean = clean
        self._raw = ""  # decoded text after the last safe point, not cleaned yet

    def settle(self, raw: str) -> str:
        raw = self._raw + raw
        cut = _last_safe_cut(raw)
        self._raw = raw[cut:]
        return self._clean(raw[:cut]) if cut else ""

    def finish(self, raw: str) -> str:
        return self._clean(self._raw + raw)


def _last_safe_cut(text: str) -> int:
    """The largest i > 0 such that text[i-3:i] holds no space (0 if there is none).

    `text` always starts at a previous cut (or at the start of the output), which itself had no
    space in the 3 characters before it, so a cut fewer than 3 characters in is safe too.
    """
    cut = len(text)
    while cut > 0:
        space = text.rfind(" ", max(0, cut - 3), cut)
        if space < 0:
            return cut
        cut = space
    return 0


def _window_decode_fn(tokenizer: Any, params: SamplingParams) -> Callable[[list[int]], str]:
    """`decode` for a window of ids, without transformers' space clean-up (done separately)."""
    skip = params.skip_special_tokens
    if isinstance(tokenizer, tokenizers.Tokenizer):
        backend: tokenizers.Tokenizer | None = tokenizer
    else:
        backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        # A transformers fast tokenizer's decode is the backend's decode plus the optional
        # clean-up; it ignores spaces_between_special_tokens (only slow tokenizers of
        # transformers 4.x read it; in 5.x no tokenizer does), so that flag has no effect here.
        return lambda ids: backend.decode(ids, skip_special_tokens=skip)
    spaces = params.spaces_between_special_tokens
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip,
                                        spaces_between_special_tokens=spaces,
                                        clean_up_tokenization_spaces=False)


def _cleans_up_spaces(tokenizer: Any) -> bool:
    """Whether `tokenizer.decode` applies `clean_up_tokenization` by default."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    if not callable(getattr(tokenizer, "clean_up_tokenization", None)):
        return False
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return True  # slow tokenizers always apply it when the flag is set
    # transformers 5 skips it for BPE models unless forced (it corrupts BPE output); 4.x, which
    # has no such flag, applies it to every fast tokenizer.
    force = getattr(tokenizer,
                    "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", None)
    if force is None:
        return True
    return bool(force) or type(backend.model).__name__ != "BPE"
