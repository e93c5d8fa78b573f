"""POST /v1/chat/completions: messages through the model's chat template, n samples, streamed as
chat.completion.chunk deltas or returned whole, with OpenAI's chat-style logprobs, and vLLM's
`echo` (the reply starts with the last message when that message is the one being continued),
and tool calls forced by tool_choice (tool_calls.py)."""

from __future__ import annotations

import inspect
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from minivllm.engine.async_llm import AsyncLLM
from minivllm.entrypoints.openai.protocol import (
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogProb,
    ChatLogProbsContent,
    ChatMessage,
    DeltaMessage,
    random_id,
)
from minivllm.entrypoints.openai.serving import (
    SSE_DONE,
    OpenAIError,
    OpenAIServing,
    off_loop,
    sse,
    stream_usage,
    top_logprobs,
    usage,
)
from minivllm.entrypoints.openai.tool_calls import ToolChoice, parse_tool_choice, tool_calls
from minivllm.outputs import CompletionOutput, Logprob
from minivllm.sampling_params import StructuredOutputsParams


class OpenAIServingChat(OpenAIServing):
    def __init__(self, engine: AsyncLLM, served_model_names: list[str], trust_request_chat_template: bool = False) -> None:
        super().__init__(engine, served_model_names)
        self.trust_request_chat_template = trust_request_chat_template
        # apply_chat_template's own arguments: chat_template_kwargs setting one would change what
        # it returns (tokenize, return_dict) or override the request's fields.
        self._template_call_args = {
            name for name, p in inspect.signature(self.tokenizer.apply_chat_template).parameters.items()
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
        }

    async def create_chat_completion(self, request: ChatCompletionRequest) -> ChatCompletionResponse | AsyncIterator[str]:
        self.check_model(request.model)
        tool_choice, tool_schema = parse_tool_choice(request.tools, request.tool_choice)
        if request.top_logprobs is not None and not request.logprobs:
            raise OpenAIError("top_logprobs requires logprobs to be true.", 400, "top_logprobs")
        text, token_ids = await off_loop(self.render, request.messages, request)
        max_tokens = self.resolve_max_tokens(
            len(token_ids), request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens,
            "messages",
        )
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = request.to_sampling_params(max_tokens, logprobs)
        if tool_schema is not None:
            if params.structured_outputs is not None:
                raise OpenAIError("A forced tool call is already a structured output; drop response_format / "
                                  "structured_outputs.", 400, "tool_choice")
            params = msgspec.structs.replace(params, structured_outputs=StructuredOutputsParams(json=tool_schema))
        request_id = random_id("chatcmpl")
        prompt = {"prompt_token_ids": token_ids, "prompt": text, "cache_salt": request.cache_salt}
        stream = await self.start(request_id, prompt, params, request.priority)
        if request.stream:
            return self._stream(request, request_id, len(token_ids), params.logprobs, stream, tool_choice)
        final = None
        async for output in stream:
            final = output
        assert final is not None
        role = response_role(request)
        echo = echo_text(request, role)
        choices = []
        for c in final.outputs:
            message, finish_reason = ChatMessage(role=role, content=echo + c.text), c.finish_reason
            if tool_choice is not None and (calls := tool_calls(tool_choice, c.text)):
                message = ChatMessage(role=role, content=None, tool_calls=calls)
                finish_reason = tool_choice.finish_reason_when_called or finish_reason
            choices.append(ChatCompletionResponseChoice(
                index=c.index, message=message, logprobs=self._logprobs(c, params.logprobs),
                finish_reason=finish_reason, stop_reason=c.stop_reason,
            ))
        num_generated = sum(len(c.token_ids) for c in final.outputs)
        return ChatCompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                      usage=usage(len(token_ids), num_generated))

    def render(self, messages: list[dict[str, Any]], request: Any) -> tuple[str, list[int]]:
        """The conversation as prompt text and token ids, through the chat template."""
        chat_template = getattr(request, "chat_template", None)
        if chat_template is not None and not self.trust_request_chat_template:
            # A template is a program (Jinja's sandbox stops attribute tricks, not a gigabyte
            # string): run the client's only where the operator said so, as vLLM does.
            raise OpenAIError("A chat_template in the request is refused: the server was not started with "
                              "--trust-request-chat-template.", 400, "chat_template")
        template_kwargs = getattr(request, "chat_template_kwargs", None) or {}
        if reserved := sorted(self._template_call_args & template_kwargs.keys()):
            raise OpenAIError(f"chat_template_kwargs are the template's variables; {', '.join(reserved)} "
                              f"cannot be set through them.", 400, "chat_template_kwargs")
        try:
            text = self.tokenizer.apply_chat_template(
                [_plain_message(m) for m in messages],
                chat_template=chat_template,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=getattr(request, "continue_final_message", False),
                tokenize=False,
                tools=getattr(request, "tools", None) if getattr(request, "tool_choice", None) != "none" else None,
                **template_kwargs,
            )
        except Exception as e:  # a template that rejects the conversation is the caller's problem
            raise OpenAIError(f"Could not apply the chat template: {e}", 400, "messages") from e
        return text, self.tokenizer.encode(text, add_special_tokens=False)

    def _logprobs(self, completion: CompletionOutput, num: int | None) -> ChatCompletionLogProbs | None:
        if num is None or completion.logprobs is None:
            return None
        return ChatCompletionLogProbs(content=[
            self._logprob_entry(token_id, position, num)
            for token_id, position in zip(completion.token_ids, completion.logprobs, strict=True)
        ])

    def _logprob_entry(self, token_id: int, position: dict[int, Logprob], num: int) -> ChatLogProbsContent:
        def entry(t: int, lp: Logprob) -> ChatLogProb:
            token = lp.decoded_token if lp.decoded_token is not None else self.tokenizer.decode([t])
            return ChatLogProb(token=token, logprob=lp.logprob, bytes=list(token.encode()))

        chosen = entry(token_id, position[token_id])
        return ChatLogProbsContent(
            **chosen.model_dump(), top_logprobs=[entry(t, lp) for t, lp in top_logprobs(position, num)]
        )

    async def _stream(self, request, request_id, prompt_tokens, logprobs, stream, tool_choice) -> AsyncIterator[str]:
        created = int(time.time())
        include_usage, continuous_usage = stream_usage(request.stream_options)
        num_generated = [0] * request.n  # per choice, so far

        def chunk(choices, completion_tokens: int | None = None) -> str:
            """One chunk; with continuous usage, the usage of a choice with that many tokens."""
            chunk_usage = usage(prompt_tokens, completion_tokens) if continuous_usage else None
            return sse(ChatCompletionStreamResponse(id=request_id, created=created, model=self.model_name,
                                                    choices=choices, usage=chunk_usage))

        def to_all(delta: DeltaMessage) -> list[ChatCompletionResponseStreamChoice]:
            return [ChatCompletionResponseStreamChoice(index=i, delta=delta) for i in range(request.n)]

        role = response_role(request)
        started = False
        tool_deltas = [ToolCallDeltas(tool_choice) for _ in range(request.n)] if tool_choice is not None else []
        async for output in stream:
            for c in output.outputs:
                num_generated[c.index] += len(c.token_ids)
                if not c.text and not c.finished() and not c.token_ids:
                    continue
                if not started:
                    # The role (and the echo) go out with the first generated token, as vLLM's
                    # server sends them: a client that times the first chunk (vLLM's benchmark,
                    # most load testers) then measures the time to the first token.
                    started = True
                    yield chunk(to_all(DeltaMessage(role=role, content="")), 0)
                    if echo := echo_text(request, role):
                        yield chunk(to_all(DeltaMessage(content=echo)), 0)
                delta, finish_reason = DeltaMessage(content=c.text), c.finish_reason
                if tool_choice is not None:
                    delta, finish_reason = tool_deltas[c.index].delta(c.text, c.finished(), finish_reason)
                    if delta is None:
                        continue
                yield chunk([ChatCompletionResponseStreamChoice(
                    index=c.index, delta=delta, logprobs=self._logprobs(c, logprobs),
                    finish_reason=finish_reason, stop_reason=c.stop_reason,
                )], num_generated[c.index])
        if include_usage:
            yield sse(ChatCompletionStreamResponse(id=request_id, created=created, model=self.model_name,
                                                   choices=[], usage=usage(prompt_tokens, sum(num_generated))))
        yield SSE_DONE


class ToolCallDeltas:
    """One streamed choice's tool calls in OpenAI's delta format. A named call streams its
    arguments as they come (the reply is the arguments); calls under "required" go out whole
    when the reply is complete (the array must be parsed to split it into calls)."""

    def __init__(self, choice: ToolChoice) -> None:
        self.choice = choice
        self.text = ""
        self.call_id: str | None = None

    def delta(self, text: str, finished: bool, finish_reason: str | None) -> tuple[DeltaMessage | None, str | None]:
        """The delta for the next piece of text (None: nothing to send yet) and the finish reason."""
        self.text += text
        if self.choice.name is not None:
            if self.call_id is None:
                self.call_id = random_id("call")
                call = {"index": 0, "id": self.call_id, "type": "function",
                        "function": {"name": self.choice.name, "arguments": text}}
            else:
                call = {"index": 0, "function": {"arguments": text}}
            return DeltaMessage(tool_calls=[call]), finish_reason
        if not finished:
            return None, None
        calls = tool_calls(self.choice, self.text)
        if not calls:  # cut short: what there is, as content
            return DeltaMessage(content=self.text), finish_reason
        return (DeltaMessage(tool_calls=[{"index": i, **call} for i, call in enumerate(calls)]),
                self.choice.finish_reason_when_called)


def response_role(request: ChatCompletionRequest) -> str:
    """The role of the reply (vLLM's rule): the assistant's, or, without a generation prompt, that
    of the last message, which the model then continues."""
    if request.add_generation_prompt or not request.messages:
        return "assistant"
    return request.messages[-1]["role"]


def echo_text(request: ChatCompletionRequest, role: str) -> str:
    """With echo, what the reply starts with: the last message's content when that message has the
    reply's role (the message being continued), else nothing."""
    if not request.echo or not request.messages or request.messages[-1].get("role") != role:
        return ""
    return _plain_message(request.messages[-1]).get("content") or ""


def _plain_message(message: dict[str, Any]) -> dict[str, Any]:
    """OpenAI allows content as a list of text parts (protocol.py checks them); templates want a
    string."""
    content = message.get("content")
    if isinstance(content, list):
        message = {**message, "content": "".join(part["text"] for part in content)}
    return message
