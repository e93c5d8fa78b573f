"""`minivllm bench latency`: one batch of requests run again and again; the end-to-end latency
of the batch, and each request's time to first token and time per output token (vLLM's
`bench latency`, plus TTFT/TPOT, and the speculative decoding figures when the engine speculates)."""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from minivllm.bench.datasets import SampleRequest, grounded_requests, random_requests
from minivllm.bench.grounded import add_grounded_args
from minivllm.bench.throughput import make_llm, spec_decoding_stats
from minivllm.bench.utils import (
    load_hf_model,
    plot_cdfs,
    print_rows,
    spec_decode_report,
    spec_decode_rows,
    write_json,
)
from minivllm.engine.arg_utils import EngineArgs

PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset-name", choices=("random", "grounded"), default="random",
                        help="random token prompts, or grounded ones (repeat a passage with one edit, "
                             "chat template applied; --input-len is about each prompt's length).")
    add_grounded_args(parser)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-iters-warmup", type=int, default=3)
    parser.add_argument("--num-iters", type=int, default=10)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--hf-compare", action="store_true",
                        help="Also run the batch through transformers' generate (greedy) in the same run.")
    parser.add_argument("--output-json", type=str, default=None)
    parser.add_argument("--plot", type=str, default=None, help="Write latency CDFs (PNG) here.")
    EngineArgs.add_cli_args(parser, skip=("seed",))
    parser.add_argument("--seed", type=int, default=0)


def main(args: argparse.Namespace) -> None:
    from minivllm import SamplingParams

    llm, startup = make_llm(args)
    batch = make_batch(args, llm)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in batch]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True)

    def run_once() -> tuple[float, list[float], list[float]]:
        llm.reset_prefix_cache()  # every iteration computes its prompts
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        latency = time.perf_counter() - start
        ttfts, tpots = [], []
        for o in outputs:
            m = o.metrics
            assert m is not None and m.first_token_time is not None and m.finished_time is not None
            ttfts.append(m.first_token_time - m.arrival_time)
            n = len(o.outputs[0].token_ids)
            if n > 1:
                tpots.append((m.finished_time - m.first_token_time) / (n - 1))
        return latency, ttfts, tpots

    for _ in range(args.num_iters_warmup):
        run_once()
    latencies, ttfts, tpots = [], [], []
    spec_before = spec_decoding_stats(llm)
    for _ in range(args.num_iters):
        latency, t, p = run_once()
        latencies.append(latency)
        ttfts += t
        tpots += p
    spec = spec_decode_report(spec_before, spec_decoding_stats(llm))
    model_config = llm.llm_engine.vllm_config.model_config
    llm.llm_engine.shutdown()
    result = summarize(latencies, ttfts, tpots) | {"startup_time": startup} | spec
    report("minivllm", result)
    print_rows(spec_decode_rows(spec))
    if args.hf_compare:
        hf = run_hf(args, [r.prompt_token_ids for r in batch], model_config.model, model_config.dtype)
        report("transformers", hf)
        print(f"transformers / minivllm: TTFT {hf['mean_ttft_ms'] / result['mean_ttft_ms']:.2f}x, "
              f"TPOT {hf['mean_tpot_ms'] / result['mean_tpot_ms']:.2f}x")
        result["transformers"] = hf
    if args.output_json:
        write_json(args.output_json, vars(args), result)
    if args.plot:
        plot_cdfs(args.plot, "Latency", {"batch latency": np.array(latencies) * 1000,
                                         "TTFT": np.array(ttfts) * 1000, "TPOT": np.array(tpots) * 1000}, "ms")


def make_batch(args: argparse.Namespace, llm: Any) -> list[SampleRequest]:
    if args.dataset_name == "grounded":
        return grounded_requests(args.batch_size, args.input_len, args.output_len, llm.get_tokenizer(),
                                 args.seed, args.grounded_kind)
    vocab = llm.llm_engine.vllm_config.model_config.hf_config.vocab_size
    return random_requests(args.batch_size, args.input_len, args.output_len, vocab, seed=args.seed)


def report(name: str, result: dict[str, Any]) -> None:
    print(f"Avg latency ({name}): {result['avg_latency']:.4f} s (p50 {result['p50_e2el_ms']:.1f} ms, p90 "
          f"{result['p90_e2el_ms']:.1f} ms, p99 {result['p99_e2el_ms']:.1f} ms); TTFT mean "
          f"{result['mean_ttft_ms']:.1f} ms, p99 {result['p99_ttft_ms']:.1f} ms; TPOT mean "
          f"{result['mean_tpot_ms']:.2f} ms, p99 {result['p99_tpot_ms']:.2f} ms; startup {result['startup_time']:.1f} s")


def run_hf(args: argparse.Namespace, prompts: list[list[int]], model_path: str, dtype: str) -> dict[str, Any]:
    """The same batch through transformers' greedy generate, timed the same way: a logits
    processor notes when each step's logits exist, so the first call marks the first token."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    class StepClock(LogitsProcessor):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            self.times.append(time.perf_counter())
            return scores

    model, startup = load_hf_model(model_path, dtype)
    max_len = max(len(p) for p in prompts)  # left padding, where lengths differ (grounded)
    input_ids = torch.tensor([[0] * (max_len - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (max_len - len(p)) + [1] * len(p) for p in prompts])

    def run_once() -> tuple[float, float, float]:
        clock = StepClock()
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=input_ids, attention_mask=attention_mask,
                           max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=False,
                           top_p=None, top_k=None, temperature=None, eos_token_id=None, pad_token_id=0,
                           logits_processor=LogitsProcessorList([clock]))
        latency = time.perf_counter() - start
        ttft = clock.times[0] - start
        return latency, ttft, (latency - ttft) / max(args.output_len - 1, 1)

    for _ in range(args.num_iters_warmup):
        run_once()
    runs = [run_once() for _ in range(args.num_iters)]
    latencies, ttfts, tpots = (list(x) for x in zip(*runs, strict=True))
    return summarize(latencies, ttfts, tpots if args.output_len > 1 else []) | {"startup_time": startup}


def summarize(latencies: list[float], ttfts: list[float], tpots: list[float]) -> dict[str, Any]:
    """vLLM's keys (avg_latency, latencies, percentiles in seconds) and ms statistics."""
    result: dict[str, Any] = {
        "avg_latency": float(np.mean(latencies)),
        "latencies": latencies,
        "percentiles": {str(p): float(np.percentile(latencies, p)) for p in PERCENTILES},
    }
    for name, values in (("e2el", latencies), ("ttft", ttfts), ("tpot", tpots or [0.0])):
        ms = np.array(values) * 1000
        result[f"mean_{name}_ms"] = float(ms.mean())
        result |= {f"p{p}_{name}_ms": float(np.percentile(ms, p)) for p in (50, 90, 99)}
    return result
