"""`minivllm bench serve`: load an OpenAI-compatible server (ours, vLLM, llama.cpp's) with
streaming requests at a given rate and measure what its users see: TTFT, TPOT, ITL, end-to-end
latency, throughputs, goodput under SLOs. vLLM's flags and JSON keys."""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import time
from typing import Any

import numpy as np

from minivllm.bench.datasets import SampleRequest, add_dataset_args, build_dataset
from minivllm.bench.metrics import RequestTrace, parse_goodput, summarize
from minivllm.bench.utils import plot_cdfs, write_json


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default=None, help="Server URL (default: http://HOST:PORT).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    parser.add_argument("--model", default=None, help="Model name (default: the server's first model).")
    parser.add_argument("--tokenizer", default=None,
                        help="Local tokenizer (default: the model's path, when the server reports it).")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    add_dataset_args(parser, random_prefix="random-")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="Requests per second (Poisson arrivals); inf sends all at once.")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="Gamma shape of the arrival gaps: 1 is Poisson, lower is burstier.")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--goodput", nargs="+", default=None, help="SLOs in ms, e.g. ttft:500 tpot:50 e2el:3000.")
    parser.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--plot", default=None, help="Write latency CDFs and throughput over time (PNG) here.")
    parser.add_argument("--disable-tqdm", action="store_true")


async def send_request(session: Any, url: str, endpoint: str, model: str, sample: SampleRequest,
                       temperature: float, headers: dict[str, str]) -> RequestTrace:
    """One streaming request; the arrival time of every chunk with choices is recorded."""
    import aiohttp

    payload: dict[str, Any] = {
        "model": model, "max_tokens": sample.expected_output_len, "temperature": temperature, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True,
    }
    if endpoint.endswith("chat/completions"):
        payload["messages"] = sample.messages or [{"role": "user", "content": sample.prompt or ""}]
    else:
        payload["prompt"] = sample.prompt if sample.prompt is not None else sample.prompt_token_ids
    trace = RequestTrace(prompt_len=sample.prompt_len, start_time=time.perf_counter())
    last = trace.start_time
    try:
        async with session.post(url + endpoint, json=payload, headers=headers) as response:
            if response.status != 200:
                trace.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return trace
            async for raw_line in response.content:
                line = raw_line.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line.removeprefix("data:").strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    trace.output_tokens = chunk["usage"]["completion_tokens"]
                choices = chunk.get("choices") or []
                if not choices:
                    continue
                # vLLM's benchmark rule: the first chunk with choices is the first token (a server
                # that sends the chat role before any token exists shows a TTFT of nothing), and
                # every later one is an inter-token gap.
                now = time.perf_counter()
                if not trace.chunk_times:
                    trace.ttft = now - trace.start_time
                else:
                    trace.itl.append(now - last)
                trace.chunk_times.append(now)
                trace.chunk_tokens.append(1 if any(_chunk_text(c) for c in choices) else 0)
                last = now
        trace.latency = last - trace.start_time
        trace.output_tokens = trace.output_tokens or sum(trace.chunk_tokens)
        trace.success = bool(trace.chunk_times)
        if not trace.success:
            trace.error = "no output"
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        trace.error = f"{type(e).__name__}: {e}"
    return trace


def _chunk_text(choice: dict[str, Any]) -> str:
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Gaps between sends: gamma(shape=burstiness, mean=1/rate); all zero for an infinite rate."""
    if rate == float("inf"):
        return np.zeros(n)
    return np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), size=n)


async def run(args: argparse.Namespace, url: str, model: str, requests: list[SampleRequest]) -> tuple[list[RequestTrace], float]:
    import aiohttp
    from tqdm.auto import tqdm

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limit = asyncio.Semaphore(args.max_concurrency or len(requests))
    bar = tqdm(total=len(requests), disable=args.disable_tqdm, desc="requests")
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one(sample: SampleRequest) -> RequestTrace:
            async with limit:
                trace = await send_request(session, url, args.endpoint, model, sample, args.temperature, headers)
            bar.update(1)
            return trace

        start = time.perf_counter()
        tasks = []
        for sample, gap in zip(requests, arrival_gaps(len(requests), args.request_rate, args.burstiness, args.seed),
                               strict=True):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(sample)))
        traces = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return list(traces), duration


async def server_info(url: str, model: str | None, api_key: str | None) -> tuple[str, str | None, float | None]:
    """The model to ask for, its local path (for the tokenizer) and the engine's start-up time,
    from /v1/models and /metrics."""
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/v1/models", headers=headers) as response:
            cards = (await response.json())["data"]
        card = next((c for c in cards if model is None or c["id"] == model), cards[0])
        startup = None
        try:
            async with session.get(url + "/metrics") as response:
                for line in (await response.text()).splitlines():
                    if line.startswith("minivllm:engine_startup_seconds"):
                        startup = float(line.split()[-1])
        except aiohttp.ClientError:
            pass
    return model or card["id"], card.get("root"), startup


def main(args: argparse.Namespace) -> None:
    from minivllm.transformers_utils.tokenizer import get_tokenizer

    url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    slos = parse_goodput(args.goodput)
    model, root, startup = asyncio.run(server_info(url, args.model, args.api_key))
    tokenizer_path = args.tokenizer or (root if root and os.path.exists(root) else None)
    if tokenizer_path is None:
        raise ValueError("Give --tokenizer: the server does not report a local model path.")
    tokenizer = get_tokenizer(tokenizer_path)
    requests = build_dataset(args, tokenizer, len(tokenizer))
    if args.endpoint.endswith("chat/completions"):
        for r in requests:
            r.prompt = r.prompt if r.prompt is not None else tokenizer.decode(r.prompt_token_ids)
    traces, duration = asyncio.run(run(args, url, model, requests))
    result = summarize(traces, duration, slos) | {
        "model": model, "endpoint": args.endpoint, "request_rate": args.request_rate,
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "num_prompts": len(requests),
        "engine_startup_time": startup,
        "input_lens": [t.prompt_len for t in traces], "output_lens": [t.output_tokens for t in traces],
        "ttfts": [t.ttft for t in traces], "e2els": [t.latency for t in traces],
    }
    print_report(result, args)
    if args.output_json:
        write_json(args.output_json, vars(args), result)
    if args.plot:
        ok = [t for t in traces if t.success]
        start = min((t.start_time for t in traces), default=0.0)
        times = np.array([c - start for t in ok for c in t.chunk_times]) if ok else np.zeros(0)
        seconds = np.bincount(times.astype(int)) if len(times) else np.zeros(1)
        plot_cdfs(args.plot, f"bench serve {args.endpoint}", {
            "TTFT": [t.ttft * 1000 for t in ok], "TPOT": [t.tpot * 1000 for t in ok if t.tpot is not None],
            "ITL": [g * 1000 for t in ok for g in t.itl], "E2EL": [t.latency * 1000 for t in ok],
        }, "ms", timeline=(np.arange(len(seconds)), seconds))


def print_report(r: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"{'=' * 20} Serving Benchmark Result {'=' * 20}")
    rows = [
        ("Successful requests", r["completed"]), ("Failed requests", r["failed"]),
        ("Benchmark duration (s)", f"{r['duration']:.2f}"), ("Total input tokens", r["total_input_tokens"]),
        ("Total generated tokens", r["total_output_tokens"]),
        ("Request throughput (req/s)", f"{r['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{r['output_throughput']:.2f}"),
        ("Peak output token throughput (tok/s)", f"{r['max_output_tokens_per_s']:.2f}"),
        ("Total token throughput (tok/s)", f"{r['total_token_throughput']:.2f}"),
    ]
    if "request_goodput" in r:
        rows.append(("Request goodput (req/s)", f"{r['request_goodput']:.2f}"))
    if r.get("engine_startup_time") is not None:
        rows.append(("Engine start-up (s)", f"{r['engine_startup_time']:.2f}"))
    for name in args.percentile_metrics.split(","):
        rows += [(f"{stat.capitalize()} {name.upper()} (ms)", f"{r[f'{stat}_{name}_ms']:.2f}")
                 for stat in ("mean", "median", "std", "p90", "p99")]
    for label, value in rows:
        print(f"{label:<40}{value:>15}")
    # A failed request is only worth a count if the reader can see why it failed.
    if r["errors"]:
        print(f"Errors of the first {len(r['errors'])} failed requests:")
        for error, count in collections.Counter(r["errors"]).most_common():
            print(f"  {count} x {error}")
