"""The chat route's stream, driven by an engine whose first token waits for the test: nothing
(not even the assistant's role) is sent before that token exists, so a client that times the
first chunk, as vLLM's benchmark does, measures the time to the first token."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from transformers import AutoTokenizer

from minivllm.entrypoints.openai.protocol import ChatCompletionRequest
from minivllm.entrypoints.openai.serving_chat import OpenAIServingChat
from minivllm.outputs import CompletionOutput, RequestOutput


class GatedEngine:
    """Just what the chat route asks of AsyncLLM; its outputs come once `first_token` is set."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(max_model_len=1024))
        self.first_token = asyncio.Event()

    def get_tokenizer(self):
        return self.tokenizer

    async def add_request(self, request_id, prompt, params, priority=0):
        return None

    async def stream_outputs(self, request_id, queue):
        await self.first_token.wait()
        for text, token, reason in (("Hi", 42, None), (" there", 43, "length")):
            completion = CompletionOutput(0, text, [token], None, None, finish_reason=reason)
            yield RequestOutput(request_id, None, [1, 2], [completion], finished=reason is not None)


def events(sse: list[str]) -> list[dict | str]:
    return [e if e == "[DONE]" else json.loads(e)
            for chunk in sse for e in [chunk.removeprefix("data: ").strip()]]


def test_role_goes_out_with_the_first_token(tokenizer_dir):
    async def main():
        engine = GatedEngine(AutoTokenizer.from_pretrained(tokenizer_dir))
        serving = OpenAIServingChat(engine, ["m"])
        request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hello"}],
                                        stream=True, max_tokens=2)
        stream = await serving.create_chat_completion(request)
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.2)
        sent_before_the_token = first.done()
        engine.first_token.set()
        return sent_before_the_token, [await first] + [chunk async for chunk in stream]

    sent_before_the_token, sse = asyncio.run(main())
    assert not sent_before_the_token
    role, hi, there, done = events(sse)
    delta = {k: v for k, v in role["choices"][0]["delta"].items() if v is not None}  # tool_calls: null
    assert delta == {"role": "assistant", "content": ""}
    assert hi["choices"][0]["delta"]["content"] == "Hi"
    assert there["choices"][0]["delta"]["content"] == " there"
    assert there["choices"][0]["finish_reason"] == "length"
    assert done == "[DONE]"
