"""The grounded workload (repeat a passage with one edit) with the real SmolLM2 tokenizer and
chat template: deterministic per seed, about the asked length, the instruction's edit words
match the passage, the passage sits verbatim in the rendered prompt."""

from __future__ import annotations

import ast
import re

import pytest

from minivllm.bench.datasets import build_dataset, grounded_requests
from minivllm.entrypoints.cli import make_parser

PROSE_EDIT = re.compile(r'replace every "(\w+)" with "(\w+)"')
CODE_EDIT = re.compile(r"rename the function (\w+) to (\w+)")


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def test_grounded_is_deterministic_per_seed(tokenizer):
    a = grounded_requests(4, 200, None, tokenizer, seed=3)
    b = grounded_requests(4, 200, None, tokenizer, seed=3)
    assert [r.prompt_token_ids for r in a] == [r.prompt_token_ids for r in b]
    assert [r.prompt for r in a] == [r.prompt for r in b]
    other = grounded_requests(4, 200, None, tokenizer, seed=4)
    assert all(x.passage != y.passage for x, y in zip(a, other, strict=True))
    # Request i depends on (seed, i) only: a longer run starts with the shorter one's requests.
    assert [r.prompt for r in grounded_requests(2, 200, None, tokenizer, seed=3)] == [r.prompt for r in a[:2]]


@pytest.mark.parametrize("kind", ["prose", "code", "mixed"])
@pytest.mark.parametrize("input_len", [256, 640])
def test_grounded_length_and_content(tokenizer, kind, input_len):
    requests = grounded_requests(6, input_len, None, tokenizer, seed=0, kind=kind)
    for i, r in enumerate(requests):
        assert abs(r.prompt_len - input_len) <= 0.15 * input_len, (i, r.prompt_len)
        # One user turn, rendered with the chat template the way the other chat datasets are.
        assert [m["role"] for m in r.messages] == ["user"]
        content = r.messages[0]["content"]
        assert r.prompt == tokenizer.apply_chat_template(r.messages, add_generation_prompt=True, tokenize=False)
        assert r.prompt_token_ids == tokenizer.encode(r.prompt, add_special_tokens=False)
        assert r.passage in content and r.passage in r.prompt
        assert content.index(r.passage) > 0  # the instruction comes first
        # Without --output-len, the reply is as long as the passage.
        assert r.expected_output_len == len(tokenizer.encode(r.passage, add_special_tokens=False))
        is_code = kind == "code" or (kind == "mixed" and i % 2 == 1)
        if is_code:
            old, new = CODE_EDIT.search(content).groups()
            assert content.startswith("Rewrite the following code exactly")
            tree = ast.parse(r.passage)  # real Python
            names = [f.name for f in tree.body if isinstance(f, ast.FunctionDef)]
            assert len(names) == len(set(names)) >= 1
            assert old in names and new not in r.passage
            assert f"```python\n{r.passage}\n```" in content
        else:
            old, new = PROSE_EDIT.search(content).groups()
            assert content.startswith("Repeat the following passage word for word")
            assert re.search(rf"\b{old}\b", r.passage) and new not in r.passage
            assert "def " not in r.passage and r.passage.count(".") >= 1


def test_grounded_through_the_dataset_flags(tokenizer):
    args = make_parser().parse_args(["bench", "throughput", "--model", "m", "--dataset-name", "grounded",
                                     "--num-prompts", "3", "--input-len", "150", "--output-len", "7",
                                     "--grounded-kind", "code", "--seed", "5"])
    requests = build_dataset(args, tokenizer, len(tokenizer))
    assert len(requests) == 3 and {r.expected_output_len for r in requests} == {7}
    assert all("def " in r.passage for r in requests)
    assert [r.prompt for r in requests] == [r.prompt for r in grounded_requests(3, 150, 7, tokenizer, 5, "code")]
    # bench serve shares the dataset code (its length flag is --random-input-len).
    serve = make_parser().parse_args(["bench", "serve", "--dataset-name", "grounded", "--random-input-len", "150",
                                      "--num-prompts", "3", "--random-output-len", "7", "--grounded-kind", "code",
                                      "--seed", "5"])
    assert [r.prompt for r in build_dataset(serve, tokenizer, len(tokenizer))] == [r.prompt for r in requests]
    latency = make_parser().parse_args(["bench", "latency", "--model", "m", "--dataset-name", "grounded"])
    assert latency.dataset_name == "grounded" and latency.grounded_kind == "mixed"
    assert make_parser().parse_args(["bench", "latency", "--model", "m"]).dataset_name == "random"
