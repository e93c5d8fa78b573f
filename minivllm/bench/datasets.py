"""Benchmark workloads, built without any download: random token prompts (vLLM's random
dataset), a ShareGPT-format JSON file given by path, synthetic multi-turn chats whose turns
share a growing prefix, and input-grounded requests (repeat a passage with one edit)."""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from typing import Any

import numpy as np

from minivllm.bench.grounded import add_grounded_args, grounded_prompt, prompt_overhead, render

DATASETS = ("random", "sharegpt", "multiturn", "grounded")
DEFAULT_OUTPUT_LEN = 128


@dataclass
class SampleRequest:
    prompt_token_ids: list[int]
    expected_output_len: int
    prompt: str | None = None  # the text, where the dataset has one
    messages: list[dict[str, str]] | None = None  # the conversation, for chat datasets
    structured_outputs: dict[str, Any] | None = None  # vLLM's request field, when constrained
    passage: str | None = None  # the text the reply should repeat (grounded)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def add_dataset_args(parser: argparse.ArgumentParser, random_prefix: str = "") -> None:
    """Dataset flags; `random_prefix` is "random-" for `bench serve` (vLLM's flag names there)."""
    parser.add_argument("--dataset-name", choices=DATASETS, default="random")
    parser.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file (sharegpt).")
    parser.add_argument("--num-prompts", type=int, default=64)
    p = random_prefix
    parser.add_argument(f"--{p}input-len", dest="input_len", type=int, default=320,
                        help="Mean prompt length in tokens (random); about each prompt's length (grounded).")
    parser.add_argument(f"--{p}output-len", dest="output_len", type=int, default=None,
                        help="Mean output length in tokens (default 128; sharegpt: each reply's length; "
                             "grounded: each passage's length).")
    parser.add_argument(f"--{p}range-ratio", dest="range_ratio", type=float, default=0.0,
                        help="Lengths uniform in [len * (1 - r), len * (1 + r)] (random).")
    parser.add_argument(f"--{p}prefix-len", dest="prefix_len", type=int, default=0,
                        help="Random prefix shared by all prompts (random).")
    parser.add_argument("--min-input-len", type=int, default=None,
                        help="With --max-input-len: prompt lengths uniform in [min, max] (random).")
    parser.add_argument("--max-input-len", type=int, default=None)
    parser.add_argument("--num-turns", type=int, default=4, help="Turns per conversation (multiturn).")
    add_grounded_args(parser)


def build_dataset(args: argparse.Namespace, tokenizer: Any, vocab_size: int) -> list[SampleRequest]:
    output_len = args.output_len or DEFAULT_OUTPUT_LEN
    if args.dataset_name == "random":
        return random_requests(args.num_prompts, args.input_len, output_len, vocab_size,
                               args.range_ratio, args.prefix_len, args.seed, _input_len_range(args))
    if args.dataset_name == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--dataset-name sharegpt needs --dataset-path (a ShareGPT-format JSON file).")
        return sharegpt_requests(args.dataset_path, args.num_prompts, tokenizer, args.seed, args.output_len)
    if args.dataset_name == "grounded":
        return grounded_requests(args.num_prompts, args.input_len, args.output_len, tokenizer, args.seed,
                                 args.grounded_kind)
    return multiturn_requests(args.num_prompts, args.num_turns, output_len, tokenizer, args.seed)


def _input_len_range(args: argparse.Namespace) -> tuple[int, int] | None:
    if (args.min_input_len is None) != (args.max_input_len is None):
        raise ValueError("--min-input-len and --max-input-len go together.")
    if args.min_input_len is None:
        return None
    if not 1 <= args.min_input_len <= args.max_input_len:
        raise ValueError("Need 1 <= --min-input-len <= --max-input-len.")
    return args.min_input_len, args.max_input_len


def random_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    vocab_size: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
    input_len_range: tuple[int, int] | None = None,
) -> list[SampleRequest]:
    """vLLM's random dataset: lengths uniform in [len * (1 - r), len * (1 + r)] (or an explicit
    input length range), random token ids (never the first few ids, which are special tokens in
    most vocabularies), an optional shared random prefix."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}.")
    rng = np.random.default_rng(seed)
    low_token = min(100, vocab_size // 2)

    def lengths(mean: int, bounds: tuple[int, int] | None = None) -> np.ndarray:
        if bounds is None:
            bounds = (max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio))))
        return rng.integers(bounds[0], bounds[1] + 1, size=num_prompts)

    prefix = rng.integers(low_token, vocab_size, size=prefix_len).tolist()
    input_lens, output_lens = lengths(input_len, input_len_range), lengths(output_len)
    return [
        SampleRequest(prefix + rng.integers(low_token, vocab_size, size=int(n)).tolist(), int(m))
        for n, m in zip(input_lens, output_lens, strict=True)
    ]


def sharegpt_requests(
    path: str, num_prompts: int, tokenizer: Any, seed: int = 0, output_len: int | None = None
) -> list[SampleRequest]:
    """First human turn as the prompt, the reply's length as the output length; vLLM's filter
    (prompt and reply at least 4 tokens, prompt at most 1024, both at most 2048)."""
    with open(path) as f:
        data = json.load(f)
    convs = [d["conversations"] for d in data if len(d.get("conversations", [])) >= 2]
    random.Random(seed).shuffle(convs)
    requests = []
    for conv in convs:
        prompt, reply = conv[0]["value"], conv[1]["value"]
        prompt_ids = tokenizer.encode(prompt)
        out_len = output_len or len(tokenizer.encode(reply, add_special_tokens=False))
        if len(prompt_ids) < 4 or out_len < 4 or len(prompt_ids) > 1024 or len(prompt_ids) + out_len > 2048:
            continue
        requests.append(SampleRequest(prompt_ids, out_len, prompt=prompt,
                                      messages=[{"role": "user", "content": prompt}]))
        if len(requests) == num_prompts:
            break
    if not requests:
        raise ValueError(f"No usable conversations in {path!r}.")
    return requests


_WORDS = ("model", "token", "cache", "block", "river", "light", "paper", "garden", "number", "music",
          "window", "planet", "signal", "forest", "engine", "bridge", "silver", "orange", "summer",
          "kitchen", "question", "history", "picture", "minute", "market", "doctor", "island", "memory")


def multiturn_requests(
    num_prompts: int, num_turns: int, output_len: int, tokenizer: Any, seed: int = 0
) -> list[SampleRequest]:
    """Conversations of `num_turns` user turns; turn k's request holds turns 1..k (the assistant
    answers are synthetic too), so consecutive turns share a prefix, as real chats do."""
    rng = random.Random(seed)

    def sentence(n: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(n)).capitalize() + "."

    requests: list[SampleRequest] = []
    while len(requests) < num_prompts:
        messages = [{"role": "system", "content": sentence(30)}]
        for _ in range(num_turns):
            messages.append({"role": "user", "content": sentence(rng.randint(10, 40))})
            text = render(tokenizer, messages)
            requests.append(SampleRequest(tokenizer.encode(text, add_special_tokens=False), output_len,
                                          prompt=text, messages=list(messages)))
            messages.append({"role": "assistant", "content": sentence(rng.randint(10, 30))})
            if len(requests) == num_prompts:
                break
    return requests


def grounded_requests(
    num_prompts: int, input_len: int, output_len: int | None, tokenizer: Any, seed: int = 0,
    kind: str = "mixed",
) -> list[SampleRequest]:
    """One user message each, a passage with an instruction to repeat it with one edit, rendered
    with the chat template; about `input_len` tokens in all (template and instruction included,
    the passage takes the rest). "mixed" alternates prose and code. Request i depends only on
    (seed, i, kind). Without `output_len`, each asks for its passage's length."""
    kinds = ["prose", "code"] if kind == "mixed" else [kind]
    overhead = {k: prompt_overhead(tokenizer, k) for k in kinds}
    requests = []
    for i in range(num_prompts):
        k = kinds[i % len(kinds)]
        g = grounded_prompt(random.Random(f"grounded-{seed}-{i}"), k, input_len - overhead[k], tokenizer)
        messages = [{"role": "user", "content": g.content}]
        text = render(tokenizer, messages)
        out_len = output_len or len(tokenizer.encode(g.passage, add_special_tokens=False))
        requests.append(SampleRequest(tokenizer.encode(text, add_special_tokens=False), out_len, prompt=text,
                                      messages=messages, passage=g.passage))
    return requests
