"""The real Gemma 3 270M behind `minivllm serve gemma-3-270m` (the packaged model's name): the
chat template renders Gemma's turns, greedy chat over HTTP is what the offline `LLM.chat` gives,
and `<end_of_turn>` ends a reply."""

from __future__ import annotations

import pytest
from server_utils import RemoteServer

from minivllm import SamplingParams

NAME = "gemma-3-270m"
MESSAGES = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Name a colour of the sky."},
]
END_OF_TURN = 106


@pytest.fixture(scope="module")
def gemma3(gemma3_gguf, make_module_llm):
    server = RemoteServer(NAME, ["--dtype", "float32", "--seed", "0", "--max-model-len", "1024"], wait=False)
    with server:
        llm = make_module_llm(gemma3_gguf, dtype="float32", max_model_len=1024)
        server.wait_ready()
        yield server, llm


def test_chat_template_and_special_tokens(gemma3):
    server, llm = gemma3
    tokenizer = llm.get_tokenizer()
    rendered = ("<bos><start_of_turn>user\nYou answer briefly.\n\nName a colour of the sky.<end_of_turn>\n"
                "<start_of_turn>model\n")
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    assert ids[:3] == [2, 105, 2364] and ids.count(END_OF_TURN) == 1  # <bos>, <start_of_turn>, user
    response = server.post("tokenize", {"messages": MESSAGES})
    assert response.status_code == 200, response.text
    assert response.json()["tokens"] == ids


def test_greedy_chat_equals_llm_chat(gemma3):
    server, llm = gemma3
    params = SamplingParams(temperature=0, max_tokens=24)
    [want] = llm.chat(MESSAGES, params, use_tqdm=False)
    with server.client() as client:
        chat = client.chat.completions.create(model=NAME, messages=MESSAGES, temperature=0, max_tokens=24)
        streamed = "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(model=NAME, messages=MESSAGES, temperature=0, max_tokens=24,
                                                    stream=True)
            if c.choices
        )
    [choice] = chat.choices
    assert choice.message.content == streamed == want.outputs[0].text
    assert chat.usage.completion_tokens == len(want.outputs[0].token_ids)
    assert chat.usage.prompt_tokens == len(want.prompt_token_ids)


def test_end_of_turn_ends_the_reply(gemma3):
    """Forced to end its turn at once (logit_bias), the model's reply stops there with nothing
    shown: `<end_of_turn>` is a stop token of every request, as in Gemma's generation config."""
    server, _ = gemma3
    with server.client() as client:
        chat = client.chat.completions.create(model=NAME, messages=MESSAGES, temperature=0, max_tokens=24,
                                              logit_bias={str(END_OF_TURN): 100})
    [choice] = chat.choices
    assert choice.finish_reason == "stop" and choice.message.content == ""
    assert chat.usage.completion_tokens == 1
