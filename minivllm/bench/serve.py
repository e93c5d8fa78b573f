"""`minivllm bench serve`: load an OpenAI-compatible server (ours, vLLM, llama.cpp's) with
streaming requests at a given rate and measure what its users see: TTFT, TPOT, ITL, end-to-end
latency, throughputs, goodput under SLOs. vLLM's flags and JSON keys."""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from minivllm.bench.datasets import SampleRequest, add_dataset_args, build_dataset, random_requests
from minivllm.bench.metrics import RequestTrace, parse_goodput, summarize
from minivllm.bench.utils import (
    plot_cdfs,
    print_rows,
    spec_decode_report,
    spec_decode_rows,
    write_json,
)
from minivllm.core.outputs import SpecDecodingStats

# The --structured-output workloads: the constraint, and a check of an output that is independent
# of the server (a constrained reply cut by max_tokens fails it).
_JSON_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "email": {"type": "string", "maxLength": 60}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                                            "maxItems": 5},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]}},
    "required": ["name", "age", "email", "tags", "address"]}
_CHOICES = ["positive", "negative", "neutral", "mixed"]
_REGEX = r"[A-Z][a-z]{2,9} [0-9]{1,4}, [A-Z]{2} [0-9]{5}"
# What every request of such a run asks (constrained or not: the same requests, so their TPOT
# compares), the constraint, and the check.
STRUCTURED_OUTPUTS: dict[str, tuple[str, dict[str, Any], Callable[[str], bool]]] = {
    "json": (f"Write an example user profile as JSON following this schema: {json.dumps(_JSON_SCHEMA)}",
             {"json": _JSON_SCHEMA}, lambda text: _is_json_object(text)),
    "choice": ("Is this review positive, negative, neutral or mixed? 'Great cast, far too long.'",
               {"choice": _CHOICES}, lambda text: text in _CHOICES),
    "regex": ("Write a street address in the form 'Market 12, CA 94105':",
              {"regex": _REGEX}, lambda text: re.fullmatch(_REGEX, text) is not None),
}


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


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
    parser.add_argument("--burst-num-prompts", type=int, default=0,
                        help="Also send this many random prompts all at once, --burst-delay seconds in: long "
                             "prompts arriving while the others decode (how much do running streams stall?).")
    parser.add_argument("--burst-input-len", type=int, default=1000)
    parser.add_argument("--burst-output-len", type=int, default=32)
    parser.add_argument("--burst-delay", type=float, default=5.0,
                        help="Seconds after the first request is sent.")
    parser.add_argument("--structured-output", choices=sorted(STRUCTURED_OUTPUTS), default=None,
                        help="Send every request one instruction and constrain some (vLLM's structured_outputs "
                             "field): a JSON schema, a regex or a choice; the report checks their outputs and "
                             "compares their TPOT with the unconstrained requests of the same run.")
    parser.add_argument("--structured-output-ratio", type=float, default=1.0,
                        help="Share of the requests constrained, spread evenly over the run (0: none, for a "
                             "baseline of the same requests).")
    parser.add_argument("--watch-engine-events", action="store_true",
                        help="Read /v1/engine/events during the run, as an open dashboard does (the engine "
                             "collects events only while someone watches): to measure what watching costs.")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=None, help="Sent with every request when given.")
    parser.add_argument("--top-k", type=int, default=None, help="Sent with every request when given.")
    parser.add_argument("--goodput", nargs="+", default=None, help="SLOs in ms, e.g. ttft:500 tpot:50 e2el:3000.")
    parser.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--plot", default=None, help="Write latency CDFs and throughput over time (PNG) here.")
    parser.add_argument("--disable-tqdm", action="store_true")


def sampling_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling parameters every request carries: temperature, and top_p / top_k if given."""
    fields: dict[str, Any] = {"temperature": args.temperature}
    fields.update({name: value for name, value in (("top_p", args.top_p), ("top_k", args.top_k)) if value is not None})
    return fields


async def send_request(session: Any, url: str, endpoint: str, model: str, sample: SampleRequest,
                       sampling: dict[str, Any], headers: dict[str, str]) -> RequestTrace:
    """One streaming request; the arrival time of every chunk with choices is recorded."""
    import aiohttp

    payload: dict[str, Any] = {
        "model": model, "max_tokens": sample.expected_output_len, **sampling, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True,
    }
    if sample.structured_outputs is not None:
        payload["structured_outputs"] = sample.structured_outputs
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
                    trace.done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:  # the request failed after its stream began
                    trace.error = f"stream error: {chunk['error'].get('message', '')}"[:200]
                    continue
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
                text = "".join(_chunk_text(c) for c in choices)
                trace.text += text
                trace.chunk_tokens.append(1 if text else 0)
                last = now
        trace.latency = last - trace.start_time
        trace.output_tokens = trace.output_tokens or sum(trace.chunk_tokens)
        trace.success = bool(trace.chunk_times) and not trace.error
        if not trace.chunk_times and not trace.error:
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


def send_times(args: argparse.Namespace, num_requests: int, num_burst: int) -> list[float]:
    """Seconds from the start at which each request goes out: the dataset's requests at the
    arrival rate, then the burst's all at --burst-delay."""
    times = np.cumsum(arrival_gaps(num_requests, args.request_rate, args.burstiness, args.seed))
    return [*times.tolist(), *[args.burst_delay] * num_burst]


def constrain(requests: list[SampleRequest], kind: str | None, ratio: float, tokenizer: Any) -> list[bool]:
    """Give every request `kind`'s prompt, and its constraint to a `ratio` share of them, spread
    evenly (request i is constrained when floor((i + 1) * ratio) > floor(i * ratio)); which
    ones were."""
    if kind is None:
        return [False] * len(requests)
    if not 0.0 <= ratio <= 1.0:
        raise ValueError("--structured-output-ratio must be in [0, 1] (0: the same requests, none constrained).")
    prompt, constraint, _ = STRUCTURED_OUTPUTS[kind]
    prompt_token_ids = tokenizer.encode(prompt)
    chosen = [int((i + 1) * ratio) > int(i * ratio) for i in range(len(requests))]
    for request, constrained in zip(requests, chosen, strict=True):
        request.prompt, request.prompt_token_ids, request.messages = prompt, prompt_token_ids, None
        if constrained:
            request.structured_outputs = constraint
    return chosen


def structured_output_report(traces: list[RequestTrace], constrained: list[bool], kind: str | None) -> dict[str, Any]:
    """TPOT of the constrained requests and of the others in the same run, and how many
    constrained outputs pass the workload's own check."""
    if kind is None:
        return {}
    check = STRUCTURED_OUTPUTS[kind][2]
    report: dict[str, Any] = {"structured_output": kind}
    for name, group in (("constrained", True), ("free", False)):
        tpots = [1000 * t.tpot for t, c in zip(traces, constrained, strict=True)
                 if c == group and t.success and t.tpot is not None]
        report[f"{name}_requests"] = sum(c == group for c in constrained)
        if tpots:
            report[f"{name}_tpot_ms"] = {"mean": float(np.mean(tpots)), "median": float(np.median(tpots)),
                                         "p99": float(np.percentile(tpots, 99))}
    report["constrained_valid"] = sum(check(t.text) for t, c in zip(traces, constrained, strict=True) if c)
    return report


def burst_requests(args: argparse.Namespace, vocab_size: int) -> list[SampleRequest]:
    if args.burst_num_prompts < 0 or args.burst_input_len < 1 or args.burst_output_len < 1 or args.burst_delay < 0:
        raise ValueError("Need --burst-num-prompts >= 0, --burst-input-len and --burst-output-len >= 1, "
                         "--burst-delay >= 0.")
    # A seed of its own: the burst's prompts share no prefix with the dataset's.
    return random_requests(args.burst_num_prompts, args.burst_input_len, args.burst_output_len, vocab_size,
                           seed=args.seed + 1)


async def run(args: argparse.Namespace, url: str, model: str, requests: list[SampleRequest],
              times: list[float], events_seen: dict[str, int]) -> tuple[list[RequestTrace], float]:
    """Send each request at its time (seconds from the start); traces in the order of `requests`.
    With --watch-engine-events, what the event stream sent meanwhile goes into events_seen."""
    import aiohttp
    from tqdm.auto import tqdm

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limit = asyncio.Semaphore(args.max_concurrency or len(requests))
    bar = tqdm(total=len(requests), disable=args.disable_tqdm, desc="requests")
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one(sample: SampleRequest) -> RequestTrace:
            async with limit:
                trace = await send_request(session, url, args.endpoint, model, sample, sampling_fields(args), headers)
            bar.update(1)
            return trace

        watcher = None
        if args.watch_engine_events:
            watcher = asyncio.create_task(watch_engine_events(session, url, headers, events_seen))
            await asyncio.sleep(1.0)  # connected, and the engine told
        start = time.perf_counter()
        tasks: dict[int, asyncio.Task[RequestTrace]] = {}
        for i in sorted(range(len(requests)), key=times.__getitem__):
            await asyncio.sleep(max(0.0, start + times[i] - time.perf_counter()))
            tasks[i] = asyncio.create_task(one(requests[i]))
        traces = await asyncio.gather(*(tasks[i] for i in range(len(requests))))
        duration = time.perf_counter() - start
        if watcher is not None:
            await wait_until_quiet(events_seen)
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
    bar.close()
    return list(traces), duration


async def wait_until_quiet(seen: dict[str, int], quiet_s: float = 0.5, limit_s: float = 5.0) -> None:
    """Until the event stream has sent nothing for quiet_s (at most limit_s): the last steps'
    messages leave the server after their responses, and belong to the run too."""
    deadline = time.perf_counter() + limit_s
    while time.perf_counter() < deadline:
        before = seen["messages"]
        await asyncio.sleep(quiet_s)
        if seen["messages"] == before:
            return


async def watch_engine_events(session: Any, url: str, headers: dict[str, str], seen: dict[str, int]) -> None:
    """Read the engine's event stream until cancelled, counting its messages and bytes."""
    tail = b""  # a marker may straddle two chunks: the last 5 bytes carried over cannot hold one
    async with session.get(f"{url}/v1/engine/events", headers=headers) as response:
        response.raise_for_status()
        async for chunk in response.content.iter_any():
            seen["bytes"] += len(chunk)
            data = tail + chunk
            seen["messages"] += data.count(b"data: ")
            tail = data[-5:]


async def server_info(url: str, model: str | None, api_key: str | None) -> tuple[str, str | None]:
    """The model to ask for and its local path (for the tokenizer), from /v1/models."""
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/v1/models", headers=headers) as response:
            cards = (await response.json())["data"]
    card = next((c for c in cards if model is None or c["id"] == model), cards[0])
    return model or card["id"], card.get("root")


async def scrape_metrics(url: str) -> dict[tuple[str, str], float]:
    """The server's /metrics samples (parse_metrics); empty when the server has none (not every
    OpenAI-compatible server does)."""
    return parse_metrics(await fetch_metrics_text(url))


async def fetch_metrics_text(url: str) -> str:
    """The server's /metrics page; "" when it has none."""
    import aiohttp

    try:
        async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as response:
            return await response.text() if response.status == 200 else ""
    except aiohttp.ClientError:
        return ""


def parse_metrics(text: str) -> dict[tuple[str, str], float]:
    """Prometheus text as {(name, le or position label): value} ("" where neither)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(sample.name, sample.labels.get("le", sample.labels.get("position", ""))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def spec_decoding_counters(samples: dict[tuple[str, str], float]) -> SpecDecodingStats | None:
    """vLLM's spec_decode counters from a /metrics scrape; None when the server does not speculate."""
    prefix = "vllm:spec_decode_num_"
    if (f"{prefix}drafts_total", "") not in samples:
        return None
    per_pos = sorted((int(pos), int(v)) for (name, pos), v in samples.items()
                     if name == f"{prefix}accepted_tokens_per_pos_total")
    return SpecDecodingStats(len(per_pos), int(samples[(f"{prefix}drafts_total", "")]),
                             int(samples.get((f"{prefix}draft_tokens_total", ""), 0)),
                             int(samples.get((f"{prefix}accepted_tokens_total", ""), 0)), [v for _, v in per_pos])


def engine_step_report(before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]) -> dict[str, Any]:
    """The engine's steps during the run, from minivllm's /metrics: how many, their total time
    (the engine's work, apart from idle waits), how long (bucket bounds of the step-time
    histogram), how many overran --max-step-ms, and how close the step cost model's predictions
    came. Empty for servers without those metrics."""
    def delta(name: str, le: str = "") -> float:
        return after.get((name, le), 0.0) - before.get((name, le), 0.0)

    steps = delta("minivllm:engine_step_seconds_count")
    if (("minivllm:engine_step_seconds_count", "") not in after) or steps <= 0:
        return {}

    def quantile_bound(name: str, q: float) -> float:
        """The smallest bucket bound with at least a q share of the run's observations under it."""
        total = delta(f"{name}_count")
        bounds = sorted(float(le) for (n, le) in after if n == f"{name}_bucket")
        return next(b for b in bounds if delta(f"{name}_bucket", _le(b)) >= q * total)

    report: dict[str, Any] = {
        "engine_steps": int(steps),
        "engine_busy_s": delta("minivllm:engine_step_seconds_sum"),
        "engine_step_p50_ms_at_most": 1000 * quantile_bound("minivllm:engine_step_seconds", 0.5),
        "engine_step_p99_ms_at_most": 1000 * quantile_bound("minivllm:engine_step_seconds", 0.99),
        "steps_over_budget": int(delta("minivllm:steps_over_budget_total")),
    }
    predicted = delta("minivllm:step_cost_relative_error_count")
    if predicted > 0:
        error = "minivllm:step_cost_relative_error"
        report |= {
            "step_cost_error_mean": delta(f"{error}_sum") / predicted,
            "step_cost_within_10pct": delta(f"{error}_bucket", "0.1") / predicted,
            "step_cost_within_25pct": delta(f"{error}_bucket", "0.25") / predicted,
        }
    return report


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else str(bound)


def main(args: argparse.Namespace) -> None:
    from minivllm.transformers_utils.tokenizer import get_tokenizer

    url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    slos = parse_goodput(args.goodput)
    model, root = asyncio.run(server_info(url, args.model, args.api_key))
    tokenizer_path = args.tokenizer or (root if root and os.path.exists(root) else None)
    if tokenizer_path is None:
        raise ValueError("Give --tokenizer: the server does not report a local model path.")
    tokenizer = get_tokenizer(tokenizer_path)
    requests = build_dataset(args, tokenizer, len(tokenizer))
    times = send_times(args, len(requests), args.burst_num_prompts)
    requests += burst_requests(args, len(tokenizer))
    constrained = constrain(requests, args.structured_output, args.structured_output_ratio, tokenizer)
    if args.endpoint.endswith("chat/completions"):
        for r in requests:
            r.prompt = r.prompt if r.prompt is not None else tokenizer.decode(r.prompt_token_ids)
    metrics_before = asyncio.run(scrape_metrics(url))
    events_seen = {"messages": 0, "bytes": 0}
    traces, duration = asyncio.run(run(args, url, model, requests, times, events_seen))
    metrics_after = asyncio.run(scrape_metrics(url))
    steps = engine_step_report(metrics_before, metrics_after) | spec_decode_report(
        spec_decoding_counters(metrics_before), spec_decoding_counters(metrics_after))
    startup = metrics_before.get(("minivllm:engine_startup_seconds", ""))
    result = summarize(traces, duration, slos) | steps | structured_output_report(
        traces, constrained, args.structured_output) | {
        "model": model, "endpoint": args.endpoint, "request_rate": args.request_rate,
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "num_prompts": len(requests),
        "burst_num_prompts": args.burst_num_prompts,
        "engine_startup_time": startup,
        "engine_event_messages": events_seen["messages"] if args.watch_engine_events else None,
        "engine_event_bytes": events_seen["bytes"] if args.watch_engine_events else None,
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
    if r.get("engine_event_messages") is not None:
        rows.append(("Engine event messages (MB) read", f"{r['engine_event_messages']} "
                                                        f"({r['engine_event_bytes'] / 1e6:.1f})"))
    if "engine_steps" in r:
        rows += [
            ("Engine steps", r["engine_steps"]),
            ("Engine busy in steps (s)", f"{r['engine_busy_s']:.2f}"),
            ("Engine step p50 / p99 (ms, at most)",
             f"{r['engine_step_p50_ms_at_most']:g} / {r['engine_step_p99_ms_at_most']:g}"),
            ("Steps over --max-step-ms", r["steps_over_budget"]),
        ]
    if "step_cost_error_mean" in r:
        rows += [
            ("Step cost model mean |error| (%)", f"{100 * r['step_cost_error_mean']:.1f}"),
            ("Steps predicted within 10% / 25% (%)",
             f"{100 * r['step_cost_within_10pct']:.0f} / {100 * r['step_cost_within_25pct']:.0f}"),
        ]
    if "structured_output" in r:
        rows.append((f"Constrained ({r['structured_output']}) valid",
                     f"{r['constrained_valid']} of {r['constrained_requests']}"))
        for name in ("constrained", "free"):
            if f"{name}_tpot_ms" in r:
                tpot = r[f"{name}_tpot_ms"]
                rows.append((f"TPOT {name} mean / median / p99 (ms)",
                             f"{tpot['mean']:.1f} / {tpot['median']:.1f} / {tpot['p99']:.1f}"))
    rows += spec_decode_rows(r)
    for name in args.percentile_metrics.split(","):
        rows += [(f"{stat.capitalize()} {name.upper()} (ms)", f"{r[f'{stat}_{name}_ms']:.2f}")
                 for stat in ("mean", "median", "std", "p90", "p99")]
    print_rows(rows)
    # A failed request is only worth a count if the reader can see why it failed.
    if r["errors"]:
        print(f"Errors of the first {len(r['errors'])} failed requests:")
        for error, count in collections.Counter(r["errors"]).most_common():
            print(f"  {count} x {error}")
