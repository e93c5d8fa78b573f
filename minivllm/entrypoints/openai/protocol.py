"""The OpenAI API's request and response bodies (pydantic), with vLLM's extra sampling fields.

Requests map onto SamplingParams in `to_sampling_params`; every field OpenAI clients send is
accepted, and fields minivllm cannot honour are rejected with a clear 400, not ignored. What no
request may carry is refused here, before it costs anything: numbers that are not finite, text
that is not Unicode (lone surrogates), chat roles and content parts no template expects, and more
samples, stop strings or logit bias than OpenAI allows.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from minivllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# OpenAI's limits: n at most 128, each logit bias in [-100, 100]. OpenAI takes 4 stop strings;
# minivllm takes 64, enough for any chat format, few enough that matching them against the text
# after every token (in the front end, for every request at once) stays cheap.
MAX_N = 128
MAX_LOGIT_BIAS = 100.0
MAX_STOP_STRINGS = 64
# OpenAI's chat roles: what chat templates are written for.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class OpenAIBaseModel(BaseModel):
    # Unknown fields are accepted (clients send extras freely), as OpenAI and vLLM do.
    model_config = ConfigDict(extra="allow")


class OpenAIRequest(OpenAIBaseModel):
    """A request body. Python's JSON parser reads NaN, Infinity and overflowing numbers (1e400) as
    floats that no sampler can use: refused. JSON's \\ud800 escapes read as lone surrogates, which
    the tokenizer, the chat template and the UTF-8 encoder each fail on differently: refused."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _check_unicode(cls, value: Any) -> Any:
        # Iterative: the body may nest as deep as the JSON parser allows.
        pending = [value]
        while pending:
            item = pending.pop()
            if isinstance(item, str):
                if not item.isascii():
                    try:
                        item.encode("utf-8")
                    except UnicodeEncodeError as e:
                        raise PydanticCustomError(
                            "lone_surrogate", "Text must be valid Unicode; found a lone surrogate {char}.",
                            {"char": ascii(e.object[e.start])}) from None
            elif isinstance(item, dict):
                pending += item.keys()
                pending += item.values()
            elif isinstance(item, list):
                pending += item
        return value


def _shown(value: Any) -> str:
    """A value of the request, quoted in an error message: ASCII, and short."""
    text = ascii(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_logit_bias(bias: dict[str, float] | None) -> dict[str, float] | None:
    for token, value in (bias or {}).items():
        try:
            int(token)
        except ValueError:
            raise PydanticCustomError("logit_bias_key", "logit_bias keys must be token ids, got {token}.",
                                      {"token": _shown(token)}) from None
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise PydanticCustomError("logit_bias_value", "logit_bias values must be in [-100, 100], got {value}.",
                                      {"value": value})
    return bias


def _check_stop(stop: str | list[str] | None) -> str | list[str] | None:
    if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
        raise PydanticCustomError("too_many_stop_strings", "At most {limit} stop strings, got {count}.",
                                  {"limit": MAX_STOP_STRINGS, "count": len(stop)})
    return stop


def _check_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each message has one of OpenAI's roles and content that is text: a string, null (an
    assistant's tool calls), or text parts (images and audio are not served)."""
    for i, message in enumerate(messages):
        role = message.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise PydanticCustomError("chat_role", "Message {i} needs a role among {roles}; got {role}.",
                                      {"i": i, "roles": ", ".join(CHAT_ROLES), "role": _shown(role)})
        content = message.get("content")
        parts = content if isinstance(content, list) else None
        if parts is None and content is not None and not isinstance(content, str):
            raise PydanticCustomError("chat_content", "Message {i}: content must be a string or a list of parts.",
                                      {"i": i})
        for part in parts or ():
            if not isinstance(part, dict) or part.get("type") != "text":
                raise PydanticCustomError("chat_content", "Message {i}: only text content parts are supported.",
                                          {"i": i})
            if not isinstance(part.get("text"), str):
                raise PydanticCustomError("chat_content", "Message {i}: a text content part needs a string `text`.",
                                          {"i": i})
    return messages


# What _check_messages accepts, as /openapi.json says it (a message's other keys, name,
# tool_calls..., go to the chat template as they are; no template takes an empty conversation).
CHAT_MESSAGES_SCHEMA = {"type": "array", "minItems": 1, "items": {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"enum": list(CHAT_ROLES)},
        "content": {"anyOf": [{"type": "string"}, {"type": "null"}, {"type": "array", "items": {
            "type": "object",
            "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
        }}]},
    },
}}
ChatMessages = Annotated[list[dict[str, Any]], AfterValidator(_check_messages), WithJsonSchema(CHAT_MESSAGES_SCHEMA)]
# What _check_logit_bias accepts (its keys as the document says them: int() reads " 5" too).
LOGIT_BIAS_SCHEMA = {
    "type": "object",
    "propertyNames": {"pattern": "^-?[0-9]+$"},
    "additionalProperties": {"type": "number", "minimum": -MAX_LOGIT_BIAS, "maximum": MAX_LOGIT_BIAS},
}


# For /openapi.json, on a field whose empty string or list is refused (minLength and minItems
# hold for strings and arrays only, so this fits a union with null or with the other).
NON_EMPTY = {"minLength": 1, "minItems": 1}


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class SamplingRequest(OpenAIRequest):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = Field(1, le=MAX_N)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: Annotated[str | list[str] | None, AfterValidator(_check_stop)] = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Annotated[Annotated[dict[str, float], WithJsonSchema(LOGIT_BIAS_SCHEMA)] | None,
                          AfterValidator(_check_logit_bias)] = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # NON_EMPTY: what SamplingParams refuses, documented.
    allowed_token_ids: list[int] | None = Field(None, json_schema_extra=NON_EMPTY)
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    # vLLM's: separates this request's prefix-cache entries from other users' (a non-empty string).
    cache_salt: str | None = Field(None, min_length=1)
    # vLLM's extra field: under --scheduling-policy priority, lower is served first.
    priority: int = 0
    # Structured output: OpenAI's response_format, vLLM's structured_outputs ({"json": ...,
    # "regex": ..., "choice": [...], "grammar": ..., ...}), or the older guided_* fields that
    # existing client code still sends.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, json_schema_extra=NON_EMPTY)
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None

    @model_validator(mode="after")
    def _check_stream_options(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true.")
        return self

    def to_sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            n=self.n,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            structured_outputs=self.structured_outputs_params(),
        )

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The request's constraint from whichever of its fields gives one (a ValueError, so a
        400, when several do or one is malformed)."""
        given: list[tuple[str, dict[str, Any]]] = []
        if self.structured_outputs is not None:
            given.append(("structured_outputs", dict(self.structured_outputs)))
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            given.append(("response_format", _response_format_constraint(self.response_format)))
        guided = {kind: value for kind, value in (("json", self.guided_json), ("regex", self.guided_regex),
                                                  ("choice", self.guided_choice), ("grammar", self.guided_grammar))
                  if value is not None}
        if guided:
            if self.guided_whitespace_pattern is not None:
                guided["whitespace_pattern"] = self.guided_whitespace_pattern
            given.append(("guided_*", guided))
        if not given:
            return None
        if len(given) > 1:
            raise ValueError(f"Give one structured output constraint, not {' and '.join(name for name, _ in given)}.")
        name, fields = given[0]
        try:
            return StructuredOutputsParams(**fields)
        except TypeError as e:  # an unknown field
            raise ValueError(f"Bad {name}: {e}.") from None


def _response_format_constraint(response_format: dict[str, Any]) -> dict[str, Any]:
    kind = response_format.get("type")
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        json_schema = response_format.get("json_schema")
        if not isinstance(json_schema, dict) or "schema" not in json_schema:
            raise ValueError("response_format of type json_schema needs json_schema.schema.")
        # NOTE: "strict" is accepted and has no effect: the schema is always enforced (vLLM too).
        return {"json": json_schema["schema"]}
    if kind == "structural_tag":
        return {"structural_tag": json.dumps(response_format)}
    raise ValueError(f"Unknown response_format type {kind!r}; use text, json_object, json_schema or structural_tag.")


# ---- completions ------------------------------------------------------------------------------


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(json_schema_extra=NON_EMPTY)
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


# ---- chat -------------------------------------------------------------------------------------


class ChatCompletionRequest(SamplingRequest):
    messages: ChatMessages
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    # vLLM's extras
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class ChatLogProb(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatLogProbsContent] | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# ---- models, tokenizer ------------------------------------------------------------------------


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "minivllm"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(OpenAIRequest):
    model: str | None = None
    prompt: str | None = None
    messages: ChatMessages | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(OpenAIBaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(OpenAIRequest):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


class VersionResponse(OpenAIBaseModel):
    version: str


# ---- errors -----------------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    """`type` names the status ("BadRequestError"...; serving.error_type), `code` is the status,
    `param` the request field at fault, if one is."""

    model_config = ConfigDict(extra="forbid")

    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    """OpenAI's error body, which every error status of the server carries (serving.error_body
    builds it, so what /openapi.json documents is what is sent)."""

    model_config = ConfigDict(extra="forbid")

    error: ErrorInfo
