"""`minivllm bench throughput`: offline throughput of LLM.generate on a workload, with vLLM's
flags and JSON keys, optionally beside transformers' batched generate (or another minivllm
configuration) in the same run."""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from minivllm.bench.datasets import SampleRequest, add_dataset_args, build_dataset
from minivllm.bench.utils import (
    load_hf_model,
    plot_bars,
    print_rows,
    spec_decode_report,
    spec_decode_rows,
    write_json,
)
from minivllm.engine.arg_utils import EngineArgs

# flag -> [(label, engine-arg overrides, environment)], run one after the other in one process.
COMPARISONS: dict[str, list[tuple[str, dict[str, Any], dict[str, str]]]] = {
    "compare_prefix_caching": [
        ("minivllm[no prefix caching]", {"enable_prefix_caching": False}, {}),
        ("minivllm[prefix caching]", {"enable_prefix_caching": True}, {}),
    ],
    "compare_multiprocessing": [
        ("minivllm[in-process]", {}, {"MINIVLLM_ENABLE_MULTIPROCESSING": "0"}),
        ("minivllm[engine process]", {}, {"MINIVLLM_ENABLE_MULTIPROCESSING": "1"}),
    ],
    "compare_tracing": [  # on: into --trace-dir
        ("minivllm[tracing off]", {"trace_dir": None}, {}),
        ("minivllm[tracing on]", {}, {}),
    ],
}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_dataset_args(parser)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 for greedy (vLLM's bench uses 1).")
    parser.add_argument("--hf-compare", action="store_true",
                        help="Also run the workload through transformers' batched generate.")
    parser.add_argument("--hf-max-batch-size", type=int, default=64)
    parser.add_argument("--compare-prefix-caching", action="store_true",
                        help="Run the workload with prefix caching off, then on, in the same run.")
    parser.add_argument("--compare-multiprocessing", action="store_true",
                        help="Run the workload with the engine core in-process, then in its own process.")
    parser.add_argument("--compare-tracing", action="store_true",
                        help="Run the workload with tracing off, then on (into --trace-dir), in the same run.")
    parser.add_argument("--output-json", type=str, default=None)
    parser.add_argument("--plot", type=str, default=None, help="Write a bar chart (PNG) of the throughputs here.")
    EngineArgs.add_cli_args(parser, skip=("seed",))
    parser.add_argument("--seed", type=int, default=0, help="Dataset and engine seed.")


@contextmanager
def environ(env: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def make_llm(args: argparse.Namespace, overrides: dict[str, Any] | None = None, env: dict[str, str] | None = None) -> tuple[Any, float]:
    """An LLM from the command line's engine flags, and how long it took to be ready."""
    from minivllm import LLM

    start = time.perf_counter()
    with environ(env or {}):
        llm = LLM(**(vars(EngineArgs.from_cli_args(args)) | (overrides or {})))
    return llm, time.perf_counter() - start


def run_minivllm(
    args: argparse.Namespace, requests: list[SampleRequest], overrides: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    from minivllm import SamplingParams

    llm, startup = make_llm(args, overrides, env)
    params = [
        SamplingParams(temperature=args.temperature, max_tokens=r.expected_output_len, ignore_eos=True)
        for r in requests
    ]
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    # Warm-up on a prompt of its own, then forget it: the workload must start with a cold cache.
    llm.generate([[requests[0].prompt_token_ids[-1]] * 8], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.reset_prefix_cache()
    spec_before = spec_decoding_stats(llm)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    spec = spec_decode_report(spec_before, spec_decoding_stats(llm))
    num_output = sum(len(o.outputs[0].token_ids) for o in outputs)
    ttfts_ms = [1000 * o.metrics.time_to_first_token for o in outputs if o.metrics and o.metrics.first_token_time]
    model_config = llm.llm_engine.vllm_config.model_config
    # Stop the engine before the next variant starts, so that they never compete for the CPU.
    llm.llm_engine.shutdown()
    return figures(requests, num_output, elapsed) | {
        "mean_ttft_ms": statistics.fmean(ttfts_ms),
        "median_ttft_ms": statistics.median(ttfts_ms),
        "num_cached_prompt_tokens": sum(o.num_cached_tokens for o in outputs),
        "startup_time": startup,
        "dtype": model_config.dtype,
        "model": model_config.model,
    } | spec


def spec_decoding_stats(llm: Any) -> Any:
    """The engine's cumulative draft verification counters; None when it does not speculate."""
    return llm.llm_engine.get_scheduler_stats().spec_decoding


def run_hf(args: argparse.Namespace, requests: list[SampleRequest], model_path: str, dtype: str) -> dict[str, Any]:
    """transformers' generate, left-padded batches of up to --hf-max-batch-size, no EOS stop."""
    import torch

    model, startup = load_hf_model(model_path, dtype)
    pad_id = 0
    num_output = 0
    start = time.perf_counter()
    for i in range(0, len(requests), args.hf_max_batch_size):
        batch = requests[i : i + args.hf_max_batch_size]
        max_len = max(r.prompt_len for r in batch)
        input_ids = torch.tensor([[pad_id] * (max_len - r.prompt_len) + r.prompt_token_ids for r in batch])
        pads = torch.tensor([max_len - r.prompt_len for r in batch])
        attention_mask = (torch.arange(max_len)[None, :] >= pads[:, None]).long()
        max_new = max(r.expected_output_len for r in batch)
        sample = args.temperature > 0
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new,
                min_new_tokens=max_new, do_sample=sample, temperature=args.temperature if sample else None,
                top_p=None, top_k=None, eos_token_id=None, pad_token_id=pad_id,
            )
        # Count the tokens each request asked for; the batch's extra ones are padding work.
        num_output += sum(min(r.expected_output_len, out.shape[1] - max_len) for r in batch)
    elapsed = time.perf_counter() - start
    return figures(requests, num_output, elapsed) | {"startup_time": startup}


def figures(requests: list[SampleRequest], num_output: int, elapsed: float) -> dict[str, Any]:
    num_prompt = sum(r.prompt_len for r in requests)
    return {
        "elapsed_time": elapsed,
        "num_requests": len(requests),
        "total_num_tokens": num_prompt + num_output,
        "total_output_tokens": num_output,
        "requests_per_second": len(requests) / elapsed,
        "tokens_per_second": (num_prompt + num_output) / elapsed,
        "output_tokens_per_second": num_output / elapsed,
    }


def main(args: argparse.Namespace) -> None:
    from minivllm.transformers_utils.config import get_config, resolve_model_path
    from minivllm.transformers_utils.tokenizer import get_tokenizer

    model_path = resolve_model_path(args.model)
    tokenizer = None if args.dataset_name == "random" else get_tokenizer(resolve_model_path(args.tokenizer or args.model))
    requests = build_dataset(args, tokenizer, get_config(model_path).vocab_size)
    if args.compare_tracing and not args.trace_dir:
        raise ValueError("--compare-tracing writes its trace into --trace-dir: give one.")
    comparison = next((COMPARISONS[name] for name in COMPARISONS if getattr(args, name)), None)
    if comparison is not None:
        results = {label: run_minivllm(args, requests, overrides, env) for label, overrides, env in comparison}
    else:
        results = {"minivllm": run_minivllm(args, requests)}
    ours = next(reversed(results.values()))
    if args.hf_compare:
        results["transformers"] = run_hf(args, requests, model_path, ours["dtype"])
    report(args, results, comparison, ours)


def report(args: argparse.Namespace, results: dict[str, dict[str, Any]], comparison: Any, ours: dict[str, Any]) -> None:
    for name, r in results.items():
        ttft = f", mean TTFT {r['mean_ttft_ms']:.0f} ms" if "mean_ttft_ms" in r else ""
        print(
            f"{name:>12}: {r['requests_per_second']:.2f} requests/s, {r['tokens_per_second']:.1f} total "
            f"tokens/s, {r['output_tokens_per_second']:.1f} output tokens/s "
            f"({r['total_output_tokens']} output tokens in {r['elapsed_time']:.1f} s{ttft}; "
            f"startup {r['startup_time']:.1f} s)"
        )
        print_rows(spec_decode_rows(r))
    if comparison is not None:
        (first, a), (second, b) = ((label, results[label]) for label, _, _ in comparison)
        cached = f" ({b['num_cached_prompt_tokens']} prompt tokens from the prefix cache)" if args.compare_prefix_caching else ""
        print(
            f"{second} vs {first}: total time {a['elapsed_time'] / b['elapsed_time']:.2f}x faster, "
            f"output throughput {b['output_tokens_per_second'] / a['output_tokens_per_second']:.2f}x, "
            f"mean TTFT {a['mean_ttft_ms'] / b['mean_ttft_ms']:.2f}x lower{cached}"
        )
    if "transformers" in results:
        ratio = ours["output_tokens_per_second"] / results["transformers"]["output_tokens_per_second"]
        print(f"minivllm / transformers output throughput: {ratio:.2f}x")
    if args.output_json:
        write_json(args.output_json, vars(args), {**ours, "results": results})
    if args.plot:
        plot_bars(args.plot, "Offline throughput", list(results), [r["output_tokens_per_second"] for r in results.values()],
                  "output tokens/s")
