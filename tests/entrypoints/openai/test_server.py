"""`minivllm serve` end to end over HTTP with the official openai client: completions and chat,
streamed and not, n, logprobs, echo, stop, seeds, usage, vLLM's extra sampling fields, the
auxiliary routes, and agreement with the offline `LLM` on the same (tiny, float32) model."""

from __future__ import annotations

import pytest
from server_utils import MAX_MODEL_LEN, MODEL_ALIAS, MODEL_NAME
from transformers import AutoTokenizer

import minivllm
from minivllm import SamplingParams

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
MESSAGES = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Name three colors, please."},
]
GREEDY_LEN = 16


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_dir, make_module_llm):
    return make_module_llm(tiny_llama_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, seed=0)


def greedy_completion(client, prompt=PROMPT, max_tokens=GREEDY_LEN, **kwargs):
    return client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens,
                                     temperature=0, **kwargs)


def greedy_chat(client, messages=MESSAGES, max_tokens=GREEDY_LEN, **kwargs):
    return client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=max_tokens,
                                          temperature=0, **kwargs)


IGNORE_EOS = {"extra_body": {"ignore_eos": True}}


# ---- auxiliary routes -------------------------------------------------------------------------


def test_models_lists_every_served_name(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME, MODEL_ALIAS]
    assert all(m.object == "model" for m in models.data)
    raw = server.get("v1/models").json()
    assert raw["object"] == "list"
    assert all(card["max_model_len"] == MAX_MODEL_LEN for card in raw["data"])
    # Every served name is accepted; responses carry the first one.
    for name in (MODEL_NAME, MODEL_ALIAS):
        completion = client.completions.create(model=name, prompt="Hi", max_tokens=2)
        assert completion.model == MODEL_NAME
        chat = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=2)
        assert chat.model == MODEL_NAME


def test_health_and_version(server):
    health = server.get("health")
    assert health.status_code == 200
    version = server.get("version")
    assert version.status_code == 200
    assert version.json() == {"version": minivllm.__version__}


def test_tokenize_prompt_and_messages(server, tokenizer):
    response = server.post("tokenize", {"prompt": PROMPT})
    assert response.status_code == 200, response.text
    body = response.json()
    expected = tokenizer.encode(PROMPT)
    assert body["tokens"] == expected
    assert body["count"] == len(expected)
    assert body["max_model_len"] == MAX_MODEL_LEN

    response = server.post("tokenize", {"model": MODEL_NAME, "messages": MESSAGES})
    assert response.status_code == 200, response.text
    body = response.json()
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    expected = tokenizer.encode(text, add_special_tokens=False)
    assert body["tokens"] == expected
    assert body["count"] == len(expected)
    # The chat form counts what a chat request's usage reports as prompt tokens.
    chat = server.client().chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=1)
    assert chat.usage.prompt_tokens == body["count"]


def test_detokenize_round_trip(server, tokenizer):
    for text in (PROMPT, "Hello, world! 123 — ünïcödé"):
        tokens = server.post("tokenize", {"prompt": text}).json()["tokens"]
        response = server.post("detokenize", {"model": MODEL_NAME, "tokens": tokens})
        assert response.status_code == 200, response.text
        assert response.json() == {"prompt": text}
        assert response.json()["prompt"] == tokenizer.decode(tokens)


# ---- completions ------------------------------------------------------------------------------


def test_completion_usage_and_finish_reason(server, client):
    prompt_tokens = server.count_tokens(PROMPT)
    completion = greedy_completion(client, max_tokens=7, **IGNORE_EOS)
    assert completion.object == "text_completion"
    assert completion.id and completion.created > 0
    [choice] = completion.choices
    assert choice.index == 0
    assert choice.finish_reason == "length"
    assert choice.text
    assert completion.usage.prompt_tokens == prompt_tokens
    assert completion.usage.completion_tokens == 7
    assert completion.usage.total_tokens == prompt_tokens + 7


def test_completion_prompt_as_token_ids(server, client):
    tokens = server.post("tokenize", {"prompt": PROMPT}).json()["tokens"]
    by_text = greedy_completion(client, **IGNORE_EOS)
    by_ids = greedy_completion(client, prompt=tokens, **IGNORE_EOS)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage == by_text.usage
    # A batch of prompts: one choice per prompt, in order.
    batch = greedy_completion(client, prompt=[PROMPT, "Hi"], **IGNORE_EOS)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == by_text.choices[0].text
    assert batch.usage.completion_tokens == 2 * GREEDY_LEN


def test_completion_stream_equals_non_stream(server, client):
    full = greedy_completion(client, **IGNORE_EOS)
    chunks = list(greedy_completion(client, stream=True, stream_options={"include_usage": True},
                                    **IGNORE_EOS))
    *content, last = chunks
    assert content, "no content chunks"
    assert "".join(c.choices[0].text for c in content if c.choices) == full.choices[0].text
    finish = [c.choices[0].finish_reason for c in content if c.choices]
    assert finish[-1] == "length" and not any(finish[:-1])
    assert all(c.usage is None for c in content)
    # include_usage: the last chunk has the usage and no choices.
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.model_dump() == full.usage.model_dump()


def test_completion_stream_without_include_usage_has_no_usage(client):
    chunks = list(greedy_completion(client, max_tokens=4, stream=True))
    assert chunks and all(c.usage is None for c in chunks)
    assert all(c.choices for c in chunks)


def test_completion_continuous_usage_stats(client, tokenizer):
    """With include_usage and continuous_usage_stats, every chunk carries its choice's usage so
    far: the prompt's tokens, and the tokens that choice has streamed (counted from the chunks'
    logprobs), as vLLM does; the last chunk the whole request's."""
    prompt_tokens = len(tokenizer.encode(PROMPT))
    chunks = list(greedy_completion(client, max_tokens=5, n=2, logprobs=0, stream=True,
                                    stream_options={"include_usage": True, "continuous_usage_stats": True},
                                    **IGNORE_EOS))
    *content, last = chunks
    streamed = {0: 0, 1: 0}
    for chunk in content:
        [choice] = chunk.choices
        streamed[choice.index] += len(choice.logprobs.tokens)
        assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens, chunk.usage.total_tokens) == (
            prompt_tokens, streamed[choice.index], prompt_tokens + streamed[choice.index])
    assert streamed == {0: 5, 1: 5}
    assert last.choices == [] and (last.usage.prompt_tokens, last.usage.completion_tokens) == (prompt_tokens, 10)
    # Without include_usage, continuous_usage_stats adds nothing (vLLM's rule).
    quiet = greedy_completion(client, max_tokens=3, stream=True, stream_options={"continuous_usage_stats": True})
    assert all(c.usage is None for c in quiet)


def test_stream_options_need_stream(server):
    for route, body in (("v1/completions", {"prompt": PROMPT}), ("v1/chat/completions", {"messages": MESSAGES})):
        response = server.post(route, {**body, "model": MODEL_NAME, "stream_options": {"include_usage": True}})
        assert response.status_code == 400, response.text
        assert "stream_options" in response.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_completion_n2(client, stream):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, n=2, temperature=0,
                  extra_body={"ignore_eos": True})
    if not stream:
        completion = client.completions.create(**kwargs)
        texts = {c.index: c.text for c in completion.choices}
        reasons = {c.index: c.finish_reason for c in completion.choices}
        assert completion.usage.completion_tokens == 12
    else:
        texts, reasons = {0: "", 1: ""}, {}
        stream_usage = None
        for chunk in client.completions.create(**kwargs, stream=True,
                                               stream_options={"include_usage": True}):
            for c in chunk.choices:
                texts[c.index] += c.text
                if c.finish_reason is not None:
                    reasons[c.index] = c.finish_reason
            stream_usage = chunk.usage or stream_usage
        assert stream_usage is not None and stream_usage.completion_tokens == 12
    assert sorted(texts) == [0, 1]
    assert reasons == {0: "length", 1: "length"}
    # Greedy: both samples are the same text, the one n=1 gives.
    single = greedy_completion(client, max_tokens=6, **IGNORE_EOS).choices[0].text
    assert texts[0] == texts[1] == single


def test_completion_n2_sampled_choices(client):
    completion = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, n=2,
                                           temperature=1.0, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in completion.choices) == [0, 1]
    assert all(c.text for c in completion.choices)
    assert completion.usage.completion_tokens == 24
    # Two independent samples of 12 tokens from a 49k vocabulary at temperature 1 differ.
    assert completion.choices[0].text != completion.choices[1].text


def _check_completion_logprobs(logprobs, text, num, start=0):
    n = len(logprobs.tokens)
    assert n > 0
    assert len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == len(logprobs.text_offset) == n
    assert logprobs.text_offset[0] == start
    for i in range(1, n):
        assert logprobs.text_offset[i] == logprobs.text_offset[i - 1] + len(logprobs.tokens[i - 1])
    if not any("\ufffd" in t for t in logprobs.tokens):  # no token that is half a character
        assert "".join(logprobs.tokens) == text[start:]
    for token, lp, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs,
                              strict=True):
        if lp is None:  # the first echoed prompt token has no logprob
            assert top is None
            continue
        assert lp <= 0.0
        assert 1 <= len(top) <= num
        assert all(v <= 0.0 for v in top.values())
        # Greedy: the chosen token is the most likely one.
        assert top[token] == pytest.approx(lp, abs=1e-4)
        assert lp == pytest.approx(max(top.values()), abs=1e-4)


def test_completion_logprobs(client):
    completion = greedy_completion(client, logprobs=3, **IGNORE_EOS)
    [choice] = completion.choices
    lp = choice.logprobs
    assert len(lp.tokens) == GREEDY_LEN == completion.usage.completion_tokens
    assert all(len(top) == 3 for top in lp.top_logprobs)
    _check_completion_logprobs(lp, choice.text, 3)
    # Asking for logprobs does not change the text.
    assert choice.text == greedy_completion(client, **IGNORE_EOS).choices[0].text


def test_completion_stream_logprobs_equal_non_stream(client):
    full = greedy_completion(client, logprobs=2, **IGNORE_EOS).choices[0].logprobs
    tokens, offsets, token_logprobs = [], [], []
    for chunk in greedy_completion(client, logprobs=2, stream=True, **IGNORE_EOS):
        for c in chunk.choices:
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                offsets += c.logprobs.text_offset
                token_logprobs += c.logprobs.token_logprobs
    assert tokens == full.tokens
    assert offsets == full.text_offset
    assert token_logprobs == pytest.approx(full.token_logprobs, abs=1e-4)


def test_completion_echo(server, client):
    plain = greedy_completion(client, **IGNORE_EOS).choices[0].text
    echoed = greedy_completion(client, echo=True, **IGNORE_EOS)
    assert echoed.choices[0].text == PROMPT + plain
    assert echoed.usage.prompt_tokens == server.count_tokens(PROMPT)
    assert echoed.usage.completion_tokens == GREEDY_LEN

    # echo + logprobs: prompt tokens first (the very first one without a logprob).
    with_lp = greedy_completion(client, echo=True, logprobs=3, **IGNORE_EOS).choices[0]
    assert with_lp.text == PROMPT + plain
    num_prompt = server.count_tokens(PROMPT)
    assert len(with_lp.logprobs.tokens) == num_prompt + GREEDY_LEN
    assert with_lp.logprobs.token_logprobs[0] is None
    assert all(x is not None for x in with_lp.logprobs.token_logprobs[1:])
    _check_completion_logprobs_echo(with_lp.logprobs, with_lp.text, num_prompt)

    # Streamed echo: the prompt comes once, first.
    streamed = "".join(c.choices[0].text for c in greedy_completion(client, echo=True, stream=True,
                                                                    **IGNORE_EOS) if c.choices)
    assert streamed == PROMPT + plain


def _check_completion_logprobs_echo(logprobs, text, num_prompt):
    offsets = logprobs.text_offset
    assert offsets[0] == 0
    for i in range(1, len(offsets)):
        assert offsets[i] == offsets[i - 1] + len(logprobs.tokens[i - 1])
    # Prompt tokens' logprobs are not greedy choices: only check the shape there.
    for top in logprobs.top_logprobs[1:num_prompt]:
        assert top is not None and 1 <= len(top) <= 3


@pytest.mark.parametrize("include", [False, True])
def test_completion_stop_string(client, include):
    text = greedy_completion(client, max_tokens=24, **IGNORE_EOS).choices[0].text
    stop = _stop_string_in(text)
    expected = text[: text.index(stop)] + (stop if include else "")
    completion = greedy_completion(client, max_tokens=24, stop=[stop, "@@never@@"],
                                   extra_body={"ignore_eos": True,
                                               "include_stop_str_in_output": include})
    [choice] = completion.choices
    assert choice.text == expected
    assert choice.finish_reason == "stop"
    assert completion.usage.completion_tokens < 24
    # Streamed: the same text.
    streamed = list(greedy_completion(client, max_tokens=24, stop=stop, stream=True,
                                      extra_body={"ignore_eos": True,
                                                  "include_stop_str_in_output": include}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected
    assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == "stop"


def _stop_string_in(text: str) -> str:
    """A stop string taken from the middle of a generated text (a few characters in)."""
    for start in range(max(len(text) // 3, 1), len(text) - 3):
        stop = text[start:start + 3]
        if stop.strip() and "\ufffd" not in stop:
            return stop
    raise AssertionError(f"no usable stop string in {text!r}")


def test_seed_reproducibility(client):
    def sample(seed):
        return client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16,
                                         temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert sample(1) != sample(2)

    def chat_sample(seed):
        return client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=16,
                                              temperature=1.0, seed=seed,
                                              extra_body={"ignore_eos": True}
                                              ).choices[0].message.content

    first = chat_sample(99)
    assert chat_sample(99) == first
    assert chat_sample(3) != chat_sample(4)


# ---- chat -------------------------------------------------------------------------------------


def test_chat_basic(server, client):
    chat = greedy_chat(client, max_tokens=5, user="someone", **IGNORE_EOS)
    assert chat.object == "chat.completion"
    [choice] = chat.choices
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason == "length"
    assert chat.usage.prompt_tokens == server.count_tokens(messages=MESSAGES)
    assert chat.usage.completion_tokens == 5
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + 5


def test_chat_stream_equals_non_stream(server, client):
    full = greedy_chat(client, **IGNORE_EOS)
    chunks = list(greedy_chat(client, stream=True, stream_options={"include_usage": True},
                              **IGNORE_EOS))
    *content, last = chunks
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert content[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in content if c.choices)
    assert text == full.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in content if c.choices]
    assert finish[-1] == "length" and not any(finish[:-1])
    assert all(c.usage is None for c in content)
    assert last.choices == []
    assert last.usage.prompt_tokens == server.count_tokens(messages=MESSAGES)
    assert last.usage.completion_tokens == GREEDY_LEN
    assert last.usage.total_tokens == last.usage.prompt_tokens + GREEDY_LEN
    assert last.usage.model_dump() == full.usage.model_dump()


@pytest.mark.parametrize("stream", [False, True])
def test_chat_n2(client, stream):
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, n=2, temperature=0,
                  extra_body={"ignore_eos": True})
    if stream:
        texts, reasons = {0: "", 1: ""}, {}
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
                if c.finish_reason is not None:
                    reasons[c.index] = c.finish_reason
    else:
        chat = client.chat.completions.create(**kwargs)
        assert chat.usage.completion_tokens == 10
        texts = {c.index: c.message.content for c in chat.choices}
        reasons = {c.index: c.finish_reason for c in chat.choices}
    assert sorted(texts) == [0, 1]
    assert reasons == {0: "length", 1: "length"}
    single = greedy_chat(client, max_tokens=5, **IGNORE_EOS).choices[0].message.content
    assert texts[0] == texts[1] == single


def test_chat_continuous_usage_stats(client, tokenizer):
    """Every chunk carries the usage so far: the role chunk none generated yet, then as many
    completion tokens as the chunks carried logprob entries (one per token)."""
    prompt_tokens = len(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                      return_dict=True)["input_ids"])
    chunks = list(greedy_chat(client, max_tokens=6, logprobs=True, stream=True,
                              stream_options={"include_usage": True, "continuous_usage_stats": True},
                              **IGNORE_EOS))
    first, *content, last = chunks
    assert first.choices[0].delta.role == "assistant"
    assert (first.usage.prompt_tokens, first.usage.completion_tokens) == (prompt_tokens, 0)
    streamed = 0
    for chunk in content:
        streamed += len(chunk.choices[0].logprobs.content)
        assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens, chunk.usage.total_tokens) == (
            prompt_tokens, streamed, prompt_tokens + streamed)
    assert streamed == 6
    assert last.choices == [] and (last.usage.prompt_tokens, last.usage.completion_tokens) == (prompt_tokens, 6)


CONTINUED = [*MESSAGES, {"role": "assistant", "content": "Red, green"}]


@pytest.mark.parametrize(
    ("messages", "template_args", "role", "echoed"),
    [
        # Continuing the assistant's last message: the reply starts with it.
        (CONTINUED, {"add_generation_prompt": False, "continue_final_message": True}, "assistant", "Red, green"),
        # A new assistant message after the user's: nothing to echo.
        (MESSAGES, {}, "assistant", ""),
        # No generation prompt: the reply continues the last message, in its role (vLLM's rule).
        (MESSAGES, {"add_generation_prompt": False}, "user", MESSAGES[-1]["content"]),
    ],
)
def test_chat_echo(client, messages, template_args, role, echoed):
    """echo: the reply's content is the echoed message followed by exactly what the same request
    without echo generates, streamed (echo in a chunk of its own, after the role) or not."""
    def chat(**kwargs):
        return greedy_chat(client, messages=messages, max_tokens=6,
                           extra_body={"ignore_eos": True, **template_args, **kwargs.pop("extra", {})}, **kwargs)

    plain = chat().choices[0].message
    echo = chat(extra={"echo": True}).choices[0].message
    assert (plain.role, echo.role) == (role, role)
    assert echo.content == echoed + plain.content
    chunks = list(chat(extra={"echo": True}, stream=True))
    assert chunks[0].choices[0].delta.role == role
    if echoed:
        assert chunks[1].choices[0].delta.content == echoed
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == echoed + plain.content


def test_chat_logprobs(client):
    chat = greedy_chat(client, logprobs=True, top_logprobs=3, **IGNORE_EOS)
    [choice] = chat.choices
    content = choice.logprobs.content
    assert len(content) == GREEDY_LEN == chat.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0.0
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        # Greedy: the chosen token is the top one.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
        assert entry.bytes == list(entry.token.encode())
    if not any("\ufffd" in e.token for e in content):
        assert "".join(e.token for e in content) == choice.message.content
    # logprobs=True alone: the chosen tokens, no alternatives.
    plain = greedy_chat(client, logprobs=True, **IGNORE_EOS).choices[0]
    assert [e.token for e in plain.logprobs.content] == [e.token for e in content]
    assert all(e.top_logprobs == [] for e in plain.logprobs.content)
    # Without logprobs there are none.
    assert greedy_chat(client, **IGNORE_EOS).choices[0].logprobs is None


def test_chat_stream_logprobs(client):
    full = greedy_chat(client, logprobs=True, top_logprobs=2, **IGNORE_EOS).choices[0]
    streamed = []
    for chunk in greedy_chat(client, logprobs=True, top_logprobs=2, stream=True, **IGNORE_EOS):
        for c in chunk.choices:
            if c.logprobs is not None:
                streamed += c.logprobs.content
    assert [e.token for e in streamed] == [e.token for e in full.logprobs.content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in full.logprobs.content],
                                                          abs=1e-4)


def test_chat_stop_string(client):
    text = greedy_chat(client, max_tokens=24, **IGNORE_EOS).choices[0].message.content
    stop = _stop_string_in(text)
    chat = greedy_chat(client, max_tokens=24, stop=stop, **IGNORE_EOS)
    assert chat.choices[0].message.content == text[: text.index(stop)]
    assert chat.choices[0].finish_reason == "stop"


def test_chat_max_completion_tokens(client):
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES,
                                          max_completion_tokens=3, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 3
    assert chat.choices[0].finish_reason == "length"
    # max_completion_tokens takes precedence over the deprecated max_tokens.
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=9,
                                          max_completion_tokens=4, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 4


def test_chat_text_content_parts(client):
    parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in MESSAGES]
    assert (greedy_chat(client, messages=parts, **IGNORE_EOS).choices[0].message.content
            == greedy_chat(client, **IGNORE_EOS).choices[0].message.content)


# ---- agreement with the offline LLM -----------------------------------------------------------


def test_greedy_chat_equals_llm_chat(client, tiny_llm):
    conversations = [
        MESSAGES,
        [{"role": "user", "content": "Hello!"}],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
         {"role": "user", "content": "What is the weather like on Mars?"}],
    ]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = tiny_llm.chat(conversations, params, use_tqdm=False)
    for messages, want in zip(conversations, expected, strict=True):
        chat = greedy_chat(client, messages=messages, max_tokens=20, **IGNORE_EOS)
        assert chat.choices[0].message.content == want.outputs[0].text
        assert chat.usage.prompt_tokens == len(want.prompt_token_ids)
        assert chat.usage.completion_tokens == len(want.outputs[0].token_ids) == 20


EXTRA_CASES = {
    "top_k": ({"top_k": 5}, {"top_k": 5}),
    "min_p": ({"min_p": 0.2}, {"min_p": 0.2}),
    "repetition_penalty": ({"repetition_penalty": 1.8}, {"repetition_penalty": 1.8}),
    "presence_frequency_penalty": (
        {"presence_penalty": 1.5, "frequency_penalty": 0.7},
        {"presence_penalty": 1.5, "frequency_penalty": 0.7},
    ),
    "no_ignore_eos": ({"ignore_eos": False}, {"ignore_eos": False}),
}


@pytest.mark.parametrize("case", sorted(EXTRA_CASES))
def test_sampling_extras_equal_offline(client, tiny_llm, case):
    """Greedy requests with vLLM's extra fields (via extra_body) and OpenAI's penalties give
    what the offline engine gives with the same SamplingParams."""
    http_kwargs, sp_kwargs = EXTRA_CASES[case]
    sp_kwargs = {"ignore_eos": True, **sp_kwargs}
    extra = {"ignore_eos": True, **{k: v for k, v in http_kwargs.items()
                                    if k not in ("presence_penalty", "frequency_penalty")}}
    openai_kwargs = {k: v for k, v in http_kwargs.items()
                     if k in ("presence_penalty", "frequency_penalty")}
    [want] = tiny_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, **sp_kwargs),
                               use_tqdm=False)
    completion = greedy_completion(client, max_tokens=20, extra_body=extra, **openai_kwargs)
    assert completion.choices[0].text == want.outputs[0].text
    assert completion.choices[0].finish_reason == want.outputs[0].finish_reason
    assert completion.usage.completion_tokens == len(want.outputs[0].token_ids)


def test_stop_token_ids_and_logit_bias(client, tiny_llm):
    [base] = tiny_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                               use_tqdm=False)
    ids = base.outputs[0].token_ids
    # stop_token_ids: stop at the 5th generated token (first occurrence), not included in text.
    stop_id = ids[4]
    first = ids.index(stop_id)
    completion = greedy_completion(client, max_tokens=12,
                                   extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]})
    [choice] = completion.choices
    assert choice.finish_reason == "stop"
    assert completion.usage.completion_tokens == first + 1
    [want] = tiny_llm.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )
    assert choice.text == want.outputs[0].text
    assert choice.model_extra.get("stop_reason") == stop_id

    # min_tokens: the stop token cannot end the request before 8 tokens.
    params = dict(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id],
                  min_tokens=8)
    [want] = tiny_llm.generate(PROMPT, SamplingParams(**params), use_tqdm=False)
    assert len(want.outputs[0].token_ids) >= 8
    completion = greedy_completion(client, max_tokens=12, extra_body={
        "ignore_eos": True, "stop_token_ids": [stop_id], "min_tokens": 8})
    assert completion.choices[0].text == want.outputs[0].text
    assert completion.choices[0].finish_reason == want.outputs[0].finish_reason
    assert completion.usage.completion_tokens == len(want.outputs[0].token_ids)

    # logit_bias: a +100 bias on one token makes greedy decoding pick it every time.
    favourite = 4093
    completion = greedy_completion(client, max_tokens=5, logit_bias={str(favourite): 100},
                                   logprobs=1, **IGNORE_EOS)
    [choice] = completion.choices
    [want] = tiny_llm.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                               logit_bias={favourite: 100.0}), use_tqdm=False)
    assert want.outputs[0].token_ids == [favourite] * 5
    assert choice.text == want.outputs[0].text
