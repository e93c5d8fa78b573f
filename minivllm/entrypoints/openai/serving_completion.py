"""POST /v1/completions: one or more prompts, n samples each, streamed or not, with echo and
OpenAI's completion-style logprobs."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from minivllm.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    random_id,
)
from minivllm.entrypoints.openai.serving import (
    SSE_DONE,
    OpenAIError,
    OpenAIServing,
    merge_streams,
    off_loop,
    sse,
    stream_usage,
    top_logprobs,
    usage,
)
from minivllm.outputs import CompletionOutput, Logprob, RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest) -> CompletionResponse | AsyncIterator[str]:
        self.check_model(request.model)
        if request.suffix:
            raise OpenAIError("suffix is not supported.", 400, "suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise OpenAIError("best_of different from n is not supported.", 400, "best_of")
        prompts = await off_loop(self._prompts, request)
        request_id = random_id("cmpl")
        streams = []
        try:
            for i, (text, token_ids) in enumerate(prompts):
                max_tokens = self.resolve_max_tokens(len(token_ids), request.max_tokens, "prompt")
                params = request.to_sampling_params(max_tokens, request.logprobs)
                if request.echo and request.logprobs is not None:
                    params.prompt_logprobs = request.logprobs
                prompt = {"prompt_token_ids": token_ids, "prompt": text, "cache_salt": request.cache_salt}
                streams.append(await self.start(f"{request_id}-{i}", prompt, params, request.priority))
        except BaseException:
            for j in range(len(streams)):
                await self.engine.abort(f"{request_id}-{j}")
            raise
        if request.stream:
            return self._stream(request, request_id, prompts, streams)
        return await self._full(request, request_id, prompts, streams)

    def _prompts(self, request: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        prompt = request.prompt
        if isinstance(prompt, str):
            items: list = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            items = [prompt]
        else:
            items = list(prompt)
        if not items:
            raise OpenAIError("prompt must not be empty.", 400, "prompt")
        result = []
        for item in items:
            if isinstance(item, str):
                result.append((item, self.tokenizer.encode(item)))
            else:
                result.append((None, list(item)))
        return result

    async def _full(self, request, request_id, prompts, streams) -> CompletionResponse:
        finals: dict[int, RequestOutput] = {}
        async for i, output in merge_streams(streams):
            finals[i] = output
        choices = []
        num_generated = 0
        for i, (text, token_ids) in enumerate(prompts):
            output = finals[i]
            prompt_text = text if text is not None else self.tokenizer.decode(token_ids)
            for completion in output.outputs:
                num_generated += len(completion.token_ids)
                choices.append(self._choice(request, i, output, completion, prompt_text, echo=request.echo))
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        return CompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                  usage=usage(prompt_tokens, num_generated))

    def _choice(self, request, prompt_index, output, completion: CompletionOutput, prompt_text, echo) -> CompletionResponseChoice:
        text = (prompt_text if echo else "") + completion.text
        logprobs = None
        if request.logprobs is not None:
            positions: list = []
            tokens: list[int] = []
            if echo:
                positions += output.prompt_logprobs or [None] * len(output.prompt_token_ids)
                tokens += output.prompt_token_ids
            positions += completion.logprobs or []
            tokens += completion.token_ids
            logprobs = self._logprobs(tokens, positions, request.logprobs)
        return CompletionResponseChoice(
            index=prompt_index * request.n + completion.index,
            text=text,
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )

    def _logprobs(self, token_ids: list[int], positions: list[dict[int, Logprob] | None], num: int,
                  offset: int = 0) -> CompletionLogProbs:
        result = CompletionLogProbs()
        for token_id, position in zip(token_ids, positions, strict=True):
            token = self.tokenizer.decode([token_id])
            result.tokens.append(token)
            result.text_offset.append(offset)
            offset += len(token)
            if position is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            result.token_logprobs.append(position[token_id].logprob)
            result.top_logprobs.append(
                {(lp.decoded_token or self.tokenizer.decode([t])): lp.logprob for t, lp in top_logprobs(position, num)}
            )
        return result

    async def _stream(self, request, request_id, prompts, streams) -> AsyncIterator[str]:
        created = int(time.time())
        include_usage, continuous_usage = stream_usage(request.stream_options)
        num_generated: dict[int, int] = {}  # per choice, so far
        offsets: dict[int, int] = {}
        async for i, output in merge_streams(streams):
            text, token_ids = prompts[i]
            for completion in output.outputs:
                index = i * request.n + completion.index
                prefix = ""
                if request.echo and index not in num_generated:  # the prompt comes once, first
                    prefix = text if text is not None else self.tokenizer.decode(token_ids)
                num_generated[index] = num_generated.get(index, 0) + len(completion.token_ids)
                logprobs = None
                if request.logprobs is not None and completion.logprobs:
                    logprobs = self._logprobs(completion.token_ids, completion.logprobs, request.logprobs,
                                              offsets.get(index, 0))
                    offsets[index] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
                choice = CompletionResponseChoice(
                    index=index, text=prefix + completion.text, logprobs=logprobs,
                    finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
                )
                chunk_usage = usage(len(token_ids), num_generated[index]) if continuous_usage else None
                yield sse(CompletionStreamResponse(id=request_id, created=created, model=self.model_name,
                                                   choices=[choice], usage=chunk_usage))
        if include_usage:
            prompt_tokens = sum(len(ids) for _, ids in prompts)
            yield sse(CompletionStreamResponse(id=request_id, created=created, model=self.model_name, choices=[],
                                               usage=usage(prompt_tokens, sum(num_generated.values()))))
        yield SSE_DONE
