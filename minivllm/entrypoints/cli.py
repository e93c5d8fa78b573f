"""The `minivllm` command: `minivllm serve [MODEL]`, `minivllm generate --prompt ...`,
`minivllm bench throughput|latency|serve|soak|broadcast|all-reduce|roofline ...`,
`minivllm trace summarize FILE`.

Building the parser imports no engine, server or model code: each command imports what it runs.
Every argument is checked (sampling parameters, then engine settings) before an engine starts.
"""

from __future__ import annotations

import argparse
import sys

from minivllm.engine.arg_utils import EngineArgs
from minivllm.entrypoints.openai.cli_args import add_serve_args


def _generate(args: argparse.Namespace) -> None:
    from minivllm.entrypoints.llm import LLM
    from minivllm.sampling_params import SamplingParams

    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        max_tokens=args.max_tokens, seed=args.sampling_seed,
    )
    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    try:
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params, use_tqdm=False)
        else:
            outputs = llm.generate(args.prompt, params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    for prompt, output in zip(args.prompt, outputs, strict=True):
        print(f"Prompt: {prompt!r}\nOutput: {output.outputs[0].text!r}\n")


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minivllm", description="A compact vLLM-style inference engine.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="Generate text for one or more prompts and print it.")
    gen.add_argument("--prompt", action="append", required=True, help="A prompt; repeat for several.")
    gen.add_argument("--chat", action="store_true", help="Wrap each prompt as a user message in the chat template.")
    gen.add_argument("--max-tokens", type=int, default=64, help="Tokens to generate per prompt (default: 64).")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0).")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None, help="Per-request sampling seed.")
    EngineArgs.add_cli_args(gen)
    gen.set_defaults(func=_generate)

    serve = sub.add_parser("serve", help="Start the OpenAI-compatible server.")
    add_serve_args(serve)
    serve.set_defaults(func=_serve)

    bench = sub.add_parser("bench", help="Benchmarks.").add_subparsers(dest="bench_command", required=True)
    from minivllm.bench import all_reduce as bench_all_reduce
    from minivllm.bench import broadcast as bench_broadcast
    from minivllm.bench import latency as bench_latency
    from minivllm.bench import roofline as bench_roofline
    from minivllm.bench import serve as bench_serve
    from minivllm.bench import soak as bench_soak
    from minivllm.bench import throughput as bench_throughput

    for name, module, help_text in (
        ("throughput", bench_throughput, "Offline throughput of LLM.generate."),
        ("latency", bench_latency, "Latency of one batch, run repeatedly."),
        ("serve", bench_serve, "Load an OpenAI-compatible server and measure what its users see."),
        ("soak", bench_soak, "Many streaming clients for a long time: nothing lost or hung, memory flat, no block leaked."),
        ("broadcast", bench_broadcast, "Round-trip latency of the shared-memory message queue."),
        ("all-reduce", bench_all_reduce, "Cost of tensor parallelism's collectives per call and per step."),
        ("roofline", bench_roofline, "A model's physical limits here: bandwidth and matmul floors, measured."),
    ):
        command = bench.add_parser(name, help=help_text)
        module.add_cli_args(command)
        command.set_defaults(func=module.main)

    trace = sub.add_parser("trace", help="Trace files (--trace-dir).").add_subparsers(dest="trace_command", required=True)
    summary = trace.add_parser("summarize", help="Per-phase totals of a trace file: count, total ms, mean ms.")
    summary.add_argument("file", help="A trace JSON file written under --trace-dir.")
    summary.set_defaults(func=_summarize_trace)
    return parser


def _summarize_trace(args: argparse.Namespace) -> None:
    from minivllm.engine.tracing import print_summary

    print_summary(args.file)


def _serve(args: argparse.Namespace) -> None:
    from minivllm.entrypoints.openai.api_server import run_server

    run_server(args)


def main(argv: list[str] | None = None) -> None:
    args = make_parser().parse_args(argv)
    try:
        args.func(args)
    except ValueError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
