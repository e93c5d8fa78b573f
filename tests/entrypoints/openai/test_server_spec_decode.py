"""Speculative decoding through the server: `minivllm serve --speculative-config` (JSON), streamed
deltas that carry several tokens per step, an abandoned stream, and vLLM's spec_decode metrics."""

from __future__ import annotations

import json

import pytest
from server_utils import MAX_MODEL_LEN, TINY_SERVER_ARGS, RemoteServer

from minivllm import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# Tokens of a repeated pattern (ids < 128): lookup hits on the prompt.
PROMPT = [5, 6, 7, 8] * 8


@pytest.fixture(scope="module")
def server(make_tiny_model):
    model = make_tiny_model("llama", vocab_size=128)
    with RemoteServer(model, [*TINY_SERVER_ARGS, "--speculative-config", json.dumps(NGRAM)]) as remote:
        yield remote


def test_stream_equals_the_whole_reply_and_the_offline_engine(server, make_tiny_model, make_llm):
    with server.client() as client:
        whole = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=40, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
        stream = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=40, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        chunks = [c.choices[0].text for c in stream if c.choices]
    assert "".join(chunks) == whole.choices[0].text
    assert whole.usage.completion_tokens == 40
    # Fewer chunks than tokens: steps that accepted drafts sent several tokens at once.
    assert len([c for c in chunks if c]) < 40
    llm = make_llm(make_tiny_model("llama", vocab_size=128), dtype="float32", max_model_len=MAX_MODEL_LEN)
    reference = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].text
    assert whole.choices[0].text == reference


def test_abandoned_stream_leaves_nothing_behind(server):
    with server.client() as client:
        stream = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=200, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        stream.close()
        # The server goes on serving, and the aborted request holds no block.
        reply = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=5, temperature=0)
        assert reply.choices[0].text is not None
    metrics = server.metrics()
    assert metrics["vllm:num_requests_running"] == 0 and metrics["vllm:kv_cache_usage_perc"] == 0


def test_spec_decode_metrics(server):
    metrics = server.metrics()
    drafts, accepted = metrics["vllm:spec_decode_num_drafts_total"], metrics["vllm:spec_decode_num_accepted_tokens_total"]
    assert drafts > 0 and 0 < accepted <= metrics["vllm:spec_decode_num_draft_tokens_total"]
