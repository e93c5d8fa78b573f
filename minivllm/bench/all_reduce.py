"""`minivllm bench all-reduce`: what tensor parallelism's collectives cost per call and per step.

Starts `--world-size` rank processes that join one gloo world (one core each, as the mp executor
pins them) and times the shared-memory all-reduce at the shapes a decoder layer reduces (hidden
states of a decode step of 1 and 8 rows, and of a prefill chunk), the gloo all-reduce of the same
for comparison, and the logits all-gather. A forward reduces twice per decoder layer plus once
for the embedding and gathers the logits once: the per-step figure multiplies by that.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time

import numpy as np

from minivllm.bench.utils import write_json
from minivllm.utils import get_open_port


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", type=int, default=2, help="Ranks (default: 2).")
    parser.add_argument("--hidden-size", type=int, default=576, help="Width reduced (default: SmolLM2's 576).")
    parser.add_argument("--num-layers", type=int, default=30, help="Decoder layers per forward (default: 30).")
    parser.add_argument("--vocab-size", type=int, default=49152, help="Logits gathered (default: 49152).")
    parser.add_argument("--rows", type=str, default="1,8,512", help="Rows of the reduced tensors (default: 1,8,512).")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--num-iters", type=int, default=300, help="Timed calls per case (default: 300).")
    parser.add_argument("--output-json", type=str, default=None)


def main(args: argparse.Namespace) -> None:
    context = mp.get_context("spawn")
    results = context.Queue()
    init_method = f"tcp://127.0.0.1:{get_open_port()}"
    procs = [context.Process(target=_rank_main, args=(args, rank, init_method, results))
             for rank in range(args.world_size)]
    for p in procs:
        p.start()
    report = results.get(timeout=600)
    for p in procs:
        p.join(60)
    calls_per_step = 2 * args.num_layers + 1
    print(f"{args.world_size} ranks, hidden {args.hidden_size}, {args.dtype}; per call p50 / p99 (us)")
    for row in report["cases"]:
        print(f"  {row['op']:<28} {row['shape']:<14} {row['p50_us']:9.1f} {row['p99_us']:9.1f}")
    for rows in report["rows"]:
        shm = next(r for r in report["cases"] if r["op"] == "all_reduce (shared memory)" and r["rows"] == rows)
        gather = next(r for r in report["cases"] if r["op"] == "all_gather logits")
        per_step_ms = (calls_per_step * shm["p50_us"] + (gather["p50_us"] if rows <= 8 else 0)) / 1e3
        print(f"  per forward of {rows} rows: {calls_per_step} all-reduces"
              f"{' + the logits all-gather' if rows <= 8 else ''} = {per_step_ms:.2f} ms")
    if args.output_json:
        write_json(args.output_json, vars(args), report)


def _rank_main(args: argparse.Namespace, rank: int, init_method: str, results) -> None:
    import torch
    import torch.distributed as dist

    from minivllm.distributed.parallel_state import communicator_shm_name
    from minivllm.distributed.shm_communicator import ShmCommunicator
    from minivllm.executor.cpu_placement import cpus_of_rank, pin_to_cpus

    pin_to_cpus(cpus_of_rank(sorted(os.sched_getaffinity(0)), args.world_size, rank))
    dist.init_process_group("gloo", init_method=init_method, world_size=args.world_size, rank=rank)
    comm = ShmCommunicator(rank, args.world_size, communicator_shm_name(init_method), dist.barrier)
    dtype = getattr(torch, args.dtype)
    row_counts = [int(r) for r in args.rows.split(",")]

    def timed(fn) -> np.ndarray:
        """Calls back to back after one barrier, as a forward makes them (ranks in step)."""
        dist.barrier()
        for _ in range(20):
            fn()
        times = []
        for _ in range(args.num_iters):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return np.array(times) * 1e6

    cases = []
    for rows in row_counts:
        x = torch.randn(rows, args.hidden_size).to(dtype)
        for op, fn in (("all_reduce (shared memory)", lambda x=x: comm.all_reduce(x)),
                       ("all_reduce (gloo)", lambda x=x: dist.all_reduce(x.clone()))):
            t = timed(fn)
            cases.append({"op": op, "rows": rows, "shape": f"[{rows}, {args.hidden_size}]",
                          "p50_us": float(np.percentile(t, 50)), "p99_us": float(np.percentile(t, 99))})
    logits = torch.randn(1, args.vocab_size // args.world_size)
    t = timed(lambda: comm.all_gather(logits, dim=-1))
    cases.append({"op": "all_gather logits", "rows": 1, "shape": f"[1, {args.vocab_size // args.world_size}]",
                  "p50_us": float(np.percentile(t, 50)), "p99_us": float(np.percentile(t, 99))})
    dist.barrier()
    comm.close()
    if rank == 0:
        results.put({"world_size": args.world_size, "dtype": args.dtype, "rows": row_counts, "cases": cases})
    dist.destroy_process_group()
