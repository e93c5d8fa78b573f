"""What the completion and chat endpoints share: model-name checks, OpenAI-style errors, the
max_tokens rule, merging several streams, and SSE framing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from http import HTTPStatus
from typing import Any, TypeVar

from pydantic import BaseModel

from minivllm.engine.async_llm import AsyncLLM
from minivllm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse, StreamOptions, UsageInfo
from minivllm.outputs import Logprob, RequestOutput
from minivllm.sampling_params import SamplingParams

T = TypeVar("T")


class OpenAIError(Exception):
    """An error the client caused (or must know about), with its HTTP status and OpenAI type."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status, self.param)


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    info = ErrorInfo(message=message, type=error_type(status), param=param, code=status)
    return ErrorResponse(error=info).model_dump()


def error_type(status: int) -> str:
    """The error's type as vLLM and the openai client name it: the status's phrase,
    "BadRequestError", "NotFoundError", "MethodNotAllowedError", "InternalServerError"..., but
    401 "AuthenticationError"."""
    if status == HTTPStatus.UNAUTHORIZED:
        return "AuthenticationError"
    phrase = HTTPStatus(status).phrase.replace(" ", "").replace("-", "")
    return phrase if phrase.endswith("Error") else phrase + "Error"


# The server's tokenizer work (chat templates, encoding, decoding) runs on these threads, off the
# event loop: HF's fast tokenizers release the GIL, so a prompt of megabytes (seconds of work, to
# be refused as too long at the end) stalls no stream, no /health and no other client. They only
# read the tokenizer (nothing sets its truncation or padding), which Rust allows from many threads.
_TOKENIZER_THREADS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="minivllm-tokenizer")


async def off_loop(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """fn(*args, **kwargs) on a tokenizer thread."""
    return await asyncio.get_running_loop().run_in_executor(_TOKENIZER_THREADS, partial(fn, *args, **kwargs))


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, served_model_names: list[str]) -> None:
        self.engine = engine
        self.tokenizer = engine.get_tokenizer()
        self.served_model_names = served_model_names
        self.max_model_len = engine.vllm_config.model_config.max_model_len

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names:
            raise OpenAIError(f"The model `{model}` does not exist.", 404, "model")

    async def start(
        self, request_id: str, prompt: dict[str, Any], params: SamplingParams, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """Add the request now (so a rejection is a 400 before any response is sent) and return
        its output stream. If a later request of the same call is rejected, the earlier ones are
        aborted by the caller closing their streams."""
        queue = await self.engine.add_request(request_id, prompt, params, priority)
        return self.engine.stream_outputs(request_id, queue)

    def resolve_max_tokens(self, prompt_len: int, requested: int | None, prompt_field: str) -> int:
        """OpenAI's rule: the prompt plus max_tokens must fit the context; unset means all of it.
        `prompt_field` ("prompt" or "messages") is the param an over-long prompt is blamed on."""
        if prompt_len >= self.max_model_len:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                f"prompt has {prompt_len} tokens, leaving no room to generate.", 400, prompt_field
            )
        if requested is None:
            return self.max_model_len - prompt_len
        if requested >= 1 and prompt_len + requested > self.max_model_len:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} "
                f"in the completion). Please reduce the length of the prompt or the completion.",
                400, "max_tokens",
            )
        return requested


def top_logprobs(position: dict[int, Logprob], num: int) -> list[tuple[int, Logprob]]:
    """The `num` most likely tokens at a position, by rank (the position may also hold the
    sampled token with a rank beyond `num`)."""
    return sorted((kv for kv in position.items() if kv[1].rank and kv[1].rank <= num), key=lambda kv: kv[1].rank)


def usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


def stream_usage(options: StreamOptions | None) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) of a stream, as vLLM reads them: usage in a last
    chunk of its own, and (only with it) in every chunk, counting what that choice has so far."""
    include_usage = options is not None and options.include_usage
    return include_usage, include_usage and options.continuous_usage_stats


async def merge_streams(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as their outputs arrive, tagged with their index."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
        except BaseException as e:  # noqa: BLE001 (re-raised in the consumer)
            await queue.put(e)
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def sse(chunk: BaseModel | dict[str, Any]) -> str:
    data = chunk.model_dump_json(exclude_unset=False) if isinstance(chunk, BaseModel) else json.dumps(chunk)
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"
