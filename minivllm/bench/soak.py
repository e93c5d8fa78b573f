"""`minivllm bench soak`: many streaming clients against a running server for a long time, each
sending its next request as soon as the last one ends, and what a long run must not show: a
request lost (its stream cut without [DONE]) or hung (no end within --request-timeout), a
server whose memory keeps growing after warm-up, KV blocks still held once the load is gone.

Reports requests completed, failed (with an error the client can read) and lost or hung, TTFT
percentiles, the server's RSS (the process given by --pid and its children: the engine core)
from the end of warm-up to the end, and whether /metrics shows the engine idle (no request
running or waiting, KV cache usage 0) after the last request.

Warm-up lasts --warmup seconds and until the engine has run as many tokens as its KV cache holds
(vllm:cache_config_info). On CPU the cache's pages are committed as they are first written
(platforms/cpu.py), so until every block has been used once the RSS grows with the cache, not
with a leak; freed blocks queue behind the never-used ones (core/block_pool.py), so after that
many tokens every block has been handed out and written.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time
from typing import Any

import numpy as np

from minivllm.bench.datasets import SampleRequest, random_requests
from minivllm.bench.metrics import RequestTrace
from minivllm.bench.serve import (
    fetch_metrics_text,
    parse_metrics,
    scrape_metrics,
    send_request,
    server_info,
)
from minivllm.bench.utils import print_rows, write_json

RUNNING, WAITING, KV_USAGE = "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"
COMPUTED_TOKENS = ("minivllm:computed_tokens_total", "")
RSS_SERIES_SECONDS = 10.0


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default=None, help="Served model name (default: the first the server lists).")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--clients", type=int, default=200, help="Concurrent streaming clients.")
    parser.add_argument("--duration", type=float, default=600.0, help="Seconds during which clients start requests.")
    parser.add_argument("--warmup", type=float, default=60.0,
                        help="Least seconds before the RSS baseline is taken (also waits for the KV cache to be "
                             "used once).")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--range-ratio", type=float, default=0.5, help="Lengths uniform in len * (1 -+ r).")
    parser.add_argument("--vocab-size", type=int, default=49152, help="Random prompt ids are drawn below it.")
    parser.add_argument("--request-timeout", type=float, default=300.0, help="A request not ended by then is hung.")
    parser.add_argument("--pid", type=int, default=None, help="The server's process id, for its RSS (and its children's).")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)


def main(args: argparse.Namespace) -> None:
    report = asyncio.run(soak(args))
    print_report(report)
    if args.output_json:
        write_json(args.output_json, vars(args), report)


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp

    url = f"http://{args.host}:{args.port}"
    model, _ = await server_info(url, args.model, args.api_key)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    pool = random_requests(4 * args.clients, args.input_len, args.output_len, args.vocab_size,
                           range_ratio=args.range_ratio, seed=args.seed)
    warmup = WarmUp(url, await fetch_metrics_text(url))
    start = time.perf_counter()
    deadline = start + args.duration
    rss = RssSampler(args.pid)
    watchers = [asyncio.create_task(rss.run()), asyncio.create_task(warmup.run(start + args.warmup))]
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    connector = aiohttp.TCPConnector(limit=args.clients)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        samples = itertools.cycle(pool)
        traces = await asyncio.gather(*(
            client(session, url, model, samples, deadline, headers) for _ in range(args.clients)))
    elapsed = time.perf_counter() - start
    for task in watchers:
        task.cancel()
    idle, metrics = await wait_idle(url, timeout=60.0)
    return summarize([t for client_traces in traces for t in client_traces], elapsed, idle, metrics,
                     rss.series(start), None if warmup.ended is None else warmup.ended - start)


async def client(session: Any, url: str, model: str, samples: itertools.cycle, deadline: float,
                 headers: dict[str, str]) -> list[RequestTrace]:
    """Requests one after another until the deadline (the last one runs to its end)."""
    traces = []
    while time.perf_counter() < deadline:
        sample: SampleRequest = next(samples)
        traces.append(await send_request(session, url, "/v1/completions", model, sample, {"temperature": 1.0}, headers))
    return traces


async def wait_idle(url: str, timeout: float) -> tuple[bool, dict[str, float]]:
    """Whether /metrics shows no request and no KV block held within `timeout` seconds."""
    end = time.perf_counter() + timeout
    while True:
        samples = {name: value for (name, _), value in (await scrape_metrics(url)).items()}
        idle = samples.get(RUNNING) == 0 and samples.get(WAITING) == 0 and samples.get(KV_USAGE) == 0.0
        if idle or time.perf_counter() > end:
            return idle, {k: samples.get(k, float("nan")) for k in (RUNNING, WAITING, KV_USAGE)}
        await asyncio.sleep(0.5)


class WarmUp:
    """Ends warm-up once `not_before` has passed and the engine has computed as many tokens as
    its KV cache holds (see the module's docstring); without those metrics, at `not_before`."""

    def __init__(self, url: str, metrics_text: str) -> None:
        self.url = url
        self.cache_tokens = kv_cache_tokens(metrics_text)
        self.computed_before = parse_metrics(metrics_text).get(COMPUTED_TOKENS)
        self.ended: float | None = None

    async def run(self, not_before: float) -> None:
        await asyncio.sleep(max(0.0, not_before - time.perf_counter()))
        while self.cache_tokens is not None and self.computed_before is not None:
            computed = (await scrape_metrics(self.url)).get(COMPUTED_TOKENS, self.computed_before)
            if computed - self.computed_before >= self.cache_tokens:
                break
            await asyncio.sleep(1.0)
        self.ended = time.perf_counter()


def kv_cache_tokens(metrics_text: str) -> int | None:
    """Tokens the server's KV cache holds, from vLLM's vllm:cache_config_info labels."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == "vllm:cache_config_info" and sample.labels.get("num_gpu_blocks", "None") != "None":
                return int(sample.labels["num_gpu_blocks"]) * int(sample.labels["block_size"])
    return None


class RssSampler:
    """The server's resident memory (its process and children), once a second."""

    def __init__(self, pid: int | None) -> None:
        self.pid = pid
        self.samples: list[tuple[float, int]] = []

    async def run(self) -> None:
        if self.pid is None:
            return
        import psutil

        process = psutil.Process(self.pid)
        while True:
            try:
                members = [process, *process.children(recursive=True)]
                total = 0
                for p in members:
                    try:
                        total += p.memory_info().rss
                    except psutil.NoSuchProcess:
                        pass
            except psutil.NoSuchProcess:
                return
            self.samples.append((time.perf_counter(), total))
            await asyncio.sleep(1.0)

    def series(self, start: float) -> list[tuple[float, int]]:
        """(seconds since `start`, bytes) for every sample."""
        return [(t - start, rss) for t, rss in self.samples]


def summarize(traces: list[RequestTrace], elapsed: float, idle: bool, metrics: dict[str, float],
              rss: list[tuple[float, int]], warmup_seconds: float | None) -> dict[str, Any]:
    """RSS growth is from the first sample after warm-up to the last; None when warm-up did not
    end before the load did (too short a run for the KV cache)."""
    hung = [t for t in traces if "TimeoutError" in t.error]
    lost = [t for t in traces if not t.done and t not in hung]
    failed = [t for t in traces if t.done and not t.success]
    ttfts = np.array([t.ttft for t in traces if t.success]) * 1e3
    warm = [r for t, r in rss if warmup_seconds is not None and t >= warmup_seconds]
    mib = 2**20
    return {
        "requests": len(traces),
        "completed": sum(t.success for t in traces),
        "failed_with_error": len(failed),
        "errors": sorted({t.error for t in failed})[:10],
        "lost": len(lost),
        "hung": len(hung),
        "seconds": elapsed,
        "output_tokens_per_s": sum(t.output_tokens for t in traces if t.success) / elapsed,
        "ttft_p50_ms": float(np.percentile(ttfts, 50)) if len(ttfts) else None,
        "ttft_p99_ms": float(np.percentile(ttfts, 99)) if len(ttfts) else None,
        "warmup_seconds": warmup_seconds,
        "rss_after_warmup_mib": warm[0] / mib if warm else None,
        "rss_max_after_warmup_mib": max(warm) / mib if warm else None,
        "rss_end_mib": warm[-1] / mib if warm else None,
        "rss_growth_percent": (warm[-1] - warm[0]) / warm[0] * 100 if warm else None,
        "rss_series_mib": _every(rss, RSS_SERIES_SECONDS, mib),
        "idle_after": idle,
        "metrics_after": metrics,
    }


def print_report(r: dict[str, Any]) -> None:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f} ms"

    print_rows([
        ("requests (completed / failed / lost / hung)",
         f"{r['requests']} ({r['completed']} / {r['failed_with_error']} / {r['lost']} / {r['hung']})"),
        ("seconds", f"{r['seconds']:.0f}"),
        ("output tokens/s", f"{r['output_tokens_per_s']:.1f}"),
        ("TTFT p50 / p99", f"{ms(r['ttft_p50_ms'])} / {ms(r['ttft_p99_ms'])}"),
        ("warm-up", "did not end (KV cache not used up)" if r["warmup_seconds"] is None else
         f"{r['warmup_seconds']:.0f} s"),
        ("RSS after warm-up -> end (max)", "-" if r["rss_growth_percent"] is None else
         f"{r['rss_after_warmup_mib']:.0f} -> {r['rss_end_mib']:.0f} MiB ({r['rss_growth_percent']:+.1f}%) "
         f"({r['rss_max_after_warmup_mib']:.0f} MiB)"),
        ("engine idle after (running, waiting, KV usage)",
         f"{r['idle_after']} ({', '.join(f'{v:g}' for v in r['metrics_after'].values())})"),
    ])
    for error in r["errors"]:
        print(f"  error: {error}")


def _every(samples: list[tuple[float, int]], seconds: float, unit: int) -> list[tuple[float, float]]:
    """One sample per `seconds` (the first of each interval), rounded, in `unit`s."""
    picked, next_at = [], 0.0
    for t, value in samples:
        if t >= next_at:
            picked.append((round(t, 1), round(value / unit, 1)))
            next_at = t + seconds
    return picked
