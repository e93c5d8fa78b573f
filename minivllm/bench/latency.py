"""`minivllm bench latency`: one batch of requests run again and again; the end-to-end latency
of the batch, and each request's time to first token and time per output token (vLLM's
`bench latency`, plus TTFT/TPOT)."""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from minivllm.bench.datasets import random_requests
from minivllm.bench.throughput import make_llm
from minivllm.bench.utils import plot_cdfs, write_json
from minivllm.engine.arg_utils import EngineArgs

PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-iters-warmup", type=int, default=3)
    parser.add_argument("--num-iters", type=int, default=10)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--output-json", type=str, default=None)
    parser.add_argument("--plot", type=str, default=None, help="Write latency CDFs (PNG) here.")
    EngineArgs.add_cli_args(parser, skip=("seed",))
    parser.add_argument("--seed", type=int, default=0)


def main(args: argparse.Namespace) -> None:
    from minivllm import SamplingParams

    llm, startup = make_llm(args)
    vocab = llm.llm_engine.vllm_config.model_config.hf_config.vocab_size
    batch = random_requests(args.batch_size, args.input_len, args.output_len, vocab, seed=args.seed)
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
    for _ in range(args.num_iters):
        latency, t, p = run_once()
        latencies.append(latency)
        ttfts += t
        tpots += p
    llm.llm_engine.shutdown()
    result = summarize(latencies, ttfts, tpots) | {"startup_time": startup}
    print(f"Avg latency: {result['avg_latency']:.4f} s (p50 {result['p50_e2el_ms']:.1f} ms, p90 "
          f"{result['p90_e2el_ms']:.1f} ms, p99 {result['p99_e2el_ms']:.1f} ms)")
    print(f"TTFT: mean {result['mean_ttft_ms']:.1f} ms, p99 {result['p99_ttft_ms']:.1f} ms; "
          f"TPOT: mean {result['mean_tpot_ms']:.2f} ms, p99 {result['p99_tpot_ms']:.2f} ms; startup {startup:.1f} s")
    if args.output_json:
        write_json(args.output_json, vars(args), result)
    if args.plot:
        plot_cdfs(args.plot, "Latency", {"batch latency": np.array(latencies) * 1000,
                                         "TTFT": np.array(ttfts) * 1000, "TPOT": np.array(tpots) * 1000}, "ms")


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
