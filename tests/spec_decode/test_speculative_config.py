"""speculative_config as users give it (a dict, or JSON on the command line), and the clear
errors a bad one gets before any engine starts."""

from __future__ import annotations

import argparse

import pytest

from minivllm.engine.arg_utils import AsyncEngineArgs, EngineArgs


def engine_config(model_dir, spec):
    return EngineArgs(model=str(model_dir), speculative_config=spec).create_engine_config()


def test_ngram_from_the_command_line(tiny_model_dir):
    parser = argparse.ArgumentParser()
    AsyncEngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--model", str(tiny_model_dir), "--speculative-config",
                              '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'])
    spec = AsyncEngineArgs.from_cli_args(args).create_engine_config().speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.lookup_min, spec.lookup_max) == ("ngram", 4, 3, 3)
    assert spec.num_lookahead_tokens == 0
    # vLLM's defaults and spellings: 5 when no bound is given; "[ngram]" as the model.
    spec = engine_config(tiny_model_dir, {"model": "[ngram]", "num_speculative_tokens": 2}).speculative_config
    assert (spec.method, spec.lookup_min, spec.lookup_max) == ("ngram", 5, 5)


def test_draft_model_takes_its_own_dtype_and_lookahead(tiny_model_dir):
    spec = engine_config(tiny_model_dir, {"model": str(tiny_model_dir), "num_speculative_tokens": 3,
                                          "dtype": "bfloat16"}).speculative_config
    assert spec.method == "draft_model" and spec.num_lookahead_tokens == 3
    assert spec.draft_model_config.dtype == "bfloat16" and spec.draft_model_config.model == str(tiny_model_dir)


@pytest.mark.parametrize(("spec", "message"), [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of ngram, draft_model, eagle, eagle3"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram"}, "needs 'method'.*'num_speculative_tokens'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "1 <= prompt_lookup_min <= prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}, "Unknown speculative_config keys: bogus"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs a model"),
    ('{"method": "ngram",', "not valid JSON"),
])
def test_bad_config_is_refused_before_start(tiny_model_dir, spec, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=str(tiny_model_dir), speculative_config=spec)


def test_draft_model_with_another_vocabulary_is_refused(make_tiny_model):
    target, draft = make_tiny_model("llama"), make_tiny_model("llama", vocab_size=128)
    with pytest.raises(ValueError, match="vocabulary of 128 tokens, the target 49152"):
        engine_config(target, {"model": str(draft), "num_speculative_tokens": 3})
