"""The OpenAI API's request and response bodies (pydantic), with vLLM's extra sampling fields.

Requests map onto SamplingParams in `to_sampling_params`; every field OpenAI clients send is
accepted, and fields minivllm cannot honour are rejected with a clear 400, not ignored.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from minivllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIBaseModel(BaseModel):
    # Unknown fields are accepted (clients send extras freely), as OpenAI and vLLM do.
    model_config = ConfigDict(extra="allow")


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class SamplingRequest(OpenAIBaseModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
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
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    cache_salt: str | None = None
    # vLLM's extra field: under --scheduling-policy priority, lower is served first.
    priority: int = 0
    # Structured output: OpenAI's response_format, vLLM's structured_outputs ({"json": ...,
    # "regex": ..., "choice": [...], "grammar": ..., ...}), or the older guided_* fields that
    # existing client code still sends.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
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
    prompt: str | list[str] | list[int] | list[list[int]]
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
    messages: list[dict[str, Any]]
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


class TokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(OpenAIBaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
