"""User-facing sampling parameters, with vLLM's names and defaults.

A SamplingParams travels with its request from the front end (validation happens here, in
__post_init__, so that a bad value is a ValueError before anything reaches the engine) to the
scheduler (stop conditions), the worker (the sampler) and the output processor (stop strings,
detokenization). It is a msgspec Struct so that it can cross the process boundary as-is.
"""

from __future__ import annotations

from enum import IntEnum

import msgspec

_SAMPLING_EPS = 1e-5


def is_int64(value: object) -> bool:
    """A signed 64-bit integer: the widest that msgpack, numpy and torch carry to the engine core.
    A wider one would fail there (a top_k of 2**63 crashed the worker), not in the front end."""
    return isinstance(value, int) and -(2**63) <= value < 2**63


class RequestOutputKind(IntEnum):
    """What each RequestOutput of a request carries."""

    CUMULATIVE = 0  # everything generated so far, every step
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # one output, when the request finishes


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """A constraint on what a request may generate (vLLM's fields): exactly one of a JSON schema
    (`json`, a dict or its JSON text), `regex`, `choice` (one of these strings), `grammar` (EBNF
    as xgrammar reads it, GBNF included), `json_object` (any JSON object) or `structural_tag`
    (xgrammar's structural-tag JSON). The options shape JSON: `disable_any_whitespace` (no
    free whitespace between tokens), `disable_additional_properties` (objects get
    "additionalProperties": false unless the schema says otherwise), `whitespace_pattern` (a regex
    for the whitespace allowed, llguidance only).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    # Filled by the engine's input processor: the backend that compiles it ("xgrammar",
    # "guidance"), the engine's choice or, under "auto", the first that accepts the constraint.
    backend: str | None = None

    KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

    def __post_init__(self) -> None:
        given = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("Structured outputs need exactly one of json, regex, choice, grammar, json_object "
                             f"or structural_tag; got {', '.join(given) or 'none'}.")
        if self.choice is not None and not (self.choice and all(isinstance(c, str) for c in self.choice)):
            raise ValueError("Structured outputs: choice must be a non-empty list of strings.")

    @property
    def kind(self) -> str:
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Sampling parameters for text generation (vLLM's fields, names and defaults).

    temperature 0 means greedy. top_k 0 or -1 disables top-k. max_tokens None means "until
    max_model_len". Penalties follow vLLM/OpenAI: repetition_penalty multiplies (>1 discourages
    tokens seen in the prompt or output), presence/frequency penalties subtract (per token seen /
    per occurrence in the output).
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    # Filled by the engine's input processor from bad_words (the worker has no tokenizer).
    bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.logit_bias is not None:
            # JSON objects have string keys; accept them as token ids.
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self._verify_args()
        if self.temperature < _SAMPLING_EPS:
            # Greedy: the truncation knobs cannot change the argmax, so normalise them away.
            self.temperature = 0.0
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0
        if self.top_k == -1:
            self.top_k = 0

    def _verify_args(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        check(isinstance(self.n, int) and self.n >= 1, f"n must be at least 1, got {self.n}.")
        check(-2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        check(-2.0 <= self.frequency_penalty <= 2.0, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        check(self.repetition_penalty > 0.0, f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        check(self.temperature >= 0.0, f"temperature must be non-negative, got {self.temperature}.")
        check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}.")
        check(is_int64(self.top_k) and self.top_k >= -1,
              f"top_k must be -1 (disable), 0 (disable), or at least 1 (a 64-bit integer), got {self.top_k}.")
        check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}.")
        check(self.seed is None or is_int64(self.seed),
              f"seed must be a 64-bit signed integer, got {self.seed!r}.")
        check(self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}.")
        check(self.min_tokens >= 0, f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
              f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}.")
        check(self.logprobs is None or self.logprobs >= 0, f"logprobs must be non-negative, got {self.logprobs}.")
        check(self.prompt_logprobs is None or self.prompt_logprobs >= 0,
              f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}.")
        check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings.")
        check(not self.stop or self.detokenize, "stop strings are only supported when detokenize is True.")
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
              "stop_token_ids must be non-negative integers.")
        check(self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
              "allowed_token_ids must not be empty.")
        check(self.bad_words is None or all(isinstance(w, str) and w for w in self.bad_words),
              "bad_words must be non-empty strings.")

    def get_stop_token_ids(self, eos_token_id: int | None) -> list[int]:
        """The token ids that end a request with these params (once min_tokens are out): its
        stop_token_ids, and EOS unless ignore_eos. The one stop-token rule of the engine: the
        scheduler stops on them, the sampler bans them before min_tokens."""
        eos = [] if self.ignore_eos or eos_token_id is None else [eos_token_id]
        return [*(self.stop_token_ids or ()), *eos]
